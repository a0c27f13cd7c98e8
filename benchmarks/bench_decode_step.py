"""The decode step alone (issue 17.3): mlx-vlm's own decode next to our compiled step, per token.

On one model, rows prefilled with `--prompt-tokens` tokens each, in one process, alternating the
variants over `--repeats` passes of `--steps` tokens each (greedy, pipelined the way mlx-lm's
`generate_step` runs: step N+1's graph is built while the device runs step N):

  library   mlx-vlm's LanguageModel through its own caches (batch 1: `KVCache`/`ArraysCache` and
            explicit positions, as the raw `generate_step` loop; batch > 1: its batch caches)
  eager     our `DecodeStep` over `DecodeState`, run op by op
  compiled  the same function through `mx.compile` (what the server runs)
  compiled_unmerged  (`--unmerged`) the same over a second copy of the model whose projections of
            one input stay separate matmuls (`models/merged_projections.py`)
  compiled_lib_experts  (`--library-experts`) the same with the library's experts where a CUDA GPU
            runs ours (over few pairs `kernels.pair_qmv`, past them the grouped experts the plain lane
            gives its step: the engine's `--prefill-experts`)

Reported per variant and batch size: ms per step (median of the passes), host ms per step (the
time the Python thread spends building and dispatching a step), the first call's seconds (trace
and kernel compilation), and whether its greedy tokens equal the library's over the first pass
(bf16 on a GPU may round differently; the float32 tests pin exactness). Writes JSON.

    python benchmarks/bench_decode_step.py [MODEL_DIR] [--batch 1,4] [--out out.json]

`--count-ops`: instead of timing, the operations one step evaluates, per variant (MLX's own graph
export, `mx.export_to_dot`, of one step's logits and new cache state): every primitive, and
those that launch work (views such as reshapes, broadcasts, slices and transposes launch nothing;
a compiled function's fused elementwise chain is one). On a GPU each launching primitive is
about one kernel launch, and the step is launch-bound (`../shared` GPU notes: ~2,345 kernels per
token for the library's step), so this counts what the compiled step saves, on any machine.
On the CPU backend MLX's fast primitives (rms_norm, rope, attention) expand into the ops they are
made of, and our CUDA kernels (`mlx_relay/engine/kernels/`) run as their plain-MLX fallbacks, so
counts there exceed what a GPU launches; compare variants, not machines.

`--by-layer` (with `--count-ops`): the launching primitives of each part of the compiled step
alone, traced the way the step runs it: a GatedDeltaNet mixer (input norm, projections, the mixer,
output projection, residual), an attention mixer (the same around attention), the MLP or mixture
of experts with its norm and residual, and the embedding + final norm + head + argmax; with the
layer counts, the per-token total they add up to.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import re
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import mlx.core as mx

from mlx_relay.bench.machine import environment
from mlx_relay.engine.lanes.decode_state import DecodeState, batch_bucket
from mlx_relay.engine.lanes.decode_step import DecodeStep
from mlx_relay.engine.memory.batch_caches import as_batch_caches, batched, extend_caches
from mlx_relay.engine.models import family_of
from mlx_relay.engine.models.dense_copies import add_dense_copies
from mlx_relay.engine.models.loader import detect_backend, load_model
from mlx_relay.engine.models.prefill_options import PrefillOptions, prefill_experts
from mlx_relay.testing.fixtures import FixtureSpec, fixture_path


def positions(a: int, b: int) -> mx.array:
    return mx.broadcast_to(mx.arange(a, b, dtype=mx.int32)[None, None, :], (3, 1, b - a))


def prefill(lm: Any, prompt: list[int], chunk: int = 2048) -> tuple[list[Any], mx.array]:
    cache = lm.make_cache()
    out = None
    for s in range(0, len(prompt), chunk):
        e = min(len(prompt), s + chunk)
        out = lm(mx.array([prompt[s:e]]), cache=cache, position_ids=positions(s, e))
        mx.eval([c.state for c in cache])
    assert out is not None
    first = mx.argmax(out.logits[:, -1, :], axis=-1).astype(mx.int32)
    mx.eval(first)
    return cache, first


class Library:
    """mlx-vlm's decode through its caches (a fresh copy of the prefilled state each pass)."""

    def __init__(self, lm: Any, rows: list[tuple[list[Any], mx.array]], prompt_len: int) -> None:
        self.lm, self.rows, self.n = lm, rows, prompt_len

    def start(self) -> tuple[Any, mx.array]:
        if len(self.rows) == 1:
            cache, first = self.rows[0]
            return [_copy_cache(c) for c in cache], first
        batch: list[Any] = []
        for cache, _ in self.rows:
            b = as_batch_caches([_copy_cache(c) for c in cache])
            batch = b if not batch else (extend_caches(batch, b) or batch)
        return batch, mx.concatenate([f for _, f in self.rows])

    def step(self, state: Any, tokens: mx.array, i: int) -> mx.array:
        if len(self.rows) == 1:
            at = self.n + i
            out = self.lm(tokens[:, None], cache=state, position_ids=positions(at, at + 1))
        else:
            deltas = mx.zeros((tokens.shape[0], 1), dtype=mx.int32)
            out = self.lm(tokens[:, None], cache=state, **batched(rope_deltas=deltas))
        return mx.argmax(out.logits[:, -1, :], axis=-1).astype(mx.int32)


