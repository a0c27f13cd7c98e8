"""Where an MTP round's time goes, next to a plain decode step (issue 4.3).

On one batch of B rows prefilled with `--prompt-tokens` tokens each, in one process, alternating
the variants over `--repeats` passes, each timed over `--steps` iterations (ms per iteration):

  step_pipelined  plain decode as mlx-lm/mlx-vlm run it: the next step's graph is built while the
                  GPU runs the current one (async_eval), one token per row per step
  step_sync       the same step, but built, run and read back one after another (no overlap)
  verify_sync     the target's ordinary forward over k tokens per row + argmax, read back, inside
                  a speculative cache transaction (GatedDeltaNet states recorded per position),
                  then a commit of one position: the round's target part (batched verify)
  exact_sync      the same with mlx-vlm's batch-invariant verifier (`speculative_verify=True`)
  head_sync       the MTP head over one position + argmax, read back

A round is roughly verify_sync + head_sync (+ drafting for k > 2); its floor against a plain
step is (verify_sync + head_sync) / step_pipelined.

    python benchmarks/mtp_round_breakdown.py MODEL_DIR [--batch 1,16] [--block 2] [--out out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import mlx.core as mx
from mlx_vlm.models.cache import ArraysCache, BatchKVCache, KVCache
from mlx_vlm.speculative.cache_state import commit_speculative_round, start_speculative_cache

from mlx_relay.engine.lanes.mtp_head import MTPHead
from mlx_relay.engine.models.loader import load_model


def prefill(lm: Any, rows: list[list[int]]) -> list[Any]:
    """Each row prefilled alone, then merged into batch caches (as the MTP lane does)."""
    per_row = []
    for p in rows:
        c = lm.make_cache()
        pos = mx.broadcast_to(mx.arange(len(p))[None, None, :], (3, 1, len(p)))
        lm(mx.array([p]), cache=c, position_ids=pos, return_hidden=True, skip_logits=True)
        mx.eval([x.state for x in c])
        per_row.append(c)
    merged = []
    for layer in zip(*per_row, strict=True):
        cls = BatchKVCache if isinstance(layer[0], KVCache) else ArraysCache
        merged.append(cls.merge(list(layer)))
    mx.eval([x.state for x in merged])
    return merged


def timed(fn: Callable[[], None], steps: int) -> float:
    fn()  # not timed: shapes compiled, pipelines primed
    mx.synchronize()
    t0 = time.perf_counter()
    for _ in range(steps):
        fn()
    mx.synchronize()
    return 1000 * (time.perf_counter() - t0) / steps


def variants(lm: Any, head: MTPHead, rows: list[list[int]], k: int,
             vocab: int) -> dict[str, Callable[[], Callable[[], None]]]:
    B = len(rows)
    zeros = mx.zeros((B, 1), dtype=mx.int32)

    def forward(cache: list[Any], tokens: mx.array, **kw: Any) -> mx.array:
        out = lm(tokens, cache=cache, return_hidden=True, skip_logits=True, rope_deltas=zeros, **kw)
        return out.hidden_states[-1], out

    def step_pipelined() -> Callable[[], None]:
        cache = prefill(lm, rows)
        state = {"y": mx.zeros((B,), dtype=mx.int32)}

        def one() -> None:
            h, _ = forward(cache, state["y"][:, None])
            y = head.argmax(h[:, -1:, :]).reshape(B).astype(mx.int32)
            mx.async_eval(y)
            prev, state["y"] = state["y"], y
            prev.tolist()  # wait for the previous step while this one runs
        return one

    def tokens(t: int) -> mx.array:  # distinct tokens, so rows and positions route to different experts
        return mx.random.randint(0, min(vocab, 50_000), (B, t)).astype(mx.int32)

    def step_sync() -> Callable[[], None]:
        cache = prefill(lm, rows)

        def one() -> None:
            h, _ = forward(cache, tokens(1))
            head.argmax(h).tolist()
        return one

    def verify_sync(exact: bool) -> Callable[[], Callable[[], None]]:
        def make() -> Callable[[], None]:
            cache = prefill(lm, rows)

            def one() -> None:
                block = tokens(k)
                if exact:
                    h, out = forward(cache, block, speculative_verify=True, return_shared_kv=True)
                    txn = out.gdn_states
                else:
                    txn = start_speculative_cache(cache, k)
                    h, _ = forward(cache, block, capture_layer_ids=[])
                head.argmax(h).tolist()
                commit_speculative_round(lm, cache, txn, [0] * B, k)
            return one
        return make

    def head_sync() -> Callable[[], None]:
        dcache = head.make_cache()
        hidden = mx.random.normal((B, 1, lm.args.hidden_size)).astype(mx.bfloat16)
        pos = {"p": 0}

        def one() -> None:
            h = head.forward(tokens(1), hidden, dcache, mx.full((B, 1), pos["p"], dtype=mx.int32))
            head.argmax(h).tolist()
            pos["p"] += 1
        return one

    return {"step_pipelined": step_pipelined, "step_sync": step_sync,
            "verify_sync": verify_sync(False), "exact_sync": verify_sync(True), "head_sync": head_sync}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", type=Path)
    ap.add_argument("--batch", default="1,16")
    ap.add_argument("--block", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()

    loaded = load_model(args.model)
    lm = loaded.model.language_model
    head = MTPHead.load(args.model, lm, exact=False)
    vocab = loaded.info.vocab_size
    report: dict[str, Any] = {"model": str(args.model), "device": repr(mx.default_device()), "block": args.block,
                              "batches": {}}
    for b in (int(x) for x in args.batch.split(",")):
        rows = [[(7 + 31 * r + 13 * i) % min(vocab, 50_000) for i in range(args.prompt_tokens)] for r in range(b)]
        makers = variants(lm, head, rows, args.block, vocab)
        times: dict[str, list[float]] = {name: [] for name in makers}
        for rep in range(args.repeats):
            for name in (list(makers) if rep % 2 == 0 else list(makers)[::-1]):
                times[name].append(timed(makers[name](), args.steps))
        med = {name: round(statistics.median(v), 3) for name, v in times.items()}
        step = med["step_pipelined"]
        ratios = {f"{name}_in_steps": round(ms / step, 3) for name, ms in med.items()}
        ratios["round_floor_in_steps"] = round((med["verify_sync"] + med["head_sync"]) / step, 3)
        report["batches"][str(b)] = {"ms": med, **ratios}
        print(f"B={b}: " + ", ".join(f"{n} {ms:.2f} ms" for n, ms in med.items()), flush=True)
        print("      " + ", ".join(f"{n} {r}" for n, r in ratios.items()), flush=True)
    if args.out is not None:
        args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
