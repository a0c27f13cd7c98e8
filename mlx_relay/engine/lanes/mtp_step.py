"""One greedy speculative round as a pure function, compiled (GPU thread only; used by
`mtp_lane.MTPLane` for cohorts of greedy rows): the MTP head's drafts, drafts copied from the rows'
contexts (`HostDrafts`), or both.

    out, state' = round(state, room, drafts)   # state: mtp_state.MTPState; room [B]: tokens each row may still emit

A round of width W (the head's block k, or 1 + the context drafts), all inside one `mx.compile`d
call over fixed-size state:
1. draft: the head proposes `k - 2` more tokens after the state's `draft` (k > 2 only), writing
   its KV at each row's next head columns; a row with host drafts takes those instead;
2. verify: the target over `[bonus, d_1 .. d_{W-1}]` per row in one forward: attention keys and
   values written at columns `lengths[i] .. lengths[i] + W - 1` of the fixed buffers
   (`mx.put_along_axis`, per-row write index), each query seeing only its row's prefix and the
   block's earlier positions (a mask from the row's length), the GatedDeltaNet conv and
   recurrence run over the W positions keeping the W per-position states;
3. accept on device: `a` = leading drafts equal to the target's argmax (at most the row's
   `usable` drafts: padding is never accepted), cut like the eager lane's `_cut` (at the row's
   first EOS, and at `room`): `m = min(a, room - 1, first EOS)`; the row emits
   `targets[:, :m + 1]` (an accepted draft equals the target's argmax there); commit selects the
   conv window and recurrent state after position m (`mx.take_along_axis`); the KV needs nothing
   but the row's new length `lengths + m + 1` (kept on the host);
4. the head re-reads the W verified positions (pairs `(h_j, targets_j)`; the ones past m are
   overwritten by the next round) and proposes the next draft from position m.
A round where no row takes the head's drafts (a checkpoint without a head, or rows on context
drafts only) is a second compiled function without steps 1 and 4: at width 1 it is a plain decode
step in this layout. The host reads `targets`, `a` and `m` once per round (the synchronisation the
lane needs anyway to emit tokens and to make the next round's context drafts). Greedy rows only:
sampling rows keep the eager path (`MTPLane`).

`tests/test_mtp_step.py` pins that it emits the greedy tokens of plain decoding (float32),
compiled and eager, alone and in ragged batches, and that a row's handed-back state continues
exactly; `tests/test_context_drafts.py` the same with context drafts, with and without a head.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from mlx_relay.engine.lanes.mtp_state import MTPState
from mlx_relay.engine.models import family_of
from mlx_relay.engine.models.kv_quant import first
from mlx_relay.engine.models.pipeline_stage import Stage
from mlx_relay.engine.models.positions import Positions


@dataclass
class RoundOut:
    targets: mx.array  # [B, k] the target's argmax at each block position
    accepted: mx.array  # [B] leading drafts accepted (before the cut)
    committed: mx.array  # [B] m: the row emits targets[:, :m + 1] and commits m + 1 positions


@dataclass
class HostDrafts:
    """Drafts made on the host (copied from each row's context) for one round of `width` tokens:
    `tokens[i]` for real row i (empty: the row verifies the head's drafts, if `heads[i]`, else
    none), at most `width - 1` each."""

    width: int
    tokens: list[list[int]]
    heads: list[bool]

    def arrays(self, batch_size: int, k: int) -> tuple[mx.array, mx.array, mx.array]:
        """[B, width - 1] drafts (zero-padded), [B] whether a row's are the host's, [B] how many
        drafts each row may accept (idle rows: 0)."""
        w, pad = self.width - 1, batch_size - len(self.tokens)
        rows = [t[:w] + [0] * (w - len(t[:w])) for t in self.tokens] + [[0] * w] * pad
        mine = [bool(t) for t in self.tokens] + [False] * pad
        usable = [len(t[:w]) if t else (min(k, self.width) - 1 if h else 0)
                  for t, h in zip(self.tokens, self.heads, strict=True)] + [0] * pad
        drafts = mx.array(rows, dtype=mx.int32) if w > 0 else mx.zeros((batch_size, 0), dtype=mx.int32)
        return drafts, mx.array(mine), mx.array(usable, dtype=mx.int32)


def _prefix_mask(columns: mx.array, cap: int) -> mx.array:
    """[B, 1, T, cap]: query t of row i sees columns 0 .. columns[i, t]."""
    return (mx.arange(cap)[None, None, :] <= columns[:, :, None])[:, None]


def _at(columns: mx.array, rotary: mx.array, cap: int, offsets: mx.array | None = None) -> Positions:
    """Positions `columns` [B, T] of each row, written there, each query seeing its row's prefix."""
    return Positions.per_row(columns, rotary, _prefix_mask(columns, cap), offsets)


class MTPStep:
    """`step(state, room, drafts) -> RoundOut`, updating `state`; compiled unless `compiled=False`.
    `UnsupportedModel` for a model of no family `models` serves, or a head it cannot run. With a
    head that does not draft (`MTPHead.drafts` false) every round is the head-free one."""

    def __init__(self, lm: Any, head: Any, *, block_size: int, eos_token_ids: list[int],
                 compiled: bool = True, stage: Stage | None = None) -> None:
        self.family = family_of(lm)
        drafter = head.drafter
        if drafter is not None:
            self.family.check_mtp_head(drafter)
        if block_size < 2:
            raise ValueError("MTP block size must be at least 2")
        self.lm, self.drafter, self.k = lm, drafter, block_size
        self.stage = stage  # a pipeline stage: its layers only in the verify, the head on every rank
        self.layout = self.family.cache_layout(lm)
        self._eos = tuple(sorted(set(eos_token_ids)))  # constants of the trace (no array: building costs no memory)
        self._compiled = compiled
        self._fns: dict[int, Any] = {}  # block -> the round with the head drafting block - 1 tokens
        self._bare = mx.compile(self._bare_round) if compiled else self._bare_round
        self._constants: dict[int, tuple[mx.array, mx.array, mx.array]] = {}  # batch size -> one-token inputs

    def __call__(self, state: MTPState, room: list[int], drafts: HostDrafts | None = None, *,
                 block: int | None = None) -> RoundOut:
        """One round; `room[i]` >= 1: tokens row i may still emit (its max_tokens left). With
        `drafts`, the round verifies `drafts.width` tokens per row: a row with host drafts (copied
        from its context) verifies those instead of the head's, the others the head's (or none:
        then, if no row takes the head's, the head does not run). `block` (2 .. the step's block
        size, the default): the head drafts `block - 1` tokens."""
        k = self.k if block is None else block
        if not 2 <= k <= self.k:
            raise ValueError(f"a round's block is 2 to {self.k}, not {k}")
        width = k if drafts is None else drafts.width
        state.ensure_room(width)
        B = state.batch_size
        if drafts is not None and (self.drafter is None or not any(drafts.heads)):
            lengths = state.lengths_array()
            if width == 1:  # the one-token round: no drafts, no room to read (its commit is its token)
                host, usable, room_arr = self._one_token_inputs(B)
            else:
                host, _mine, usable = drafts.arrays(B, self.k)
                room_arr = mx.array(room + [1] * (B - len(room)), dtype=mx.int32)
            targets, accepted, committed, state.bonus, state.kv, state.conv, state.ssm = self._bare(
                state.bonus, lengths, room_arr, state.kv, state.conv, state.ssm, host, usable)
            return RoundOut(targets, accepted, committed)
        lengths, head_lengths, dpos = state.index_arrays()
        room_arr = mx.array(room + [1] * (B - len(room)), dtype=mx.int32)
        host_arrays = () if drafts is None else drafts.arrays(state.batch_size, k)
        (targets, accepted, committed, state.bonus, state.draft, state.seed, state.kv, state.conv, state.ssm,
         state.head_kv) = self._round_at(k)(state.bonus, state.draft, state.seed, lengths, head_lengths, dpos,
                                            room_arr, state.kv, state.conv, state.ssm, state.head_kv, *host_arrays)
        return RoundOut(targets, accepted, committed)

    def _round_at(self, k: int) -> Any:
        """The round whose head drafts `k - 1` tokens (compiled once a block)."""
        fn = self._fns.get(k)
        if fn is None:
            def at_k(*args: Any) -> tuple[Any, ...]:
                return self._round(*args, k=k)

            fn = self._fns[k] = mx.compile(at_k) if self._compiled else at_k
        return fn

    def _one_token_inputs(self, batch_size: int) -> tuple[mx.array, mx.array, mx.array]:
        """The one-token round's constant inputs at this batch size (built once: the pipelined
        rounds of rows whose drafts miss run it every token): no drafts, none usable, room 1."""
        inputs = self._constants.get(batch_size)
        if inputs is None:
            inputs = (mx.zeros((batch_size, 0), dtype=mx.int32), mx.zeros((batch_size,), dtype=mx.int32),
                      mx.ones((batch_size,), dtype=mx.int32))
            mx.eval(inputs)
            self._constants[batch_size] = inputs
        return inputs

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        return self._eos

    @staticmethod
    def advance(state: MTPState, committed: list[int]) -> None:
        """The host's side of the commit: each real row's lengths move on by m + 1."""
        for i, m in enumerate(committed[:state.rows]):
            state.lengths[i] += m + 1
            state.head_lengths[i] += m + 1
            state.dpos[i] += m + 1

    # -- the pure functions -----------------------------------------------------------------------
    def _logits(self, h: mx.array) -> mx.array:
        return self.family.logits(self.lm, h)

    def _head(self, tokens: mx.array, hidden: mx.array, head_kv: list[tuple[mx.array, mx.array]],
              columns: mx.array, positions: mx.array) -> tuple[mx.array, list[tuple[mx.array, mx.array]]]:
        """The head over pairs (hidden [B, T, H], tokens [B, T]) written at `columns` [B, T]."""
        return self.family.mtp_head(self.lm, self.drafter, tokens, hidden, head_kv,
                                    _at(columns, positions, first(head_kv[0][0]).shape[2], offsets=positions[:, 0]))

    def _target(self, block: mx.array, lengths: mx.array, kv: list[tuple[mx.array, mx.array]],
                conv: list[mx.array], ssm: list[mx.array]) -> tuple[mx.array, list[Any], list[Any], list[Any]]:
        """The target over the block: its hidden states, and per GatedDeltaNet layer the conv input
        and the state after each position (the commit picks one); for a block of one token, the
        conv window and the state after it (nothing to pick: a plain step's arithmetic)."""
        B, T = block.shape
        columns = lengths[:, None] + mx.arange(T, dtype=mx.int32)[None, :]
        at = _at(columns, mx.broadcast_to(columns[None], (3, B, T)), first(kv[0][0]).shape[2], offsets=lengths)
        return self.family.forward_block(self.lm, block, at, kv, conv, ssm, keep_states=T > 1, stage=self.stage)

    def _verify(self, block: mx.array, lengths: mx.array, room: mx.array, kv: list[tuple[mx.array, mx.array]],
                conv: list[mx.array], ssm: list[mx.array], usable: mx.array | None) -> tuple[Any, ...]:
        """Steps 2 and 3: the target over `block` [B, W], the accepted drafts, the cut, the commit."""
        vh, kv, conv_ins, states = self._target(block, lengths, kv, conv, ssm)
        targets = mx.argmax(self._logits(vh), axis=-1).astype(mx.int32)  # [B, W]
        W = block.shape[1]
        if W == 1:  # one token: nothing to accept or cut (m is 0), the states after it are the commit
            zero = mx.zeros(targets.shape[:1], dtype=mx.int32)
            return vh, targets, zero, zero, targets[:, 0], kv, conv_ins, states
        ok = (block[:, 1:] == targets[:, :-1]).astype(mx.int32)
        accepted = mx.sum(mx.cumprod(ok, axis=1), axis=1)  # [B]
        if usable is not None:
            accepted = mx.minimum(accepted, usable)
        is_eos = mx.zeros(targets.shape, dtype=mx.bool_)
        for eos in self._eos:
            is_eos = is_eos | (targets == eos)
        first_eos = mx.where(mx.any(is_eos, axis=1), mx.argmax(is_eos, axis=1), W).astype(mx.int32)
        m = mx.minimum(mx.minimum(accepted, room - 1), first_eos).astype(mx.int32)
        # commit: the GatedDeltaNet states after position m
        window = conv[0].shape[1] if conv else 0
        take_conv = (m + 1)[:, None] + mx.arange(window, dtype=mx.int32)[None, :]  # [B, K-1]
        conv = [mx.take_along_axis(c, take_conv[:, :, None], axis=1) for c in conv_ins]
        ssm = [mx.take_along_axis(s, m[:, None, None, None, None], axis=1)[:, 0] for s in states]
        bonus = mx.take_along_axis(targets, m[:, None], axis=1)[:, 0]
        return vh, targets, accepted, m, bonus, kv, conv, ssm

    def _bare_round(self, bonus: mx.array, lengths: mx.array, room: mx.array, kv: list[tuple[mx.array, mx.array]],
                    conv: list[mx.array], ssm: list[mx.array], host: mx.array, usable: mx.array) -> tuple[Any, ...]:
        """A round without the head: `[bonus, host drafts]` verified (width 1: a plain step)."""
        block = mx.concatenate([bonus[:, None], host], axis=1)
        _vh, targets, accepted, m, bonus, kv, conv, ssm = self._verify(block, lengths, room, kv, conv, ssm, usable)
        return targets, accepted, m, bonus, kv, conv, ssm

    def _round(self, bonus: mx.array, draft: mx.array, seed: mx.array, lengths: mx.array, head_lengths: mx.array,
               dpos: mx.array, room: mx.array, kv: list[tuple[mx.array, mx.array]], conv: list[mx.array],
               ssm: list[mx.array], head_kv: list[tuple[mx.array, mx.array]], host: mx.array | None = None,
               mine: mx.array | None = None, usable: mx.array | None = None, *, k: int) -> tuple[Any, ...]:
        # 1. draft k - 2 more tokens
        drafts, h, tok = [draft], seed, draft
        for j in range(k - 2):
            col = (head_lengths + j)[:, None]
            h, head_kv = self._head(tok[:, None], h, head_kv, col, (dpos + j)[:, None])
            tok = mx.argmax(self._logits(h[:, -1, :]), axis=-1).astype(mx.int32)
            drafts.append(tok)
        head_block = mx.stack(drafts, axis=1)  # [B, k-1]
        if host is None:
            block = mx.concatenate([bonus[:, None], head_block], axis=1)  # [B, k]
        else:
            # the host's drafts [B, W-1] where `mine`, else the head's (zero-padded or cut to W-1);
            # row i accepts at most usable[i] of them
            assert mine is not None
            W = host.shape[1] + 1
            if W > k:
                head_block = mx.concatenate([head_block, mx.zeros((head_block.shape[0], W - k), mx.int32)], axis=1)
            else:
                head_block = head_block[:, :W - 1]
            block = mx.concatenate([bonus[:, None], mx.where(mine[:, None], host, head_block)], axis=1)  # [B, W]
        # 2-3. verify, accept, cut, commit
        vh, targets, accepted, m, bonus, kv, conv, ssm = self._verify(block, lengths, room, kv, conv, ssm, usable)
        # 4. the head over the verified positions, the next draft from position m
        T = block.shape[1]
        columns = head_lengths[:, None] + mx.arange(T, dtype=mx.int32)[None, :]
        positions = dpos[:, None] + mx.arange(T, dtype=mx.int32)[None, :]
        hh, head_kv = self._head(targets, vh, head_kv, columns, positions)
        seed = mx.take_along_axis(hh, m[:, None, None], axis=1)  # [B, 1, H]
        draft = mx.argmax(self._logits(seed[:, 0, :]), axis=-1).astype(mx.int32)
        return targets, accepted, m, bonus, draft, seed, kv, conv, ssm, head_kv
