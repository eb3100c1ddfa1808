"""The featstore error tree, grouped by what the caller will do about it.

Every error derives from :class:`FeatstoreError` and also from the builtin that matches its
meaning, so ``except KeyError`` still catches an unknown version. Messages say what happened
and what to do next. This module imports nothing from featstore.
"""

from __future__ import annotations

import re
from collections.abc import Callable


class FeatstoreError(Exception):
    """Base class of every error featstore raises."""

    def __str__(self) -> str:  # KeyError would otherwise quote the message
        return str(self.args[0]) if self.args else self.__class__.__name__


# -- the caller must change its input ------------------------------------------------------
class InvalidInput(FeatstoreError, ValueError):
    """An argument, dataset item or model output cannot be stored as given."""


class InvalidName(InvalidInput):
    """A feature-set, tag or version name that is not allowed (path escapes, odd characters)."""


class EmptyDataset(InvalidInput):
    """The dataset has no samples."""


class MissingInputKey(InvalidInput):
    """A dataset item lacks the field named by ``input_key`` or ``keep``."""


class OutputMismatch(InvalidInput):
    """Model A's output changed shape, dtype or keys between batches, or does not match ``outputs``."""


class NonFiniteOutput(InvalidInput):
    """Model A produced NaN/Inf (or a value the storage codec cannot represent)."""


class DatasetMismatch(InvalidInput):
    """``extends``: the dataset's first ``len(parent)`` samples are not the parent's, or the
    model, outputs or codecs differ from the parent's."""


class NondeterministicAugment(InvalidInput):
    """An ``augment`` gave two different results for the same seed: it draws randomness from
    somewhere other than the ``torch.Generator`` it is given, so its views cannot be replayed."""


class SourceMismatch(InvalidInput):
    """The ``source`` dataset given to the reader is not the dataset the version was computed on
    (or the ``augment`` is not the one it was computed with): rows would silently misalign.
    ``index``: the first item found to differ from the one its row was computed from, where one
    item was compared (None when the whole dataset was: its length or sampled digest)."""

    def __init__(self, message: str, index: int | None = None) -> None:
        super().__init__(message)
        if index is None:  # rebuilt from its message alone (DataLoader re-raises ``type(message)``)
            found = _ITEM.search(str(message))
            index = int(found.group(1)) if found else None
        self.index = index

    def __reduce__(self) -> tuple[type[SourceMismatch], tuple[str, int | None]]:  # ``index`` kept across processes
        return type(self), (self.args[0] if self.args else "", self.index)


#: How a :class:`SourceMismatch` about one item names it (``featstore.versions.InputCheck``).
_ITEM = re.compile(r"\bitem (\d+) of ")


