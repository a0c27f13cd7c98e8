"""This process's stage of a model split by layers over an `mx.distributed` group (GPU thread only).

    rank size-1: embed -> layers[0:a] --send--> rank size-2: layers[a:b] --send--> ... rank 0: layers[..:n]
    every rank: all_gather -> rank 0's final hidden state -> norm -> head -> the same logits everywhere

The split is mlx-lm's `PipelineMixin.pipeline` (mlx_lm/models/pipeline.py): layers split in
reverse, so rank 0 (the server) runs the last layers; an even split gives the low ranks the extra
layers (`split_layers`). `shard_language_model` cuts the model as its family says
(`models.ModelFamily.pipeline_split`; Qwen3.5: `models/qwen3_5/pipeline.py`, which also says which
splits it refuses); the model's forward, `make_cache` and our decode step then run this stage's
layers only.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Literal

import mlx.core as mx

from mlx_relay.engine.models import family_of

log = logging.getLogger(__name__)


class UnsupportedSplit(ValueError):
    """The layers cannot be split so: a stage without an attention or a GatedDeltaNet layer, or
    a split that does not fit the group or the model."""


Transfer = Literal["p2p", "collective"]


def default_transfer() -> Transfer:
    """The transfer this machine's MLX can run: collectives where the GPU is CUDA's (no send or
    recv there), send/recv elsewhere."""
    return "collective" if mx.cuda.is_available() else "p2p"


@dataclass(frozen=True)
class Stage:
    group: Any  # mx.distributed.Group
    rank: int
    size: int
    start: int  # this stage's layers are the model's [start, end)
    end: int
    transfer: Transfer = "p2p"

    @property
    def first(self) -> bool:
        """Runs the model's first layers (takes token ids or prompt embeddings)."""
        return self.rank == self.size - 1

    @property
    def last(self) -> bool:
        """Runs the model's last layers (its output is the model's)."""
        return self.rank == 0

    def _trace(self, what: str, x: mx.array) -> None:
        """At debug level, every transfer a rank issues (once per trace inside `mx.compile`, per
        call elsewhere), so that two ranks' logs can be laid side by side."""
        if log.isEnabledFor(logging.DEBUG):
            log.debug("rank %d %s %s %s by %s", self.rank, what, tuple(x.shape), x.dtype, self.transfer)

    def receive(self, like: mx.array) -> mx.array:
        """The previous stage's hidden state, shaped as `like`."""
        self._trace("receive", like)
        if self.transfer == "p2p":
            return mx.distributed.recv_like(like, self.rank + 1, group=self.group)
        # the boundaries of the stages before the previous one, then the previous one's
        return self._boundaries(mx.zeros_like(like), self.size - 1 - self.rank)

    def send(self, hidden: mx.array) -> mx.array:
        """`hidden` to the next stage; the array returned carries the send (evaluate it, or
        something depending on it, for the send to happen)."""
        self._trace("send", hidden)
        if self.transfer == "p2p":
            return mx.distributed.send(hidden, self.rank - 1, group=self.group)
        sent = mx.distributed.all_sum(hidden, group=self.group)
        # then the boundaries of the stages after this one; what comes back is shaped as `hidden`
        return self._boundaries(sent, self.rank - 1)

    def _boundaries(self, chain: mx.array, count: int) -> mx.array:
        """Join `count` boundaries as a rank that sends nothing at them (zeros), each after the
        previous one (after `chain`'s); the last one's result, or `chain` for none."""
        for _ in range(count):
            chain = mx.distributed.all_sum(mx.depends(mx.zeros_like(chain), chain), group=self.group)
        return chain

    def share(self, x: mx.array) -> mx.array:
        """The last stage's (rank 0's) `x` on every rank (a non-last rank passes any array of
        the same shape, e.g. what `send` returned, so that the send happens first)."""
        self._trace("share", x)
        return mx.distributed.all_gather(x, group=self.group)[:x.shape[0]]

    def enter(self, h: mx.array) -> mx.array:
        """A decode step's hidden states into this stage: the embeddings `h` on the first stage,
        else the previous stage's, shaped as `h`."""
        return h if self.first else self.receive(h)

    def leave(self, h: mx.array, wire: Any) -> mx.array:
        """A decode step's hidden states `h` out of this stage: on every rank the last stage's,
        every position. `wire`: the dtype the boundaries carry (the embeddings')."""
        self.check(h, wire)
        return self.share(h if self.last else self.send(h))

    def check(self, h: mx.array, wire: Any) -> None:
        """`h` crosses a boundary (or `share`) as `wire`, the embeddings' dtype: a stage whose state
        was promoted (float32 keys, as mlx-vlm's BatchKVCache.extend once made them:
        memory/batch_caches.extend_caches) fails here, by name, rather than corrupt the collective
        (on NCCL: an illegal memory access, or a hang)."""
        if h.dtype != wire:
            raise TypeError(f"pipeline stage {self.rank}'s hidden state is {h.dtype}, the transfer carries {wire}")


def split_layers(n_layers: int, size: int, split: tuple[int, ...] | None = None) -> list[int]:
    """Layers per rank (rank 0 first), as mlx-lm's PipelineMixin: an even split by default."""
    if split is None:
        base, extra = divmod(n_layers, size)
        return [base + (1 if r < extra else 0) for r in range(size)]
    if len(split) != size:
        raise UnsupportedSplit(f"the split has {len(split)} entries for {size} processes")
    if any(s <= 0 for s in split) or sum(split) != n_layers:
        raise UnsupportedSplit(f"the split {list(split)} must be positive and sum to the model's {n_layers} layers")
    return list(split)


def stage_ranges(n_layers: int, size: int, split: tuple[int, ...] | None = None) -> list[tuple[int, int]]:
    """Each rank's layers as [start, end) (rank 0 first): rank r runs the layers after those of
    ranks r+1 ... size-1 (`split_layers`' counts)."""
    counts = split_layers(n_layers, size, split)
    return [(sum(counts[r + 1:]), sum(counts[r:])) for r in range(size)]


def shard_language_model(lm: Any, rank: int, size: int, split: tuple[int, ...] | None = None) -> tuple[int, int]:
    """Keep only rank `rank`'s layers (of `size` ranks) in the language model `lm` (in place), as
    its family splits it (`models.ModelFamily.pipeline_split`); the range [start, end) of the
    model's layers it keeps."""
    return family_of(lm).pipeline_split(lm, rank, size, split)
