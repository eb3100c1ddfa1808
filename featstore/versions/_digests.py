"""What a version knows of its inputs, per sample: the input digests.

Every compute stores, beside A's outputs, one short digest per sample of the item Model A was
computed from (:data:`DIGEST_FIELD`, :data:`DIGEST_BYTES` bytes: blake2b of the dataset item as
read, every field, before any augmentation; :func:`item_digests`). It costs no extra pass: the
shard task digests the items its fetch thread reads for A anyway. From them follow

- each shard's input digest: the receipt's sha256 of that shard of the digest array, and
- the version's content digest (:func:`content_digest`): sha256 over the shards' input digests,
  in the manifest (``Manifest.content``) and, for a version computed because a rerun found
  changed items, in its fingerprint.

A rerun compares the digests of the items it is given with the stored ones (the compute side's
content check) and recomputes only the shards where one differs; a reader that joins the user's
own items (``source=``, ``hf.SoftLabels``, the fill) compares each item it holds with the stored
digest of its row (:func:`first_mismatch`). Versions written before these existed have no
digest array: their identity is the sampled one (:mod:`featstore.versions._fingerprints`).

The item walk (:func:`update_item`) is shared with the fingerprint's sampled digest, whose bytes
must never change (a version's id depends on them): ``compact=True`` (here only) feeds a list of
ints as one array, which keeps a token list's digest cheap.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Protocol

from featstore.errors import InvalidInput, SourceMismatch
from featstore.format import Manifest
from featstore._user_types import Item
from featstore._lazy import np, torch  # imported on first use: the quick commands never need them

if TYPE_CHECKING:
    from typing_extensions import Buffer  # collections.abc.Buffer from Python 3.12

#: The array of every new version holding each sample's input digest (never served in batches).
DIGEST_FIELD = "item_digest"
#: Bytes of one sample's digest: 128 bits, so two different items collide with odds 2**-128.
DIGEST_BYTES = 16


def array_bytes(x: torch.Tensor | np.ndarray) -> bytes:
    """Its dtype and shape, then its bytes in C order (a tensor on any device)."""
    head = f"{x.dtype}{tuple(x.shape)}".encode()
    if isinstance(x, torch.Tensor):
        flat = x.detach().cpu().contiguous().reshape(-1)
        return head + flat.view(torch.uint8).numpy().tobytes()
    return head + np.ascontiguousarray(x).tobytes()


class Hasher(Protocol):
    """What :func:`update_item` feeds: a hashlib object (sha256, blake2b)."""

    def update(self, data: Buffer, /) -> None: ...


def _buffer(x: torch.Tensor | np.ndarray) -> memoryview:
    """The bytes of a tensor (on any device) or array in C order (a view where the data already
    is contiguous on the CPU)."""
    if isinstance(x, torch.Tensor):
        t = x.detach()
        t = t if t.device.type == "cpu" and t.is_contiguous() else t.cpu().contiguous()
        return t.reshape(-1).view(torch.uint8).numpy().data
    return np.ascontiguousarray(x).reshape(-1).view(np.uint8).data


def update_item(h: Hasher, item: object, path: str = "", compact: bool = False) -> None:
    """Feed one dataset item into ``h`` (tensors, arrays, numbers, strings, and dicts, lists and
    tuples of them); ``path`` names the field being fed (for the message of an item that cannot
    be digested: :class:`InvalidInput`). ``compact``: a list or tuple of plain ints is fed as one
    int64 array (the per-sample digests; the sampled fingerprint digest keeps ``False``)."""
    if isinstance(item, (torch.Tensor, np.ndarray)):
        # the bytes of b"T"/b"N" + array_bytes(item), fed without copying the data
        h.update((b"T" if isinstance(item, torch.Tensor) else b"N") + f"{item.dtype}{tuple(item.shape)}".encode())
        h.update(_buffer(item))
    elif isinstance(item, Mapping):
        h.update(b"{")
        for k in sorted(item, key=str):
            h.update(repr(k).encode())
            update_item(h, item[k], f"{path}[{k!r}]", compact)
        h.update(b"}")
    elif isinstance(item, (tuple, list)):
        if compact and item and all(type(v) is int for v in item):
            try:
                h.update(b"I" + np.asarray(item, dtype=np.int64).tobytes())
                return
            except OverflowError:  # ints beyond int64: fed one by one below
                pass
        h.update(b"[")
        for i, v in enumerate(item):
            update_item(h, v, f"{path}[{i}]", compact)
        h.update(b"]")
    elif item is None or isinstance(item, (bool, int, float, str, bytes)):
        h.update(repr(item).encode())
    else:
        where = f"its field item{path}" if path else "the item"
        raise InvalidInput(
            f"cannot fingerprint the dataset's items: {where} is a {type(item).__module__}.{type(item).__qualname__}; "
            "pass ComputeOptions(dataset_id='...') naming the dataset's exact contents (--dataset-id), or make "
            "that field a tensor, numpy array, number or string."
        )


def item_digest(item: Item) -> bytes:
    """The :data:`DIGEST_BYTES`-byte input digest of one dataset item (raises
    :class:`InvalidInput` for an item that cannot be digested).

    >>> len(item_digest({"input": torch.zeros(3), "target": 1}))
    16
    """
    h = hashlib.blake2b(digest_size=DIGEST_BYTES)
    update_item(h, item, compact=True)
    return h.digest()


def item_digests(items: Sequence[Item]) -> np.ndarray:
    """``uint8 [len(items), DIGEST_BYTES]``: each item's :func:`item_digest`, in order."""
    out = np.empty((len(items), DIGEST_BYTES), dtype=np.uint8)
    for i, item in enumerate(items):
        out[i] = np.frombuffer(item_digest(item), dtype=np.uint8)
    return out


