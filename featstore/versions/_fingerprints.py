"""Digests of Model A's weights and code, the dataset's identity and the compute config.

Same fingerprint => same stored outputs => nothing is recomputed. Model A is identified by two
digests: its weights (the ``state_dict`` bytes: parameters and buffers) and its code
(:func:`code_digest`: the classes of its module tree, the source of the ones that are yours,
and their plain settings), so changing one weight or what ``forward`` returns makes a new
version, while editing a comment or reformatting does not. What neither digest can see (code
outside those classes, global state) is named in the README; ``ComputeOptions(model_id=...)``
replaces both digests with the user's own name for A.
"""

from __future__ import annotations

import ast
import hashlib
import inspect
import textwrap
import types
import warnings
from collections.abc import Mapping


from featstore.errors import FingerprintWarning, InvalidInput
from featstore._json import JSON, JSONObject, canonical_json
from featstore._user_code import build_model, dataset_length, read_item
from featstore._user_types import DeclaresIdentity, MapDataset, ModelSpec
from featstore._lazy import torch  # imported on first use: the quick commands never need it
from featstore.versions._digests import array_bytes, item_digest, update_item


DATASET_SAMPLES = 16


def weights_digest(model: torch.nn.Module) -> str:
    """sha256 over every state_dict entry's name, dtype, shape and bytes.

    >>> weights_digest(torch.nn.Linear(2, 2)) != weights_digest(torch.nn.Linear(2, 2))
    True
    """
    h = hashlib.sha256()
    for name, value in sorted(model.state_dict().items()):
        h.update(name.encode() + b"\0")
        h.update(array_bytes(value) if isinstance(value, torch.Tensor) else repr(value).encode())
    return h.hexdigest()


def sample_positions(n: int, k: int = DATASET_SAMPLES) -> list[int]:
    """Evenly spaced indices (first and last included) used to digest a dataset's content."""
    if n <= k:
        return list(range(n))
    return sorted({round(i * (n - 1) / (k - 1)) for i in range(k)})


def dataset_digest(dataset: MapDataset, dataset_id: str | None = None) -> JSONObject:
    """The dataset's identity: its length plus a user id or a digest of sampled items (a
    :class:`FingerprintWarning` when the same index reads back different items)."""
    n = dataset_length(dataset)
    if dataset_id is not None:
        return {"length": n, "id": str(dataset_id)}
    digest = sampled_digest(dataset)
    check_repeatable(dataset)
    return {"length": n, "sampled": DATASET_SAMPLES, "digest": digest}


def sampled_digest(dataset: MapDataset) -> str:
    """sha256 of the items at :func:`sample_positions` (first and last included): what
    :func:`dataset_digest` records without an id, and what ``extends`` compares on the range
    a dataset shares with its parent. Raises :class:`InvalidInput` for items it cannot digest."""
    h = hashlib.sha256()
    for i in sample_positions(dataset_length(dataset)):
        update_item(h, read_item(dataset, i))
    return h.hexdigest()


def dataset_fingerprint(dataset: MapDataset) -> str | None:
    """The content fingerprint a dataset keeps of itself, where it has one: a Hugging Face
    ``datasets.Dataset``'s ``_fingerprint`` (a hash of its data files or table and of every
    transform applied, which ``datasets`` itself trusts for its cache), as ``"datasets:<hex>"``;
    None for any other dataset. A manifest records it (``source_fingerprint``): a rerun whose
    dataset shows the same one is not read again."""
    fp = getattr(dataset, "_fingerprint", None)
    module = type(dataset).__module__.split(".")[0]
    return f"datasets:{fp}" if module == "datasets" and isinstance(fp, str) else None


def check_repeatable(dataset: MapDataset) -> None:
    """Warn unless the first and the last item read back the same a second time: else the
    sampled digest differs on every run, so every rerun would compute a new version (and the
    stored outputs would belong to one random draw of the items)."""
    n = dataset_length(dataset)
    for i in sorted({0, n - 1}):
        if item_digest(read_item(dataset, i)) != item_digest(read_item(dataset, i)):
            warnings.warn(FingerprintWarning(
                f"dataset[{i}] gave two different items on two reads (its __getitem__ draws random numbers or "
                "reads changing data), so the dataset's sampled digest changes on every run: each rerun computes "
                "a new version. Make __getitem__ deterministic (augment with views=K and augment=fn, which replay "
                "exactly), or name the contents with ComputeOptions(dataset_id='...') (--dataset-id)."),
                stacklevel=2)
            return