def _copy_cache(c: Any) -> Any:
    from mlx_vlm.models.cache import ArraysCache, KVCache

    if isinstance(c, KVCache):
        copy = KVCache()
        copy.state = (mx.array(c.keys[..., :c.offset, :]), mx.array(c.values[..., :c.offset, :]))
        return copy
    copy = ArraysCache(len(c.cache))
    copy.state = [None if a is None else mx.array(a) for a in c.state]
    return copy


class Ours:
    def __init__(self, lm: Any, rows: list[tuple[list[Any], mx.array]], compiled: bool,
                 options: PrefillOptions | None = None) -> None:
        self.step_fn = DecodeStep(lm, compiled=compiled, options=options)
        self.rows = rows

    def start(self) -> tuple[DecodeState, mx.array]:
        state: DecodeState | None = None
        for cache, _ in self.rows:
            s = DecodeState.from_batch_caches(as_batch_caches([_copy_cache(c) for c in cache]), [0])
            if state is None:
                state = s
            else:
                state.extend(s)
        assert state is not None
        tokens = mx.concatenate([f for _, f in self.rows])
        size = batch_bucket(len(self.rows))
        state.pad_to(size)
        if size > len(self.rows):
            tokens = mx.concatenate([tokens, mx.zeros((size - len(self.rows),), dtype=mx.int32)])
        return state, tokens

    def step(self, state: DecodeState, tokens: mx.array, i: int) -> mx.array:
        return mx.argmax(self.step_fn(tokens, state), axis=-1).astype(mx.int32)


# primitives that make a view or change metadata only: no kernel on the GPU
VIEWS = frozenset({"Reshape", "Broadcast", "Slice", "Transpose", "AsStrided", "ExpandDims", "Squeeze",
                   "StopGradient", "Depends", "Split", "Flatten", "Unflatten", "BroadcastAxes", "NumberOfElements"})


def step_ops(variant: Any) -> collections.Counter[str]:
    """The primitives of one (unevaluated) step: its next tokens and every array of its new cache state."""
    state, tokens = variant.start()
    mx.eval(tokens)
    nxt = variant.step(state, tokens, 0)
    if isinstance(state, DecodeState):
        outs = [a for pair in state.kv for a in pair] + list(state.conv) + list(state.ssm)
    else:
        outs = [a for c in state for a in (c.state if isinstance(c.state, (list, tuple)) else [c.state])
                if isinstance(a, mx.array)]
    return graph_ops([nxt, *outs])


def graph_ops(outs: list[Any]) -> collections.Counter[str]:
    """Every primitive of the graph behind `outs` (MLX's own export), then evaluated."""
    with tempfile.NamedTemporaryFile(suffix=".dot") as f:
        mx.export_to_dot(f.name, *outs)
        labels = re.findall(r'label ="([^"]+)", shape=rectangle', Path(f.name).read_text())
    mx.eval(outs)
    return collections.Counter(labels)


def launching(ops: collections.Counter[str]) -> dict[str, Any]:
    kept = collections.Counter({k: n for k, n in ops.items() if k not in VIEWS})
    return {"launching": sum(kept.values()), "primitives": sum(ops.values()), "by_primitive": dict(kept.most_common())}


