"""Calling the user's code (Model A's factory, the dataset's ``__len__`` and ``__getitem__``), and
what featstore makes of what it raises.

Whatever the user's code raises reaches the caller as a featstore error with the user's
exception as its ``__cause__`` (``featstore --debug`` prints both): :class:`ComputeFailed`
naming what was called, on which samples, what to do and where the user's exception was raised,
or :class:`DeviceSetupError` when it asked for CUDA where there is none. The message alone
carries the user's exception type, text and place: a DataLoader worker process hands the
training process an error's class and message only (no ``__cause__``). A featstore error raised
inside (a factory that calls featstore) passes through unchanged. The driver (validation,
fingerprints) and the Dask tasks call the user's code through these functions, so both say the
same thing.
"""

from __future__ import annotations

import inspect
import os
import sysconfig
import traceback
import types
from collections.abc import Sequence
from typing import Any


from featstore.errors import ComputeFailed, DeviceSetupError, FeatstoreError, InvalidInput
from featstore._lazy import torch  # imported on first use: the quick commands never need it

#: What torch says when code asks for CUDA on a machine (or build) without it.
CUDA_MISSING = ("Torch not compiled with CUDA enabled", "No CUDA GPUs are available", "Found no NVIDIA driver",
                "no CUDA-capable device", "CUDA driver initialization failed")


def cuda_missing(exc: BaseException) -> bool:
    """Whether ``exc`` is torch refusing CUDA because this process has none.

    >>> cuda_missing(AssertionError("Torch not compiled with CUDA enabled"))
    True
    """
    text = str(exc)
    return any(s in text for s in CUDA_MISSING)


def user_error(exc: BaseException, what: str, fix: str, where: str = "") -> FeatstoreError:
    """The featstore error for ``exc``, raised by the user's ``what`` (``where``: on which samples;
    raise it ``from exc``).

    >>> str(user_error(ValueError("bad row"), "dataset[3]", "fix the dataset, then rerun."))
    'dataset[3] raised ValueError: bad row; fix the dataset, then rerun.'
    """
    if isinstance(exc, FeatstoreError):
        return exc
    if cuda_missing(exc):
        return DeviceSetupError(
            f"{what} asks for CUDA, but this process sees no CUDA device ({type(exc).__name__}: {exc}). "
            "Build Model A on the CPU (no .cuda() or .to('cuda') in it): featstore moves it to each "
            "worker's GPU itself; or run the compute where a GPU is visible.")
    at = raised_at(exc)
    return ComputeFailed(f"{what} raised {type(exc).__name__}: {exc}{' ' + where if where else ''}; {fix}"
                         + (f" Raised at {at}." if at else ""))


#: featstore's own folder, and the standard library's and installed packages': frames in them
#: are not the user's code.
_FEATSTORE = os.path.dirname(os.path.abspath(__file__)) + os.sep
_LIBRARIES = tuple({os.path.abspath(p) + os.sep for k, p in sysconfig.get_paths().items()
                    if k in ("stdlib", "platstdlib", "purelib", "platlib")})


def raised_at(exc: BaseException) -> str:
    """Where ``exc`` was raised, as ``file:line in function``: the innermost frame of the user's
    own code (else the innermost outside featstore), the file relative to the working folder when
    it lies under it; "" for an exception that was never raised.

    >>> raised_at(ValueError("never raised"))
    ''
    """
    frames = [f for f in traceback.extract_tb(exc.__traceback__)
              if not os.path.abspath(f.filename).startswith(_FEATSTORE)]
    if not frames:
        return ""
    own = [f for f in frames if not os.path.abspath(f.filename).startswith(_LIBRARIES)]
    frame = (own or frames)[-1]
    path = os.path.abspath(frame.filename)
    cwd = os.getcwd() + os.sep
    return f"{path[len(cwd):] if path.startswith(cwd) else frame.filename}:{frame.lineno} in {frame.name}"


def describe(obj: Any) -> str:
    """A short name for a user's callable in messages: ``pkg.module:name`` for a function or a
    class (like an import path), else its repr (``Factory('pkg.models:teacher')``).

    >>> describe(torch.nn.Linear)
    'torch.nn.modules.linear:Linear'
    """
    if isinstance(obj, (types.FunctionType, types.BuiltinFunctionType, types.MethodType, type)):
        module = getattr(obj, "__module__", None)
        return f"{module}:{obj.__qualname__}" if module and module != "builtins" else obj.__qualname__
    text = repr(obj)
    return text if len(text) <= 80 else text[:77] + "..."


