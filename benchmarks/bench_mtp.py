"""MTP speculative decoding: what it buys and what a round costs (issue 4, points 3 and 7).

In one process, on one thread, alternating variant by variant over `--repeats` passes (ABBA)
so machine drift cancels, for each batch size B:
  - ours, MTP on   (EngineCore, text rows in the MTP lane, block `--block`, batched verify; greedy
                   rounds compiled: `engine/lanes/mtp_step.py`)
  - with `--eager-mtp`: ours, MTP on with the eager round (`compile_mtp=False`: mlx-vlm's
                   speculative cache transaction, the round before the compiled one)
  - with `--exact`: ours, MTP on with `--mtp-verify exact` (mlx-vlm's batch-invariant verifier)
  - ours, MTP off  (EngineCore, the same rows in the plain lane: batched prefill, compiled decode
                    step; what the server runs for them)
  - raw mlx-vlm with its MTP drafter: `stream_generate(..., draft_model=load_drafter(kind="mtp"))`
    at B=1, `BatchGenerator(..., draft_model=...)` at B>1
  - raw mlx-vlm without it: `stream_generate` / `BatchGenerator`
Decode tok/s counts only steady decoding (after every row of the batch has its first token).
Round cost = time of one MTP round / time of one plain decode step at the same B (ours).
Acceptance = accepted drafts / drafted tokens. Prompts are `--prompt-tokens` tokens of a text
sample (the model's own tokenizer), distinct per row; greedy; `--max-tokens` new tokens.
Greedy identity: every measured run's tokens, row by row, against the first `ours_plain` run's
(`greedy_identical`; `greedy_differs` names the variants that did not match).

    python benchmarks/bench_mtp.py MODEL_DIR [--batch 1,4,16] [--block 2] [--out results.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import mlx.core as mx

from mlx_relay.bench.machine import library_versions, source_commit
from mlx_relay.bench.tables import rows_markdown
from mlx_relay.config import EngineConfig
from mlx_relay.engine.models.loader import load_model
from mlx_relay.engine.step.core import EngineCore
from mlx_relay.messages.gpu import Finished, Generate, SamplingParams, Speculate, TokenDelta

TEXT = (Path(__file__).resolve().parent.parent / "mlx_relay" / "engine" / "lanes" / "mtp_lane.py").read_text()


def prompts(tokenizer: Any, n: int, length: int) -> list[list[int]]:
    ids = tokenizer.encode(TEXT * 4, add_special_tokens=False)
    return [ids[i * 37: i * 37 + length] for i in range(n)]


def run_ours(loaded: Any, batch: list[list[int]], max_tokens: int, mtp: bool, block: int,
             verify: str = "batched", compile_mtp: bool = True) -> dict[str, Any]:
    config = EngineConfig(model_path=loaded.info.model_path, max_num_seqs=len(batch),
                          prefill_batch_size=min(8, len(batch)), prefill_step_size=2048, seed=0, mtp=mtp,
                          mtp_block_size=block, mtp_max_batch=len(batch) if mtp else 0, mtp_verify=verify,
                          compile_mtp=compile_mtp)
    engine = EngineCore(loaded, config, prefix_cache=True)
    for i, p in enumerate(batch):
        engine.add(i, Generate(f"r{i}", p, SamplingParams(max_tokens=max_tokens, mtp=mtp),
                               speculate=Speculate(block) if mtp else None))
    started: set[int] = set()
    ids: list[list[int]] = [[] for _ in batch]
    tokens = 0
    steady_start = None
    steps = rounds0 = acc0 = dr0 = 0
    while engine.has_work:
        events = engine.step().events
        for sid, ev in events:
            if isinstance(ev, TokenDelta):
                started.add(sid)
                ids[sid].extend(ev.token_ids)
                if steady_start is not None:
                    tokens += len(ev.token_ids)
            elif not isinstance(ev, Finished):
                raise ev
        if steady_start is not None:
            steps += 1
        elif len(started) == len(batch):
            mx.synchronize()
            steady_start = time.perf_counter()
            rounds0 = engine.stats().mtp_rounds
            acc0, dr0 = engine.stats().mtp_accepted, engine.stats().mtp_drafted
    mx.synchronize()
    elapsed = time.perf_counter() - (steady_start or time.perf_counter())
    st = engine.stats()
    engine.close()
    rounds = st.mtp_rounds - rounds0
    drafted = st.mtp_drafted - dr0
    return {"tok_s": tokens / elapsed if elapsed else float("nan"), "tokens": tokens, "seconds": elapsed,
            "steps": steps, "step_ms": 1000 * elapsed / max(steps, 1), "rounds": rounds,
            "acceptance": (st.mtp_accepted - acc0) / drafted if drafted else float("nan"), "ids": ids}


def run_raw(model: Any, processor: Any, drafter: Any, batch: list[list[int]], max_tokens: int,
            block: int, batch_only: bool = False) -> dict[str, Any]:
    """mlx-vlm's own loops, steady decode only (timer starts at the batch's last first token)."""
    from mlx_vlm.generate.ar import BatchGenerator

    if len(batch) == 1 and not batch_only:
        from mlx_vlm import stream_generate

        times = []
        out: list[int] = []
        kw = {"draft_model": drafter, "draft_kind": "mtp", "draft_block_size": block} if drafter is not None else {}
        if drafter is not None:
            drafter.accept_lens = []
        for r in stream_generate(model, processor, processor.tokenizer.decode(batch[0]), max_tokens=max_tokens,
                                 temperature=0.0, **kw):
            times.append((time.perf_counter(), r.generation_tokens))
            if r.token is not None:
                out.append(int(r.token))
        (t0, n0), (t1, n1) = times[0], times[-1]
        acc = drafter.accept_lens if drafter is not None else []
        return {"tok_s": (n1 - n0) / (t1 - t0), "tokens": n1 - n0, "seconds": t1 - t0,
                "acceptance": (sum(acc) / (len(acc) * (block - 1))) if acc else float("nan"), "ids": [out]}
    kw = {"draft_model": drafter, "draft_kind": "mtp", "draft_block_size": block} if drafter is not None else {}
    gen = BatchGenerator(model.language_model, processor, completion_batch_size=len(batch) + 8,
                         prefill_batch_size=min(8, len(batch)), compute_logprobs=False, greedy_sampling=True, **kw)
    embeds = []
    for p in batch:
        e = model.get_input_embeddings(mx.array([p]), None)
        embeds.append({k: v for k, v in e.to_dict().items() if v is not None})
    uids = gen.insert(batch, max_tokens=[max_tokens] * len(batch), prompt_kwargs=embeds)
    started: set[int] = set()
    by_uid: dict[int, list[int]] = {u: [] for u in uids}
    tokens, t0 = 0, None
    while gen.has_work:
        _, responses = gen.next()
        for r in responses:
            if t0 is not None:
                tokens += 1
            by_uid[r.uid].append(int(r.token))
            started.add(r.uid)
        if t0 is None and len(started) == len(batch):
            t0 = time.perf_counter()
    elapsed = time.perf_counter() - (t0 or time.perf_counter())
    gen.close()
    return {"tok_s": tokens / elapsed if elapsed else float("nan"), "tokens": tokens, "seconds": elapsed,
            "ids": [by_uid[u] for u in uids]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", type=Path)
    ap.add_argument("--batch", default="1,4,16")
    ap.add_argument("--block", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--no-raw", action="store_true", help="skip the raw mlx-vlm loops")
    ap.add_argument("--raw-batch-only", action="store_true",
                    help="raw loops through BatchGenerator at B=1 too (stream_generate's detokenizer fails on "
                         "random models that emit ids past the tokenizer's vocabulary)")
    ap.add_argument("--exact", action="store_true",
                    help="also ours with --mtp-verify exact (mlx-vlm's batch-invariant verifier)")
    ap.add_argument("--eager-mtp", action="store_true",
                    help="also ours with the eager MTP round (compile_mtp=False), for before/after")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()

    from mlx_vlm.speculative.drafters import load_drafter

    loaded = load_model(args.model)
    drafter, _ = load_drafter(str(args.model), kind="mtp")
    tok = loaded.processor.tokenizer
    variants = ["ours_mtp", "ours_plain"] + (["ours_mtp_exact"] if args.exact else [])
    variants += ["ours_mtp_eager"] if args.eager_mtp else []
    variants += [] if args.no_raw else ["raw_mtp", "raw_plain"]
    results: dict[str, dict[str, list[dict[str, Any]]]] = {}
    identity: dict[str, list[str]] = {}
    for b in (int(x) for x in args.batch.split(",")):
        batch = prompts(tok, b, args.prompt_tokens)
        per: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
        warm = [[p[:16] for p in batch]]
        for v in variants:  # unmeasured pass: compile this batch's shapes
            run_variant(v, loaded, drafter, warm[0], 8, args.block, args.raw_batch_only)
        for rep in range(args.repeats):
            order = variants if rep % 2 == 0 else variants[::-1]
            for v in order:
                per[v].append(run_variant(v, loaded, drafter, batch, args.max_tokens, args.block, args.raw_batch_only))
        identity[str(b)] = greedy_differs(per, args.max_tokens)
        results[str(b)] = per
        line = ", ".join(f"{v} {statistics.median(r['tok_s'] for r in per[v]):.1f} tok/s" for v in variants)
        print(f"B={b}: {line}", flush=True)
    rows = summarize(results)
    for row in rows:
        differs = identity[str(row["batch"])]
        row["greedy_identical"] = not differs
        row["greedy_differs"] = ",".join(differs) or "-"
    table = rows_markdown(rows)
    print(table)
    if args.out is not None:
        meta = {"date": datetime.now(UTC).isoformat(timespec="seconds"), "model": str(args.model),
                "commit": source_commit(),
                "device": mx.default_device().__repr__(), "platform": platform.platform(), "python": sys.version,
                "versions": library_versions(("mlx", "mlx-lm", "mlx-vlm")),
                "args": {k: str(v) for k, v in vars(args).items()}}
        args.out.write_text(json.dumps({"meta": meta, "rows": rows, "raw": results}, indent=1))
        args.out.with_suffix(".md").write_text(table + "\n")


def run_variant(v: str, loaded: Any, drafter: Any, batch: list[list[int]], max_tokens: int,
                block: int, raw_batch_only: bool = False) -> dict[str, float]:
    if v == "ours_mtp":
        return run_ours(loaded, batch, max_tokens, True, block, "batched")
    if v == "ours_mtp_eager":
        return run_ours(loaded, batch, max_tokens, True, block, "batched", compile_mtp=False)
    if v == "ours_mtp_exact":
        return run_ours(loaded, batch, max_tokens, True, block, "exact")
    if v == "ours_plain":
        return run_ours(loaded, batch, max_tokens, False, block)
    return run_raw(loaded.model, loaded.processor, drafter if v == "raw_mtp" else None, batch, max_tokens, block,
                   raw_batch_only)


def greedy_differs(per: dict[str, list[dict[str, Any]]], max_tokens: int) -> list[str]:
    """The variants whose tokens (any run, any row, first `max_tokens`) differ from the first
    `ours_plain` run's; each run's `ids` are dropped (the JSON keeps the figures only)."""
    ref = [ids[:max_tokens] for ids in per["ours_plain"][0]["ids"]]
    differs = []
    for v, runs in per.items():
        if any([ids[:max_tokens] for ids in r.pop("ids")] != ref for r in runs):
            differs.append(v)
    return differs


def summarize(results: dict[str, dict[str, list[dict[str, Any]]]]) -> list[dict[str, Any]]:
    rows = []
    for b, per in results.items():
        med = {v: statistics.median(r["tok_s"] for r in runs) for v, runs in per.items()}
        mtp, plain = per["ours_mtp"], per["ours_plain"]
        round_ms = statistics.median(r["seconds"] * 1000 / max(r["rounds"], 1) for r in mtp)
        step_ms = statistics.median(r["step_ms"] for r in plain)
        row: dict[str, Any] = {
            "batch": int(b), **{f"{v}_tok_s": round(x, 2) for v, x in med.items()},
            "acceptance": round(statistics.median(r["acceptance"] for r in mtp), 3),
            "round_ms": round(round_ms, 2), "plain_step_ms": round(step_ms, 2),
            "round_cost_in_steps": round(round_ms / step_ms, 3),
            "mtp_speedup": round(med["ours_mtp"] / med["ours_plain"], 3),
        }
        if "ours_mtp_exact" in per:
            exact_ms = statistics.median(r["seconds"] * 1000 / max(r["rounds"], 1) for r in per["ours_mtp_exact"])
            row["exact_round_cost_in_steps"] = round(exact_ms / step_ms, 3)
        if "ours_mtp_eager" in per:
            eager = per["ours_mtp_eager"]
            eager_ms = statistics.median(r["seconds"] * 1000 / max(r["rounds"], 1) for r in eager)
            row["eager_round_cost_in_steps"] = round(eager_ms / step_ms, 3)
            row["eager_mtp_speedup"] = round(med["ours_mtp_eager"] / med["ours_plain"], 3)
            row["eager_acceptance"] = round(statistics.median(r["acceptance"] for r in eager), 3)
        if "raw_mtp" in med:
            row["ours_mtp_vs_raw_mtp"] = round(med["ours_mtp"] / med["raw_mtp"], 3)
            row["ours_plain_vs_raw_plain"] = round(med["ours_plain"] / med["raw_plain"], 3)
            row["raw_mtp_speedup"] = round(med["raw_mtp"] / med["raw_plain"], 3)
            raw_acc = [r.get("acceptance", float("nan")) for r in per["raw_mtp"]]
            row["raw_acceptance"] = round(statistics.median(raw_acc), 3)
        rows.append(row)
    return rows




if __name__ == "__main__":
    main()