def mtp_round_ops(model: Path, lm: Any, prompt: list[int], block: int, width: int = 0) -> dict[str, Any]:
    """Launching primitives of one compiled MTP round at `block` (batch 1), as `MTPLane` runs it:
    the head's drafts, the target's verify over the block, the cut, the commit, the next draft.
    `width` > 0: the head-free round instead, verifying `width - 1` drafts copied from the context
    (width 1: a row whose context has no proposal, the lane's plain step)."""
    from mlx_relay.engine.lanes.mtp_head import MTPHead
    from mlx_relay.engine.lanes.mtp_state import MTPState
    from mlx_relay.engine.lanes.mtp_step import HostDrafts, MTPStep

    head = MTPHead.load(model, lm, exact=False)
    state, _ = MTPState.prefilled(lm, head, prompt)
    mx.eval(state.arrays())
    step = MTPStep(lm, head, block_size=block, eos_token_ids=[])
    drafts = HostDrafts(width, [prompt[:width - 1]], [False]) if width else None
    r = step(state, [1 << 20], drafts)
    outs = [r.targets, r.accepted, r.committed, state.bonus, state.draft, state.seed,
            *(a for pair in state.kv + state.head_kv for a in pair), *state.conv, *state.ssm]
    return launching(graph_ops(outs))