def check_zero_arguments(fn: Any, what: str, fix: str = "") -> None:
    """Raise :class:`InvalidInput` when ``fn`` cannot be called without arguments (``model=nn.Linear``,
    a class that needs its sizes), before calling it; ``fix`` replaces the default advice."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # no signature to read (some builtins): the call will tell
        return
    try:
        sig.bind()
    except TypeError:
        needs = [p.name for p in sig.parameters.values() if p.default is p.empty
                 and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        name = getattr(fn, "__name__", "factory")
        fix = fix or f"pass a built object ({name}(...)) or a zero-argument factory (lambda: {name}(...))"
        raise InvalidInput(f"{what} {describe(fn)}, which needs arguments ({', '.join(needs)}); {fix}.") from None


def call_factory(factory: Any, what: str) -> Any:
    """``factory()``, after checking it takes no arguments; what it raises is wrapped."""
    check_zero_arguments(factory, f"{what} is")
    try:
        return factory()
    except FeatstoreError:
        raise
    except Exception as exc:  # noqa: BLE001 - the user's code raises anything
        raise user_error(exc, f"{what} {describe(factory)}", "fix it, then rerun.") from exc


def build_model(model: object) -> torch.nn.Module:
    """Model A: ``model`` itself (an ``nn.Module``) or what its zero-argument factory builds."""
    if isinstance(model, torch.nn.Module):
        return model
    if not callable(model):
        raise InvalidInput(f"model must be a torch.nn.Module or a zero-argument factory, got {type(model).__name__}.")
    built = call_factory(model, "the model factory")
    if not isinstance(built, torch.nn.Module):
        raise InvalidInput(f"the model factory {describe(model)} returned a {type(built).__name__}; it must return "
                           "a torch.nn.Module.")
    return built


def dataset_length(dataset: Any) -> int:
    """``len(dataset)`` of a map-style dataset (an :class:`InvalidInput` for anything else)."""
    if not (hasattr(type(dataset), "__len__") and hasattr(type(dataset), "__getitem__")):
        raise InvalidInput(f"dataset must be a map-style dataset with __len__ and __getitem__, got a "
                           f"{type(dataset).__name__} (an IterableDataset cannot be split into shards by index).")
    try:
        return len(dataset)
    except FeatstoreError:
        raise
    except Exception as exc:  # noqa: BLE001
        raise user_error(exc, "len(dataset)", "fix the dataset's __len__, then rerun.") from exc


def read_items(dataset: Any, indices: Sequence[int]) -> list[Any]:
    """``dataset[i]`` for each index (one ``__getitems__`` call where the dataset has one); what
    the dataset raises names the index and the fix."""
    getitems = getattr(dataset, "__getitems__", None) if len(indices) > 1 else None
    if getitems is not None:
        try:
            return list(getitems(list(indices)))
        except FeatstoreError:
            raise
        except Exception as exc:  # noqa: BLE001
            what = f"dataset.__getitems__ for samples [{indices[0]}, {indices[-1] + 1})" if indices else "dataset"
            raise _item_error(exc, dataset, what) from exc
    out = []
    for i in indices:
        try:
            out.append(dataset[i])
        except FeatstoreError:
            raise
        except Exception as exc:  # noqa: BLE001
            raise _item_error(exc, dataset, f"dataset[{i}]") from exc
    return out


def read_item(dataset: Any, index: int) -> Any:
    """``dataset[index]`` (see :func:`read_items`)."""
    return read_items(dataset, [index])[0]


def _item_error(exc: Exception, dataset: Any, what: str) -> FeatstoreError:
    if isinstance(exc, IndexError):
        try:
            n = f"len(dataset) is {len(dataset)}, so "
        except Exception:  # noqa: BLE001 - only for the message
            n = ""
        return user_error(exc, what, f"{n}__getitem__ must serve every index below len(dataset): fix the "
                                     "dataset's __len__ or its items, then rerun.")
    return user_error(exc, what, "fix the dataset (or drop the bad records from it), then rerun: finished "
                                 "shards are kept.")