def describe_key(key: object) -> JSON:
    """A JSON-able description of an ``input_key``/``keep`` selector (callables by source)."""
    if key is None or isinstance(key, (str, int)):
        return key
    if callable(key):
        try:
            src = inspect.getsource(key)
        except (OSError, TypeError):
            src = getattr(key, "__qualname__", repr(key))
        return {"callable": hashlib.sha256(src.encode()).hexdigest()}
    raise InvalidInput(f"input_key must be a str, an int, a callable or None, got {key!r}.")


def fingerprint(parts: JSONObject) -> str:
    """sha256 of the canonical JSON of every part."""
    return hashlib.sha256(canonical_json(parts)).hexdigest()


def model_digest(model: ModelSpec, model_id: str | None) -> JSONObject:
    """``{"model": weights digest, "model_code": code digest}`` for a module, or for a factory
    (built once here unless ``model_id`` is given; then the id is all there is); for a Model A
    that declares its identity (:class:`~featstore._user_types.DeclaresIdentity`), its weights
    digest and ``"engine"`` besides. Warns
    (:class:`FingerprintWarning`) when Model A holds code the digests cannot see."""
    if model_id is not None:
        return {"model": "id:" + str(model_id), "model_code": None}
    built = build_model(model)
    if isinstance(built, DeclaresIdentity):  # an engine or servers: the weights are not in the module
        identity = built.featstore_identity()
        return {"model": identity.weights, "model_code": code_digest(built), "engine": identity.engine}
    blind = blind_spots(built)
    if blind:
        warnings.warn(FingerprintWarning(
            f"Model A holds code its fingerprint cannot see: {'; '.join(blind[:5])}"
            f"{f' (and {len(blind) - 5} more)' if len(blind) > 5 else ''}. Changing it would not make a new "
            "version: compute would return the outputs stored for the old one. Name this exact Model A with "
            "ComputeOptions(model_id='...') (--model-id; a new id whenever that code changes), or make it a "
            "method or a submodule of your classes."), stacklevel=2)
    return {"model": weights_digest(built), "model_code": code_digest(built)}


def _plain_callable(value: object) -> bool:
    """A callable the code digest cannot see: a function, lambda, partial, bound method or callable
    object of the user's (not a module, not a class, not torch's or Python's own function)."""
    if isinstance(value, (torch.nn.Module, type)) or not callable(value):
        return False
    target = getattr(value, "func", value)  # functools.partial: the function it wraps
    module = getattr(target, "__module__", None) or type(target).__module__ or ""
    return module.split(".")[0] not in LIBRARY_PACKAGES | {"math", "operator", "numpy"}


def blind_spots(model: torch.nn.Module) -> list[str]:
    """What of Model A the fingerprint cannot see, found in the module tree: plain functions
    held as attributes (also in lists, tuples and dicts) and forward hooks.

    >>> blind_spots(torch.nn.Linear(2, 2))
    []
    """
    found = []
    for path, module in model.named_modules():
        where = f"{type(module).__name__} {path!r}" if path else type(module).__name__
        for name, value in sorted(vars(module).items()):
            if name.startswith("_"):
                continue
            values = list(value.values()) if isinstance(value, Mapping) else (
                list(value) if isinstance(value, (list, tuple)) else [value])
            for v in values:
                if _plain_callable(v):
                    found.append(f"{where}.{name} = {getattr(v, '__name__', type(v).__name__)}")
                    break
        hooks = sum(len(getattr(module, h, {})) for h in ("_forward_hooks", "_forward_pre_hooks"))
        if hooks:
            found.append(f"{hooks} forward hook(s) on {where}")
    return found


#: Classes from these packages are identified by name, not read: their code is the library's
#: (upgrading torch does not invalidate every version; the manifest records its version).
LIBRARY_PACKAGES = frozenset({"torch", "builtins"})
_PLAIN = (bool, int, float, str, bytes, type(None))


def _code_bytes(code: types.CodeType) -> bytes:
    """A code object's bytecode, constants (nested code objects too) and names."""
    parts = [code.co_code, repr(code.co_names).encode()]
    for c in code.co_consts:
        parts.append(_code_bytes(c) if isinstance(c, types.CodeType) else repr(c).encode())
    return b"\0".join(parts)


class _FirstClasses(ast.NodeVisitor):
    """The first line of each class definition of a module (its first decorator's), by qualified
    name, the first where a name repeats: where ``inspect.getsource`` finds a class."""

    def __init__(self) -> None:
        self.stack: list[str] = []
        self.found: dict[str, int] = {}

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self.stack += [node.name, "<locals>"]
        self.generic_visit(node)
        del self.stack[-2:]

    visit_AsyncFunctionDef = visit_FunctionDef  # the same walk for either kind of def

    def visit_ClassDef(self, node: ast.ClassDef) -> None:
        self.stack.append(node.name)
        first = node.decorator_list[0].lineno if node.decorator_list else node.lineno
        self.found.setdefault(".".join(self.stack), first - 1)
        self.generic_visit(node)
        self.stack.pop()


