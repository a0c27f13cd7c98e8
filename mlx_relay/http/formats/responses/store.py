"""A bounded in-memory store of finished Responses API responses (for `previous_response_id`,
`GET` and `DELETE /v1/responses/{id}`): `ResponseStore` holds `StoredResponse`s, and an id it
does not hold is answered as `ResponseNotFound` or `PreviousResponseNotFound`.

Least recently used entries are evicted once either bound is passed: the number of entries or
their total size in bytes (as the caller measures it). An entry larger than the byte bound on its
own is not stored. Owned by the routes object (one per app), used from the event loop only; no
locking, no module-level state.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Generic, TypeVar

import msgspec

from mlx_relay.chat.types import ChatMessage
from mlx_relay.errors import NotFound, RelayError
from mlx_relay.http.formats.responses.types import ResponseObject

T = TypeVar("T")

DEFAULT_MAX_ENTRIES = 1024
DEFAULT_MAX_BYTES = 64 * 1024 * 1024


class ResponseStore(Generic[T]):
    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        if max_entries < 1 or max_bytes < 1:
            raise ValueError("the response store's bounds must be positive")
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, tuple[T, int]] = OrderedDict()
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    @property
    def bytes(self) -> int:
        """Total size of the stored entries."""
        return self._bytes

    def put(self, key: str, value: T, size: int) -> bool:
        """Store `value` (replacing an entry under the same key) and evict the least recently used
        entries beyond the bounds. Returns False (and stores nothing) if `size` alone passes the
        byte bound."""
        self.delete(key)
        if size > self.max_bytes:
            return False
        self._entries[key] = (value, size)
        self._bytes += size
        while len(self._entries) > self.max_entries or self._bytes > self.max_bytes:
            _, (_, evicted) = self._entries.popitem(last=False)
            self._bytes -= evicted
        return True

    def get(self, key: str) -> T | None:
        """The entry, now the most recently used; None if absent or evicted."""
        entry = self._entries.get(key)
        if entry is None:
            return None
        self._entries.move_to_end(key)
        return entry[0]

    def delete(self, key: str) -> bool:
        entry = self._entries.pop(key, None)
        if entry is None:
            return False
        self._bytes -= entry[1]
        return True


class PreviousResponseNotFound(RelayError):
    """`previous_response_id` names a response that was never stored, was evicted or deleted."""

    status = 404
    type = "invalid_request_error"
    code = "previous_response_not_found"


class ResponseNotFound(NotFound):
    """`GET`/`DELETE /v1/responses/{id}` for an id the store does not hold."""


class StoredResponse(msgspec.Struct):
    """What the store keeps per response: the response object and the whole conversation up to and
    including its output (without instructions), ready to prepend to a continuation."""

    response: ResponseObject
    messages: list[ChatMessage]
