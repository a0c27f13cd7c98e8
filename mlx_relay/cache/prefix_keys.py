"""Content keys for prompt prefixes (pure Python; used by the PrefixCacheStore actor).

A prompt is keyed as a chain of block hashes: block j's hash covers the previous block's hash
and the block's *key items*. A key item is the token id, except inside a media span (the image or
video pad tokens the MediaRouter expanded), where it is derived from the media item's content
hash and the position inside the span: two prompts with the same text and the same image share
keys, a different image never does, even though both expand to the same pad token ids.

The key of any prefix length L (not only block multiples) is the chain hash at the last full
block before L, extended by the tail items; `PrefixKeys.key(L)` costs O(block) after an O(n)
setup, so a store can test many candidate snapshot lengths against one prompt cheaply.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

import msgspec

__all__ = ["BLOCK_TOKENS", "MediaSpan", "PrefixKeys"]

#: Tokens per hashed block. Snapshot lengths need not be multiples of it.
BLOCK_TOKENS = 64

_ROOT = b"mlx-relay-prefix-v1"


class MediaSpan(msgspec.Struct, frozen=True):
    """Prompt positions [start, end) hold the vision tokens of one media item."""

    start: int
    end: int
    content_hash: str  # hex digest of the item's decoded bytes (as the vision feature cache keys it)


def _media_items(content_hash: str, length: int) -> list[int]:
    """Per-position key items of a media span: 63-bit values above any real vocabulary."""
    seed = hashlib.blake2b(content_hash.encode(), digest_size=8).digest()
    base = int.from_bytes(seed, "little") | (1 << 62)
    return [(base + i) & ((1 << 63) - 1) for i in range(length)]


def key_items(tokens: Sequence[int], media: Sequence[MediaSpan] = ()) -> list[int]:
    items = list(tokens)
    for span in media:
        if not 0 <= span.start <= span.end <= len(items):
            raise ValueError(f"media span [{span.start}, {span.end}) outside a {len(items)}-token prompt")
        items[span.start:span.end] = _media_items(span.content_hash, span.end - span.start)
    return items


def _digest(prev: bytes, items: Sequence[int]) -> bytes:
    h = hashlib.blake2b(prev, digest_size=16)
    h.update(struct.pack(f"<{len(items)}q", *items))
    return h.digest()


class PrefixKeys:
    """The chain hashes of one prompt; `key(L)` is the key of its first L tokens."""

    def __init__(self, tokens: Sequence[int], media: Sequence[MediaSpan] = (), block: int = BLOCK_TOKENS) -> None:
        self.items = key_items(tokens, media)
        self.block = block
        self._chain = [_ROOT]  # _chain[j]: hash of the first j full blocks
        for j in range(len(self.items) // block):
            self._chain.append(_digest(self._chain[-1], self.items[j * block:(j + 1) * block]))

    def __len__(self) -> int:
        return len(self.items)

    def key(self, length: int) -> bytes:
        if not 0 <= length <= len(self.items):
            raise ValueError(f"prefix length {length} outside a {len(self.items)}-token prompt")
        j = length // self.block
        tail = self.items[j * self.block:length]
        return _digest(self._chain[j] + b"tail", [length, *tail])
