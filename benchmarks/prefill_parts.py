"""Where a prefill chunk's time goes, per part, the library's forward beside ours (issue 43.2): each
lever measured alone, in one process, on one model.

    python benchmarks/prefill_parts.py MODEL [--chunk 2048] [--context 0,28672] [--repeats 5] [--out parts.json]

For each context length C (tokens already in the caches, prefilled untimed through our forward)
and a chunk of `--chunk` tokens after them, medians over `--repeats` runs (each on a fresh copy of
the caches, evaluated and synchronized around the timed call) of:
- `chunk`: the whole chunk through mlx-vlm's forward (`library`) and ours (`ours`,
  `ModelForward.prefill`), and ours with one lever the other way at a time (`PrefillOptions`:
  `ours_without_recurrence`, `ours_with_conv`, `ours_without_experts`, `ours_without_qmm`); ours
  unpaced (its whole graph built, then evaluated: `ours_unpaced`) and of that the host's graph
  building alone (`ours_graph_build`: what a chunk costs before the device runs anything, the
  part of a small chunk's fixed cost that compiling the forward would remove);
- per part, on the first layer of each kind with a random residual stream: the GatedDeltaNet mixer
  (`gdn`: the library's module; ours; ours without our recurrence kernel or our conv), the mixture
  of experts with its router, shared expert and combine (`moe`: the library's block; ours grouped;
  ours with the library's experts), the attention mixer at context C (`attention`: the library's
  module, causal as its model masks a lone row; ours in query blocks).
Per-part figures are per layer; `per_chunk_ms` multiplies by the layers of that kind. Writes JSON
(the commit, the card, every sample) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
from prefill_block import positions, restore, timed  # beside this script (benchmarks/)

from mlx_relay.engine.kernels.backend import cuda_kernels_available
from mlx_relay.engine.lanes.stage_forward import ModelForward
from mlx_relay.engine.memory.batch_caches import batched
from mlx_relay.engine.models.loader import load_model
from mlx_relay.engine.models.prefill_options import PrefillOptions
from mlx_relay.engine.models.qwen3_5 import chunk_mixer
from mlx_relay.engine.models.qwen3_5 import layers as qlayers
from mlx_relay.engine.models.qwen3_5 import prefill as qprefill
from mlx_relay.engine.models.qwen3_5.kernels.grouped_experts import expert_weights, grouped_switch_glu
from mlx_relay.engine.models.qwen3_5.kernels.grouped_qmm import grouped_qmm
from mlx_relay.engine.models.qwen3_5.kernels.moe import route_topk


def card() -> str:
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                              text=True, check=True).stdout.strip().splitlines()[0]
    except (OSError, subprocess.CalledProcessError, IndexError):
        return "cpu"


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def states(caches: list[Any]) -> list[Any]:
    return [c.state for c in caches]


def build_then_eval(fn: Callable[[], Any]) -> tuple[float, float]:
    """(ms to build `fn`'s graph, ms to evaluate it): the inputs settled first."""
    mx.synchronize()
    t0 = time.perf_counter()
    out = fn()
    t1 = time.perf_counter()
    mx.eval(out)
    mx.synchronize()
    return (t1 - t0) * 1000, (time.perf_counter() - t1) * 1000


LEVERS = {"recurrence": "recurrence_kernel", "conv": "shifted_conv", "experts": "grouped_experts",
          "qmm": "quantized_kernel"}


def without(lever: str) -> PrefillOptions:
    """The defaults with `lever` the other way (off where it is on by default, on where off)."""
    field = LEVERS[lever]
    return PrefillOptions(**{field: not getattr(PrefillOptions(), field)})


def measure(lm: Any, context: int, chunk: int, repeats: int, seed: int) -> dict[str, Any]:
    ours_all = PrefillOptions()
    forward = ModelForward(lm, ours_all)
    vocab, hidden = lm.args.vocab_size, lm.args.hidden_size
    dtype = lm.model.norm.weight.dtype
    mx.random.seed(seed)
    caches = lm.make_cache()
    for a in range(0, context, chunk):  # the context, untimed, through our forward
        b = min(context, a + chunk)
        ids = mx.random.randint(0, vocab, (1, b - a))
        mx.eval(forward.prefill(ids, None, caches, positions(a, b)), states(caches))
    saved = states(caches)
    ids = mx.random.randint(0, vocab, (1, chunk))
    pos = positions(context, context + chunk)
    x = (mx.random.normal((1, chunk, hidden)) * 0.5).astype(dtype)
    mx.eval(ids, pos, x)

    def run(fn: Callable[[], Any]) -> list[float]:
        return timed(fn, repeats)  # (after a dropped first run: this shape's kernels compile)

    def library_chunk() -> Any:
        return lm(ids, cache=restore(lm, saved),
                  **batched(position_ids=pos, return_hidden=True, skip_logits=True)).hidden_states[-1]

    def ours_chunk(options: PrefillOptions) -> Callable[[], Any]:
        return lambda: ModelForward(lm, options).prefill(ids, None, restore(lm, saved), pos)

    result: dict[str, Any] = {"context": context, "chunk": chunk, "chunk_ms": {}, "parts_ms": {}, "errors": {}}

    def attempt(group: str, key: str, fn: Callable[[], Any]) -> None:
        """`run`, a lever whose kernel fails to build or run recorded as its error (the rest still run)."""
        try:
            result[group][key] = run(fn)
        except Exception as exc:
            result["errors"][key] = repr(exc)[:1000]
            print(f"  {key}: failed: {result['errors'][key]}", flush=True)

    result["chunk_ms"]["library"] = run(library_chunk)
    result["chunk_ms"]["ours"] = run(ours_chunk(ours_all))
    # the host's part: building the chunk's whole graph (unpaced), nothing evaluated, then the rest
    unpaced = PrefillOptions(paced=False)
    built = []
    for _ in range(repeats + 1):  # (the first compiles this shape's kernels: dropped)
        caches = restore(lm, saved)
        built.append(build_then_eval(lambda c=caches: ModelForward(lm, unpaced).prefill(ids, None, c, pos)))
    built = built[1:]
    result["chunk_ms"]["ours_unpaced"] = [b + e for b, e in built]
    result["chunk_ms"]["ours_graph_build"] = [b for b, _ in built]
    for lever, field in LEVERS.items():
        flipped = "with" if not getattr(ours_all, field) else "without"
        attempt("chunk_ms", f"ours_{flipped}_{lever}", ours_chunk(without(lever)))

    layer_list = lm.model.layers
    gdn_i = next(i for i, layer in enumerate(layer_list) if layer.is_linear)
    att_i = next(i for i, layer in enumerate(layer_list) if not layer.is_linear)
    gdn, att = layer_list[gdn_i], layer_list[att_i]
    parts = result["parts_ms"]

    def gdn_ours(options: PrefillOptions) -> Callable[[], Any]:
        return lambda: chunk_mixer.gated_delta_net(gdn.linear_attn, x, restore(lm, saved)[gdn_i], None, options)

    def moe_ours(options: PrefillOptions) -> Callable[[], Any]:
        return lambda: qlayers.layer_residual(gdn, x, mx.zeros_like(x), None, options)

    parts["gdn_library"] = run(lambda: gdn.linear_attn(x, None, restore(lm, saved)[gdn_i]))
    parts["gdn_ours"] = run(gdn_ours(ours_all))
    for lever in ("recurrence", "conv"):
        parts[f"gdn_ours_without_{lever}"] = run(gdn_ours(without(lever)))
    if hasattr(gdn.mlp, "switch_mlp") and cuda_kernels_available():  # (bf16 gather_mm: GPU only)
        parts["moe_library"] = run(lambda: x + gdn.mlp(gdn.post_attention_layernorm(x)))
        parts["moe_ours"] = run(moe_ours(ours_all))
        parts["moe_ours_without_experts"] = run(moe_ours(without("experts")))
        attempt("parts_ms", "moe_ours_with_qmm", moe_ours(PrefillOptions(quantized_kernel=True)))
        switch = gdn.mlp.switch_mlp
        inds, _ = route_topk(gdn.mlp.gate(x), gdn.mlp.top_k, gdn.mlp.norm_topk_prob)
        mx.eval(inds)
        parts["moe_router"] = run(lambda: route_topk(gdn.mlp.gate(x), gdn.mlp.top_k, gdn.mlp.norm_topk_prob))
        parts["moe_shared"] = run(lambda: gdn.mlp.shared_expert(x))
        parts["moe_dequantize"] = run(lambda: [expert_weights(m) for m in (switch.gate_proj, switch.up_proj,
                                                                         switch.down_proj)])
        parts["moe_grouped_experts"] = run(lambda: grouped_switch_glu(switch, x, inds, kernel=False))
        weights = [expert_weights(m) for m in (switch.gate_proj, switch.up_proj, switch.down_proj)]
        mx.eval(weights)
        order = mx.argsort(inds.flatten())
        rows = x.reshape(-1, 1, x.shape[-1])[order // inds.shape[-1]]
        experts = inds.flatten()[order]
        mx.eval(rows, experts)
        parts["moe_grouped_gemm_up"] = run(lambda: mx.gather_mm(rows, weights[1].swapaxes(-1, -2), rhs_indices=experts,
                                                                 sorted_indices=True))
        attempt("parts_ms", "moe_grouped_qmm_up", lambda: grouped_qmm(rows, switch.up_proj, experts))
        del weights

    parts["attention_library"] = run(lambda: att.self_attn(x, mask="causal", cache=restore(lm, saved)[att_i],
                                                           position_ids=pos))
    parts["attention_ours"] = run(lambda: qprefill.attention(att.self_attn, x, restore(lm, saved)[att_i], pos, None,
                                                             "causal", ours_all))
    n_gdn = sum(1 for layer in layer_list if layer.is_linear)
    per_layer = {"gdn": n_gdn, "moe": len(layer_list), "attention": len(layer_list) - n_gdn}
    result["per_chunk_ms"] = {k: statistics.median(v) * per_layer[k.split("_")[0]] for k, v in parts.items()}
    result["layers"] = per_layer
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", type=Path)
    parser.add_argument("--chunk", type=int, default=2048)
    parser.add_argument("--context", default="0,28672")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    lm = load_model(args.model).model.language_model
    runs = []
    for context in (int(c) for c in args.context.split(",")):
        run = measure(lm, context, args.chunk, args.repeats, args.seed)
        runs.append(run)
        print(f"\ncontext {context}, chunk {args.chunk} (median ms, min-max)")
        for group in ("chunk_ms", "parts_ms"):
            for name, samples in run[group].items():
                extra = f"  per chunk {run['per_chunk_ms'][name]:.1f}" if group == "parts_ms" else ""
                print(f"  {name:32s} {statistics.median(samples):9.2f}  ({min(samples):.2f}-{max(samples):.2f}){extra}")
        sys.stdout.flush()
        if args.out:
            args.out.write_text(json.dumps({"commit": commit(), "card": card(), "model": str(args.model),
                                            "runs": runs}, indent=2))


if __name__ == "__main__":
    main()
