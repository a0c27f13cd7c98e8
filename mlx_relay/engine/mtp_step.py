"""One greedy MTP round of a Qwen3.5-family model as a pure function, compiled (GPU thread only;
used by `mtp_lane.MTPLane` for cohorts of greedy rows).

    out, state' = round(state, room)        # state: mtp_state.MTPState; room [B]: tokens each row may still emit

A round of block k, all inside one `mx.compile`d call over fixed-size state:
1. draft: the head proposes `k - 2` more tokens after the state's `draft` (k > 2 only), writing
   its KV at each row's next head columns;
2. verify: the target over `[bonus, d_1 .. d_{k-1}]` per row in one forward: attention keys and
   values written at columns `lengths[i] .. lengths[i] + k - 1` of the fixed buffers
   (`mx.put_along_axis`, per-row write index), each query seeing only its row's prefix and the
   block's earlier positions (a mask from the row's length), the GatedDeltaNet conv and
   recurrence run over the k positions keeping the k per-position states
   (`gated_delta_update_with_states`: k states, not a growing record);
3. accept on device: `a` = leading drafts equal to the target's argmax, cut like the eager lane's
   `_cut` (at the row's first EOS, and at `room`): `m = min(a, room - 1, first EOS)`; the row
   emits `targets[:, :m + 1]` (an accepted draft equals the target's argmax there);
   commit selects the conv window and recurrent state after position m (`mx.take_along_axis`);
   the KV needs nothing but the row's new length `lengths + m + 1` (kept on the host);
4. the head re-reads the k verified positions (pairs `(h_j, targets_j)`; the ones past m are
   overwritten by the next round) and proposes the next draft from position m.
The host reads `targets`, `a` and `m` once per round (the synchronisation the lane needs anyway to
emit tokens). Greedy rows only: sampling rows keep the eager path (`MTPLane`).

`tests/test_mtp_step.py` pins that it emits the greedy tokens of plain decoding (float32),
compiled and eager, alone and in ragged batches, and that a row's handed-back state continues
exactly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx_vlm.models.qwen3_5.gated_delta import gated_delta_update_with_states

from mlx_relay.engine.decode_step import UnsupportedModel, _normalize_qk
from mlx_relay.engine.mtp_state import MTPState
from mlx_relay.engine.pipeline_stage import Stage


@dataclass
class RoundOut:
    targets: mx.array  # [B, k] the target's argmax at each block position
    accepted: mx.array  # [B] leading drafts accepted (before the cut)
    committed: mx.array  # [B] m: the row emits targets[:, :m + 1] and commits m + 1 positions


def _conv(la: Any, conv_in: mx.array, T: int) -> mx.array:
    """The causal depthwise conv's T outputs over [B, K-1+T, C]; low precision weights accumulate
    in float32 per position, as the library's (and `decode_step`'s) one-token decode does."""
    weight = la.conv1d.weight  # [C, K, 1]
    if weight.dtype in (mx.bfloat16, mx.float16):
        K = weight.shape[1]
        w = weight[:, :, 0].T.astype(mx.float32)
        outs = [mx.sum(conv_in[:, j:j + K, :].astype(mx.float32) * w[None], axis=1) for j in range(T)]
        return mx.stack(outs, axis=1).astype(conv_in.dtype)
    return la.conv1d(conv_in)


def _gated_delta_net(la: Any, x: mx.array, conv_state: mx.array, ssm: mx.array
                     ) -> tuple[mx.array, mx.array, mx.array]:
    """Output [B, T, H], the conv input [B, K-1+T, C] and the recurrent state after each position
    [B, T, Hv, Dv, Dk]."""
    B, T, _ = x.shape
    mixed = la.in_proj_qkv(x)
    z = la.in_proj_z(x).reshape(B, T, -1, la.head_v_dim)
    b, a = la.in_proj_b(x), la.in_proj_a(x)
    conv_in = mx.concatenate([conv_state, mixed], axis=1)
    conv = nn.silu(_conv(la, conv_in, T))
    q, k, v = (t.reshape(B, T, h, d) for t, h, d in zip(
        mx.split(conv, [la.key_dim, 2 * la.key_dim], -1),
        (la.num_k_heads, la.num_k_heads, la.num_v_heads),
        (la.head_k_dim, la.head_k_dim, la.head_v_dim), strict=True))
    q, k = _normalize_qk(q, k)
    out, _final, states = gated_delta_update_with_states(q, k, v, a, b, la.A_log, la.dt_bias, state=ssm,
                                                         state_steps=T)
    out = la.norm(out, z)
    return la.out_proj(out.reshape(B, T, -1)), conv_in, states


def _attention(sa: Any, x: mx.array, keys_buf: mx.array, values_buf: mx.array, columns: mx.array,
               positions: mx.array, mask: mx.array) -> tuple[mx.array, mx.array, mx.array]:
    """T queries per row; their keys and values written at `columns` [B, T] of the buffers."""
    B, T, _ = x.shape
    queries, gate = mx.split(sa.q_proj(x).reshape(B, T, sa.num_attention_heads, -1), 2, axis=-1)
    gate = gate.reshape(B, T, -1)
    queries = sa.q_norm(queries).transpose(0, 2, 1, 3)
    keys = sa.k_norm(sa.k_proj(x).reshape(B, T, sa.num_key_value_heads, -1)).transpose(0, 2, 1, 3)
    values = sa.v_proj(x).reshape(B, T, sa.num_key_value_heads, -1).transpose(0, 2, 1, 3)
    queries, keys = sa.rotary_emb.apply_rotary(queries, keys, positions, unsqueeze_dim=1)
    where = columns[:, None, :, None]
    keys_buf = mx.put_along_axis(keys_buf, mx.broadcast_to(where, keys.shape), keys.astype(keys_buf.dtype), axis=2)
    values_buf = mx.put_along_axis(values_buf, mx.broadcast_to(where, values.shape), values.astype(values_buf.dtype),
                                   axis=2)
    out = mx.fast.scaled_dot_product_attention(queries, keys_buf, values_buf, scale=sa.scale, mask=mask)
    out = out.transpose(0, 2, 1, 3).reshape(B, T, -1)
    return sa.o_proj(out * mx.sigmoid(gate)), keys_buf, values_buf


def _prefix_mask(columns: mx.array, cap: int) -> mx.array:
    """[B, 1, T, cap]: query t of row i sees columns 0 .. columns[i, t]."""
    return (mx.arange(cap)[None, None, :] <= columns[:, :, None])[:, None]


class MTPStep:
    """`step(state, room) -> RoundOut`, updating `state`; compiled unless `compiled=False`."""

    def __init__(self, lm: Any, head: Any, *, block_size: int, eos_token_ids: list[int],
                 compiled: bool = True, stage: Stage | None = None) -> None:
        layers = getattr(getattr(lm, "model", None), "layers", None)
        if not layers or not all(hasattr(layer, "linear_attn" if getattr(layer, "is_linear", None) else "self_attn")
                                 for layer in layers):
            raise UnsupportedModel(f"{type(lm).__module__} is not a Qwen3.5-family language model")
        drafter = head.drafter
        if not all(hasattr(layer, "self_attn") and not getattr(layer, "is_linear", False) for layer in drafter.layers):
            raise UnsupportedModel("the MTP head's layers are not full-attention layers")
        if block_size < 2:
            raise ValueError("MTP block size must be at least 2")
        self.lm, self.drafter, self.k = lm, drafter, block_size
        self.stage = stage  # a pipeline stage: its layers only in the verify, the head on every rank
        self.layout = tuple(bool(layer.is_linear) for layer in layers)
        self._embed_scale = float(getattr(lm.model, "embed_scale", 1.0))
        self._eos = tuple(sorted(set(eos_token_ids)))  # constants of the trace (no array: building costs no memory)
        self._fn = mx.compile(self._round) if compiled else self._round

    def __call__(self, state: MTPState, room: list[int]) -> RoundOut:
        """One round; `room[i]` >= 1: tokens row i may still emit (its max_tokens left)."""
        state.ensure_room(self.k)
        lengths, head_lengths, dpos = state.index_arrays()
        room_arr = mx.array(room + [1] * (state.batch_size - len(room)), dtype=mx.int32)
        (targets, accepted, committed, state.bonus, state.draft, state.seed, state.kv, state.conv, state.ssm,
         state.head_kv) = self._fn(state.bonus, state.draft, state.seed, lengths, head_lengths, dpos, room_arr,
                                   state.kv, state.conv, state.ssm, state.head_kv)
        return RoundOut(targets, accepted, committed)

    @staticmethod
    def advance(state: MTPState, committed: list[int]) -> None:
        """The host's side of the commit: each real row's lengths move on by m + 1."""
        for i, m in enumerate(committed[:state.rows]):
            state.lengths[i] += m + 1
            state.head_lengths[i] += m + 1
            state.dpos[i] += m + 1

    # -- the pure function ------------------------------------------------------------------------
    def _logits(self, h: mx.array) -> mx.array:
        lm = self.lm
        return lm.model.embed_tokens.as_linear(h) if lm.args.tie_word_embeddings else lm.lm_head(h)

    def _head(self, tokens: mx.array, hidden: mx.array, head_kv: list[tuple[mx.array, mx.array]],
              columns: mx.array, positions: mx.array) -> tuple[mx.array, list[tuple[mx.array, mx.array]]]:
        """The head over pairs (hidden [B, T, H], tokens [B, T]) written at `columns` [B, T]."""
        d = self.drafter
        emb = self.lm.model.embed_tokens(tokens) * self._embed_scale
        h = d.fc(mx.concatenate([d.pre_fc_norm_embedding(emb), d.pre_fc_norm_hidden(hidden)], axis=-1))
        mask = _prefix_mask(columns, head_kv[0][0].shape[2])
        out_kv = []
        for layer, (kb, vb) in zip(d.layers, head_kv, strict=True):
            r, kb, vb = _attention(layer.self_attn, layer.input_layernorm(h), kb, vb, columns, positions, mask)
            out_kv.append((kb, vb))
            h = h + r
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return d.norm(h), out_kv

    def _target(self, block: mx.array, lengths: mx.array, kv: list[tuple[mx.array, mx.array]],
                conv: list[mx.array], ssm: list[mx.array]) -> tuple[mx.array, list[Any], list[Any], list[Any]]:
        lm = self.lm
        B, T = block.shape
        columns = lengths[:, None] + mx.arange(T, dtype=mx.int32)[None, :]
        positions = mx.broadcast_to(columns[None], (3, B, T))
        mask = _prefix_mask(columns, kv[0][0].shape[2])
        h = lm.model.embed_tokens(block)
        stage = self.stage
        if stage is not None and not stage.first:
            h = stage.receive(h)
        new_kv, conv_ins, states = [], [], []
        kv_in, gdn_in = iter(kv), iter(zip(conv, ssm, strict=True))
        for layer in lm.model.layers:
            x = layer.input_layernorm(h)
            if layer.is_linear:
                conv_state, ssm_state = next(gdn_in)
                r, conv_in, st = _gated_delta_net(layer.linear_attn, x, conv_state, ssm_state)
                conv_ins.append(conv_in)
                states.append(st)
            else:
                kb, vb = next(kv_in)
                r, kb, vb = _attention(layer.self_attn, x, kb, vb, columns, positions, mask)
                new_kv.append((kb, vb))
            h = h + r
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        if stage is not None:  # every rank: the last stage's hidden states, every position
            h = stage.share(h if stage.last else stage.send(h))
        return lm.model.norm(h), new_kv, conv_ins, states

    def _round(self, bonus: mx.array, draft: mx.array, seed: mx.array, lengths: mx.array, head_lengths: mx.array,
               dpos: mx.array, room: mx.array, kv: list[tuple[mx.array, mx.array]], conv: list[mx.array],
               ssm: list[mx.array], head_kv: list[tuple[mx.array, mx.array]]) -> tuple[Any, ...]:
        k = self.k
        # 1. draft k - 2 more tokens
        drafts, h, tok = [draft], seed, draft
        for j in range(k - 2):
            col = (head_lengths + j)[:, None]
            h, head_kv = self._head(tok[:, None], h, head_kv, col, (dpos + j)[:, None])
            tok = mx.argmax(self._logits(h[:, -1, :]), axis=-1).astype(mx.int32)
            drafts.append(tok)
        block = mx.stack([bonus, *drafts], axis=1)  # [B, k]
        # 2. verify
        vh, kv, conv_ins, states = self._target(block, lengths, kv, conv, ssm)
        targets = mx.argmax(self._logits(vh), axis=-1).astype(mx.int32)  # [B, k]
        # 3. accept and cut
        ok = (block[:, 1:] == targets[:, :-1]).astype(mx.int32)
        accepted = mx.sum(mx.cumprod(ok, axis=1), axis=1)  # [B]
        is_eos = mx.zeros(targets.shape, dtype=mx.bool_)
        for eos in self._eos:
            is_eos = is_eos | (targets == eos)
        first_eos = mx.where(mx.any(is_eos, axis=1), mx.argmax(is_eos, axis=1), k).astype(mx.int32)
        m = mx.minimum(mx.minimum(accepted, room - 1), first_eos).astype(mx.int32)
        # commit: the GatedDeltaNet states after position m
        window = conv[0].shape[1] if conv else 0
        take_conv = (m + 1)[:, None] + mx.arange(window, dtype=mx.int32)[None, :]  # [B, K-1]
        conv = [mx.take_along_axis(c, take_conv[:, :, None], axis=1) for c in conv_ins]
        ssm = [mx.take_along_axis(s, m[:, None, None, None, None], axis=1)[:, 0] for s in states]
        # 4. the head over the verified positions, the next draft from position m
        T = block.shape[1]
        columns = head_lengths[:, None] + mx.arange(T, dtype=mx.int32)[None, :]
        positions = dpos[:, None] + mx.arange(T, dtype=mx.int32)[None, :]
        hh, head_kv = self._head(targets, vh, head_kv, columns, positions)
        seed = mx.take_along_axis(hh, m[:, None, None], axis=1)  # [B, 1, H]
        draft = mx.argmax(self._logits(seed[:, 0, :]), axis=-1).astype(mx.int32)
        bonus = mx.take_along_axis(targets, m[:, None], axis=1)[:, 0]
        return targets, accepted, m, bonus, draft, seed, kv, conv, ssm, head_kv