#: Where each class of a module source starts, by the sha256 of the file name and source: a
#: module is parsed once, not once per class as ``inspect.getsource`` does (a Hugging Face model
#: holds tens of classes of a few modules of thousands of lines: its fingerprint's code part
#: took 5 s of a compute's start-up on 2 busy cores, parsing the same modules again).
_CLASS_LINES: dict[bytes, dict[str, int]] = {}


def _class_lines(cls: type) -> tuple[bytes, list[str]] | None:
    """Where ``cls``'s source starts, found as ``inspect.getsource`` finds it, with the module's
    tree parsed once per source: what names that source (the module's key and the class's
    qualified name) and the module's lines from the class's first; None where that is not
    plainly so (the caller asks inspect then)."""
    import linecache

    if hasattr(cls, "__wrapped__"):
        return None
    file = inspect.getsourcefile(cls)
    module = inspect.getmodule(cls, file)
    if not file or module is None:
        return None
    linecache.checkcache(file)
    lines = linecache.getlines(file, module.__dict__)
    key = hashlib.sha256(f"{file}\0".encode() + "".join(lines).encode()).digest()
    if key not in _CLASS_LINES:
        finder = _FirstClasses()
        finder.visit(ast.parse("".join(lines)))
        _CLASS_LINES[key] = finder.found
    first = _CLASS_LINES[key].get(cls.__qualname__)
    if first is None:
        return None
    return key + cls.__qualname__.encode(), lines[first:]


#: :func:`class_code` of each class source seen, by its module's key and qualified name.
_CLASS_CODES: dict[bytes, str] = {}


def class_code(cls: type) -> str:
    """What identifies ``cls``'s code: the syntax tree of its source (so comments and formatting
    do not count), or, where Python cannot see the source (a class made by ``exec``), the
    bytecode of its methods (which changes with the Python version).

    >>> class_code(torch.nn.Module).startswith("source:")
    True
    """
    try:
        found = _class_lines(cls)
        if found is not None and found[0] in _CLASS_CODES:
            return _CLASS_CODES[found[0]]
        source = inspect.getsource(cls) if found is None else "".join(inspect.getblock(found[1]))
        tree = ast.parse(textwrap.dedent(source))
        digest = "source:" + hashlib.sha256(ast.dump(tree).encode()).hexdigest()
        if found is not None:
            _CLASS_CODES[found[0]] = digest
        return digest
    except (OSError, TypeError, SyntaxError):
        h = hashlib.sha256()
        for name, member in sorted(vars(cls).items()):
            fn = getattr(member, "__func__", member)
            fns = [fn.fget, fn.fset] if isinstance(fn, property) else [fn]
            for f in fns:
                code = getattr(f, "__code__", None)
                if code is not None:
                    h.update(name.encode() + b"\0" + _code_bytes(code))
        return "bytecode:" + h.hexdigest()


def _setting(value: object) -> bytes | None:
    """The bytes of a module attribute that is a plain setting (``stride``, ``eps``, a
    ``self.scale = 2.0``, an unregistered tensor), or None for anything else."""
    if isinstance(value, _PLAIN):
        return repr(value).encode()
    if isinstance(value, (tuple, list)) and all(isinstance(v, _PLAIN) for v in value):
        return repr(tuple(value)).encode()
    return array_bytes(value) if isinstance(value, torch.Tensor) else None


def code_digest(model: torch.nn.Module) -> str:
    """sha256 over Model A's module tree: each submodule's path and class (module and qualified
    name), the code of each of your classes in its MRO (:func:`class_code`; torch's own classes
    by name only), and its plain settings (:func:`_setting`).

    It cannot see code the forward calls outside those classes (module-level functions, other
    libraries), global state, or hooks: name A with ``ComputeOptions(model_id=...)`` then.

    >>> code_digest(torch.nn.Conv2d(3, 4, 3)) == code_digest(torch.nn.Conv2d(3, 4, 3, stride=2))
    False
    """
    h = hashlib.sha256()
    seen: dict[type, str] = {}
    for path, module in model.named_modules():
        cls = type(module)
        h.update(f"{path}\0{cls.__module__}.{cls.__qualname__}\0".encode())
        for base in cls.__mro__:
            if base.__module__.split(".")[0] in LIBRARY_PACKAGES:
                continue
            if base not in seen:
                seen[base] = class_code(base)
            h.update(f"{base.__module__}.{base.__qualname__}={seen[base]}\0".encode())
        for name, value in sorted(vars(module).items()):
            setting = None if name.startswith("_") or name == "training" else _setting(value)
            if setting is not None:
                h.update(name.encode() + b"=" + hashlib.sha256(setting).digest())
    return h.hexdigest()