class VersionsMisaligned(InvalidInput):
    """Versions meant to hold outputs for the same rows do not: a compute with ``views_of=``
    whose dataset, views or augment are not the base version's, or teachers read together
    (``store.dataset({"a": ..., "b": ...})``) that differ in dataset, length, views or layout.
    ``differs`` names what differs (``"dataset length"``, ``"view seed"``, ...)."""

    def __init__(self, message: str, differs: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.differs = tuple(differs)

    def __reduce__(self) -> tuple[type[VersionsMisaligned], tuple[str, tuple[str, ...]]]:  # ``differs`` kept too
        return (type(self), (self.args[0], self.differs))


# -- the caller must pick another version / name ---------------------------------------------
class VersionNotFound(FeatstoreError, KeyError):
    """No committed version, tag or feature set by that name."""


class StoreConflict(FeatstoreError, FileExistsError):
    """Another writer committed the same object first."""


class StoreNotFound(FeatstoreError, FileNotFoundError):
    """No store at that URL: a read-only command (``featstore list``/``info``/``verify``/``tag``)
    or ``open_store(url, create=False)`` never creates one. Check the URL."""


# -- the caller must fix the environment ----------------------------------------------------
class StoreUnavailable(FeatstoreError, ConnectionError):
    """The store URL cannot be reached, or there are no (valid) credentials for it."""


class StorePermissionDenied(StoreUnavailable, PermissionError):
    """The store refuses the access: file modes or a read-only mount of a local store, the
    credentials or bucket policy of a remote one. The message names the path and the cause."""


class ConditionalWritesUnsupported(FeatstoreError, NotImplementedError):
    """The store's S3 server ignores ``If-None-Match: *`` on PUT (found by featstore's probe
    before the first create): commits could not tell two writers apart, so none is made. Use a
    server (or a path to it) that honours conditional creates; see docs/s3.md,
    section "S3-compatible servers"."""


class StoreFull(FeatstoreError, OSError):
    """The store's disk or quota is full. Nothing is committed; finished shards are kept, so
    freeing space and rerunning ``compute`` resumes."""


class IncompatibleFormat(FeatstoreError, ValueError):
    """Stored metadata is malformed or was written by a newer featstore."""


class ClusterUnavailable(FeatstoreError, ConnectionError):
    """The Dask scheduler named by ``client=`` (``--scheduler``) did not answer within
    ``ComputeOptions.connect_timeout``: check that it runs and the address."""


class DeviceSetupError(FeatstoreError, RuntimeError):
    """A compute worker sees several GPUs and cannot tell which is its own, or was told to use
    one it does not have (see :mod:`featstore.compute` for the rules and the fixes), or Model A
    asks for CUDA where there is none."""


class DistributedSetupError(FeatstoreError, RuntimeError):
    """The reader cannot tell which DDP rank it reads for: ``WORLD_SIZE`` says several ranks but
    neither ``torch.distributed`` nor ``RANK`` says which, or the rank or world size changed under
    persistent DataLoader workers. It never guesses (that would read another rank's samples)."""


# -- the data or the run is broken ----------------------------------------------------------
class CorruptChunk(FeatstoreError, IOError):
    """A stored chunk is missing, truncated or fails its checksum.

    ``version`` is ``name@id``, ``array`` the field and ``chunk`` the object's key inside the
    version (``features/c/3/0``), so a caller can report or delete exactly what is damaged.
    """

    def __init__(self, message: str, *, version: str = "", array: str = "", chunk: str = "") -> None:
        super().__init__(message)
        if not (version or array or chunk):
            # Rebuilt from its message alone: DataLoader re-raises a worker's error as
            # ``type(message)``; the message of :meth:`damaged` holds the fields.
            found = _DAMAGED.search(str(message))
            if found:
                version, array, chunk = found.group("version", "array", "chunk")
        self.version, self.array, self.chunk = version, array, chunk

    @classmethod
    def damaged(cls, version: str, array: str, chunk: str, what: str) -> "CorruptChunk":
        """The one message for damaged stored data: what is wrong, where, and what to do.

        >>> str(CorruptChunk.damaged("a@0123456789abcdef", "x", "x/c/0", "is missing"))[:46]
        "version a@0123456789abcdef, array 'x', object"
        """
        return cls(f"version {version}, array {array!r}, object {chunk!r} {what}. The stored data is "
                   "damaged: run `featstore verify` to list every bad object, then delete and "
                   "recompute the version.", version=version, array=array, chunk=chunk)

    def __reduce__(self) -> tuple[Callable[[str, str, str, str], CorruptChunk], tuple[str, str, str, str]]:
        # keep the fields across process boundaries (DataLoader workers, Dask)
        return (_rebuild_corrupt, (self.args[0], self.version, self.array, self.chunk))


_DAMAGED = re.compile(r"version (?P<version>\S+), array '(?P<array>[^']*)', object '(?P<chunk>[^']*)'")


def _rebuild_corrupt(message: str, version: str, array: str, chunk: str) -> CorruptChunk:
    return CorruptChunk(message, version=version, array=array, chunk=chunk)


class ComputeFailed(FeatstoreError, RuntimeError):
    """Model A, its factory or the dataset raised (the user's exception is the ``__cause__``; the
    message names its type, text and where it was raised, which is all that crosses a DataLoader
    worker process); finished shards are kept for resume."""


# -- warnings: the run goes on, but the caller should know -----------------------------------
class FeatstoreWarning(UserWarning):
    """Base class of the warnings featstore gives (the command line prints each on one line)."""


class FingerprintWarning(FeatstoreWarning):
    """The fingerprint is likely blind to something that changes Model A's outputs (a plain
    function held by Model A, a dataset whose items change between reads): name the model or
    the dataset yourself (``ComputeOptions(model_id=...)`` / ``dataset_id=``)."""