def count_ops(lm: Any, rows: list[tuple[list[Any], mx.array]], prompt_len: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, v in {"library": Library(lm, rows, prompt_len), "eager": Ours(lm, rows, False),
                    "compiled": Ours(lm, rows, True)}.items():
        ops = step_ops(v)
        launching = {k: n for k, n in ops.items() if k not in VIEWS}
        out[name] = {"primitives": sum(ops.values()), "launching": sum(launching.values()),
                     "by_primitive": dict(sorted(launching.items(), key=lambda kv: -kv[1]))}
    return out


def layer_ops(lm: Any, batch: int) -> dict[str, Any]:
    """Launching primitives per part of the compiled step (`--by-layer`)."""
    from mlx_relay.engine.models.positions import Positions
    from mlx_relay.engine.models.qwen3_5 import layers as qwen

    def count(fn: Any, *args: Any) -> dict[str, Any]:
        return launching(graph_ops(mx.compile(fn)(*args)))

    layers = lm.model.layers
    lin = next(layer for layer in layers if layer.is_linear)
    att = next(layer for layer in layers if not layer.is_linear)
    la, sa = lin.linear_attn, att.self_attn
    dtype = lm.model.embed_tokens.weight.dtype if lm.model.embed_tokens.weight.dtype != mx.uint32 else mx.bfloat16
    h = (mx.random.normal((batch, 1, lm.args.hidden_size)) * 0.1).astype(dtype)
    conv = mx.zeros((batch, la.conv1d.weight.shape[1] - 1, la.conv1d.weight.shape[0]), dtype=dtype)
    ssm = mx.zeros((batch, la.num_v_heads, la.head_v_dim, la.head_k_dim), dtype=mx.float32)
    cap = 256
    keys = mx.zeros((batch, sa.num_key_value_heads, cap, sa.head_dim), dtype=dtype)
    values = mx.zeros_like(keys)
    idx = mx.array(10, dtype=mx.int32)
    tok = mx.zeros((batch, 1), dtype=mx.int32)
    periods = qwen.rope_periods(lm.model.layers)
    offsets = mx.full((batch,), 10, dtype=mx.int32)
    mx.eval(h, conv, ssm, keys, values, idx, tok, offsets, periods)

    def gdn(h: mx.array, conv: mx.array, ssm: mx.array) -> list[mx.array]:
        r, c, s = qwen.gated_delta_net(la, lin.input_layernorm(h), conv, ssm, keep_states=False)
        return [h + r, c, s]

    def attention(h: mx.array, keys: mx.array, values: mx.array, idx: mx.array, offsets: mx.array) -> list[mx.array]:
        pos = mx.broadcast_to(offsets[None, :, None], (3, batch, 1))
        valid = (mx.arange(cap)[None, :] <= idx)[:, None, None, :]
        at = Positions.at_column(idx, pos, valid, offsets)
        r, k, v = qwen.attention(sa, att.input_layernorm(h), keys, values, at, periods)
        return [h + r, k, v]

    rows = qwen.expert_rows(lm.model.layers, tok)  # made once per step, outside the layers
    mx.eval(rows)

    def mlp(h: mx.array, *rows_in: mx.array) -> list[mx.array]:
        return [qwen.layer_residual(lin, h, mx.zeros_like(h), qwen.ExpertRows(*rows_in) if rows_in else None)]

    def head(tok: mx.array, h: mx.array) -> list[mx.array]:
        return [lm.model.embed_tokens(tok), mx.argmax(qwen.logits(lm, lm.model.norm(h))[:, -1, :], axis=-1)]

    parts = {"gated_delta_mixer": count(gdn, h, conv, ssm),
             "attention_mixer": count(attention, h, keys, values, idx, offsets),
             "mlp": count(mlp, h, *(rows or ())), "embed_norm_head": count(head, tok, h)}
    n_lin = sum(1 for layer in layers if layer.is_linear)
    n_att = len(layers) - n_lin
    total = (n_lin * parts["gated_delta_mixer"]["launching"] + n_att * parts["attention_mixer"]["launching"]
             + len(layers) * parts["mlp"]["launching"] + parts["embed_norm_head"]["launching"])
    return {"parts": parts, "layers": {"gated_delta": n_lin, "attention": n_att}, "total_per_token": total}


def run_pass(variant: Any, steps: int, rows: int) -> tuple[float, float, list[list[int]]]:
    """(ms per step, host ms per step, tokens per row) over `steps` pipelined steps."""
    state, tokens = variant.start()
    mx.eval(tokens)
    host = 0.0
    emitted: list[list[int]] = [[] for _ in range(rows)]
    tic = time.perf_counter()
    for i in range(steps):
        h0 = time.perf_counter()
        nxt = variant.step(state, tokens, i)
        mx.async_eval(nxt)
        host += time.perf_counter() - h0
        for r, t in enumerate(tokens.tolist()[:rows]):
            emitted[r].append(t)
        tokens = nxt
    mx.eval(tokens)
    wall = time.perf_counter() - tic
    return wall / steps * 1e3, host / steps * 1e3, emitted


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", nargs="?", default=None, help="checkpoint dir (default: the bf16 tiny fixture)")
    parser.add_argument("--batch", default="1,4")
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=None)
    parser.add_argument("--dense-16bit", action="store_true", help="16-bit copies of the dense projections")
    parser.add_argument("--library-experts", action="store_true",
                        help="also the compiled step with the library's experts (kernels.pair_qmv's other side)")
    parser.add_argument("--unmerged", action="store_true",
                        help="also the compiled step over a second copy of the model whose projections of one "
                             "input are not merged (models/merged_projections.py's other side)")
    parser.add_argument("--count-ops", action="store_true", help="count one step's operations instead of timing")
    parser.add_argument("--by-layer", action="store_true", help="with --count-ops: launches per part of the step")
    parser.add_argument("--mtp-block", type=int, default=0,
                        help="with --count-ops: also one compiled MTP round at this block (batch 1; needs a head)")
    parser.add_argument("--spec-widths", default="",
                        help="with --count-ops: also the head-free round (context drafts) at these widths, e.g. 1,9 "
                             "(batch 1; width 1 is a row without a proposal)")
    args = parser.parse_args()
    model = Path(args.model) if args.model else fixture_path(FixtureSpec("bf16", 0))
    loaded = load_model(model)
    if args.dense_16bit:
        lm = loaded.model.language_model
        print(f"16-bit dense copies: {add_dense_copies(family_of(lm).layers(lm)) / 1e9:.2f} GB")
    lm = loaded.model.language_model
    # a second copy of the weights, unmerged (`models/merged_projections.py`'s other side)
    unmerged = load_model(model, merge=False).model.language_model if args.unmerged else None
    vocab = loaded.info.vocab_size
    rng = random.Random(0)
    results: dict[str, Any] = {"environment": msgspec_to_builtins(environment()), "model": str(model),
                               "prompt_tokens": args.prompt_tokens, "steps": args.steps,
                               "repeats": args.repeats, "batches": {}}
    for b in (int(x) for x in args.batch.split(",")):
        rows = [prefill(lm, [rng.randrange(100, vocab - 1) for _ in range(args.prompt_tokens)]) for _ in range(b)]
        if args.count_ops:
            counted = count_ops(lm, rows, args.prompt_tokens)
            results["batches"][str(b)] = counted
            print(f"batch {b}: " + "; ".join(f"{n} {c['launching']} launching of {c['primitives']} primitives"
                                             for n, c in counted.items()), flush=True)
            for n, c in counted.items():
                print(f"  {n}: " + ", ".join(f"{k} {v}" for k, v in list(c["by_primitive"].items())[:14]))
            if args.mtp_block and b == 1:
                prompt = [rng.randrange(100, vocab - 1) for _ in range(args.prompt_tokens)]
                counted["mtp_round"] = mtp_round_ops(model, lm, prompt, args.mtp_block)
                step = counted["compiled"]["launching"]
                print(f"  MTP round, block {args.mtp_block}: {counted['mtp_round']['launching']} launching "
                      f"({counted['mtp_round']['launching'] / step:.2f}x the compiled step): "
                      + ", ".join(f"{k} {v}" for k, v in list(counted["mtp_round"]["by_primitive"].items())[:14]))
            for width in (int(w) for w in args.spec_widths.split(",") if w) if b == 1 else ():
                prompt = [rng.randrange(100, vocab - 1) for _ in range(args.prompt_tokens)]
                key = f"context_round_w{width}"
                counted[key] = mtp_round_ops(model, lm, prompt, max(2, args.mtp_block), width)
                print(f"  head-free round, width {width}: {counted[key]['launching']} launching "
                      f"({counted[key]['launching'] / counted['compiled']['launching']:.3f}x the compiled step)")
            if args.by_layer:
                parts = layer_ops(lm, b)
                counted["by_layer"] = parts
                print(f"  by layer ({parts['layers']}): total {parts['total_per_token']} per token")
                for n, c in parts["parts"].items():
                    print(f"    {n}: {c['launching']}: " + ", ".join(f"{k} {v}" for k, v in c["by_primitive"].items()))
            continue
        # our steps with the experts' options the plain lane gives its step (`PlainLane`: the engine's)
        served = PrefillOptions().with_experts(prefill_experts("auto", detect_backend()))
        variants = {"library": Library(lm, rows, args.prompt_tokens), "eager": Ours(lm, rows, False, served),
                    "compiled": Ours(lm, rows, True, served)}
        if args.library_experts:  # the same step with the library's experts (where a CUDA GPU runs ours)
            variants["compiled_lib_experts"] = Ours(lm, rows, True, PrefillOptions().with_experts("library"))
        if unmerged is not None:  # the same weights, each projection its own matmul
            variants["compiled_unmerged"] = Ours(unmerged, rows, True, served)
        first_call: dict[str, float] = {}
        for name, v in variants.items():  # warm-up pass: traces and kernels
            t0 = time.perf_counter()
            run_pass(v, 2, b)
            first_call[name] = time.perf_counter() - t0
            run_pass(v, args.steps, b)
        samples: dict[str, list[tuple[float, float]]] = {name: [] for name in variants}
        tokens: dict[str, list[list[int]]] = {}
        for _ in range(args.repeats):
            for name, v in variants.items():
                ms, host, emitted = run_pass(v, args.steps, b)
                samples[name].append((ms, host))
                tokens.setdefault(name, emitted)
        summary = {}
        library_ms = statistics.median(x for x, _ in samples["library"])
        for name, s in samples.items():
            ms = statistics.median(x for x, _ in s)
            summary[name] = {"ms_per_step": ms, "ms_min": min(x for x, _ in s), "ms_max": max(x for x, _ in s),
                             "ms_passes": [x for x, _ in s], "host_ms_per_step": statistics.median(h for _, h in s),
                             "tok_s_per_row": 1e3 / ms, "first_call_s": first_call[name],
                             "same_tokens_as_library": tokens[name] == tokens["library"],
                             "vs_library": library_ms / ms}
        results["batches"][str(b)] = summary
        print(f"batch {b}: " + "; ".join(f"{n} {v['ms_per_step']:.2f} ms [{v['ms_min']:.2f}-{v['ms_max']:.2f}] "
                                         f"(host {v['host_ms_per_step']:.2f}, "
                                         f"{v['vs_library']:.2f}x, same {v['same_tokens_as_library']}, "
                                         f"first {v['first_call_s']:.1f}s)" for n, v in summary.items()), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))


def msgspec_to_builtins(obj: Any) -> Any:
    import msgspec

    return msgspec.to_builtins(obj)


if __name__ == "__main__":
    main()