def content_digest(shard_digests: Iterable[str]) -> str:
    """The version's content digest: sha256 over each shard's input digest (the receipts' sha256
    of that shard of :data:`DIGEST_FIELD`), in shard order. It depends on the shard size, which
    a version that reuses another's shards adopts from it (so a rerun of the same items finds the
    same version)."""
    return hashlib.sha256("\n".join(shard_digests).encode()).hexdigest()


def first_mismatch(indices: np.ndarray, got: np.ndarray, stored: np.ndarray) -> int | None:
    """The first of ``indices`` (in their order) whose digest row in ``got`` is not the one in
    ``stored`` (rows aligned with ``indices``), or None when all agree."""
    differ = np.flatnonzero((np.asarray(got) != np.asarray(stored)).any(axis=1))
    return int(np.asarray(indices)[differ[0]]) if len(differ) else None


class InputCheck:
    """The items a reader holds, checked against the input digests a version stored for their
    rows: what joins the user's own items to stored outputs (``store.dataset(source=...)``,
    ``hf.SoftLabels``, the teacher in the loop reading what a fill stored) calls it as it reads,
    so a row is never served beside an item other than the one it was computed from.

    The stored digests are read a shard at a time and the last few kept (16 bytes a sample); a
    copy sent to a DataLoader worker starts empty. :meth:`of` is None for a version stored
    without digests (written before they existed, or with items that cannot be digested): its
    readers check the sampled identity only.
    """

    KEPT_SHARDS = 8

    def __init__(self, version: DigestSource) -> None:
        self.version = version
        self._shards: dict[int, np.ndarray] = {}

    @classmethod
    def of(cls, version: DigestSource, filling: bool = False) -> InputCheck | None:
        """The check of ``version``'s items (every view holds the same digests), or None; None
        too for the plan of a version not committed (the teacher in the loop computes from the
        items), unless ``filling``: a fill checks the shards it finds stored."""
        if version.views is not None:
            version = version.view(0)
        known = version.manifest.committed or filling
        return cls(version) if known and DIGEST_FIELD in version.manifest.arrays else None

    def __getstate__(self) -> dict[str, object]:
        return {**self.__dict__, "_shards": {}}

    def stored(self, indices: Sequence[int] | np.ndarray) -> np.ndarray:
        """The stored digests of rows ``indices`` (``uint8 [len, DIGEST_BYTES]``)."""
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        layout = self.version.manifest.layout
        out = np.empty((len(idx), DIGEST_BYTES), dtype=np.uint8)
        shard = idx // layout.samples_per_shard
        for s in np.unique(shard):
            at = shard == s
            out[at] = self._shard(int(s))[idx[at] - int(s) * layout.samples_per_shard]
        return out

    def _shard(self, s: int) -> np.ndarray:
        if s not in self._shards:
            if len(self._shards) >= self.KEPT_SHARDS:
                self._shards.pop(next(iter(self._shards)))
            start, stop = self.version.manifest.layout.shard_range(s)
            self._shards[s] = self.version.read_rows(DIGEST_FIELD, start, stop)
        return self._shards[s]

    def check(self, indices: Sequence[int] | np.ndarray, items: Sequence[Item], what: str) -> None:
        """Raise :class:`SourceMismatch` naming the first of ``indices`` whose item (``items``,
        in the same order, as the dataset gives them) is not the one the version was computed
        from; ``what`` names the dataset in the message (``"source"``, ``"the dataset"``)."""
        idx = np.asarray(indices, dtype=np.int64).reshape(-1)
        bad = first_mismatch(idx, item_digests(items), self.stored(idx))
        if bad is not None:
            raise SourceMismatch(
                f"item {bad} of {what} is not the item {self.version.ref} was computed from (its input digest "
                f"differs): its stored outputs belong to another input. Compute the version again on this "
                f"dataset (store.compute reuses every unchanged shard and computes only the changed ones), or "
                f"pass the dataset it was computed on.", index=bad)


class DigestSource(Protocol):
    """What :class:`InputCheck` reads of a version (a :class:`~featstore.versions.StoredVersion`)."""

    @property
    def manifest(self) -> Manifest: ...

    @property
    def views(self) -> int | None: ...

    @property
    def ref(self) -> str: ...

    def view(self, view: int) -> DigestSource: ...

    def read_rows(self, field: str, start: int, stop: int) -> np.ndarray: ...
