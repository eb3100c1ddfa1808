"""Zarr's side of the backend error mapping: :class:`BackendErrorStore` wraps a Zarr store so its
backend faults become the featstore tree too. Apart from :mod:`._errors` because subclassing
Zarr's ``WrapperStore`` imports zarr (~0.4 s), which the quick commands never need: the backends
import this module inside ``zarr_store``.
"""

from __future__ import annotations

import posixpath
from collections.abc import Iterable
from typing import TYPE_CHECKING, Self

import zarr.storage
from zarr.abc.store import Store

from featstore.storage._errors import backend_errors

if TYPE_CHECKING:
    from zarr.abc.store import ByteRequest
    from zarr.core.buffer import Buffer, BufferPrototype


class BackendErrorStore(zarr.storage.WrapperStore[Store]):
    """Zarr store wrapper: a backend fault that outlasted the retries becomes
    :class:`StoreUnavailable`, a full disk :class:`StoreFull`, a refused write
    :class:`StorePermissionDenied` (each naming the object and the cause) instead of a bare
    ``OSError`` that callers could mistake for corrupt data. Missing keys keep zarr's own meaning."""

    def __init__(self, store: Store, url: str, root: str = "") -> None:
        super().__init__(store)
        self._url, self._root = url, root

    def _with_store(self, store: Store) -> Self:
        return type(self)(store, self._url, self._root)

    def _at(self, key: str) -> str:
        return posixpath.join(self._root, key) if self._root else key

    async def get(self, key: str, prototype: BufferPrototype, byte_range: ByteRequest | None = None) -> Buffer | None:
        with backend_errors(self._url, self._at(key)):
            return await self._store.get(key, prototype, byte_range)

    async def get_partial_values(self, prototype: BufferPrototype,
                                 key_ranges: Iterable[tuple[str, ByteRequest | None]]) -> list[Buffer | None]:
        with backend_errors(self._url):
            return await self._store.get_partial_values(prototype, key_ranges)

    async def set(self, key: str, value: Buffer) -> None:
        with backend_errors(self._url, self._at(key)):
            return await self._store.set(key, value)

    async def set_if_not_exists(self, key: str, value: Buffer) -> None:
        with backend_errors(self._url, self._at(key)):
            return await self._store.set_if_not_exists(key, value)

    async def exists(self, key: str) -> bool:
        with backend_errors(self._url, self._at(key)):
            return await self._store.exists(key)

    async def delete(self, key: str) -> None:
        with backend_errors(self._url, self._at(key)):
            return await self._store.delete(key)

    async def getsize(self, key: str) -> int:
        with backend_errors(self._url, self._at(key)):
            return await self._store.getsize(key)
