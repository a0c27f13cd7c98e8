"""Speculation by source (issue 33, point 5): tokens/s of one engine decoding the same greedy rows
with no speculation, the MTP head's drafts, drafts copied from the context, and `auto`, beside the
raw mlx-vlm loop.

In one process, on one thread, alternating the variants over `--repeats` passes (ABBA) so machine
drift cancels, for each batch size B (rows in the MTP lane up to B: `mtp_max_batch = B`):
  - `none`     speculation off: the plain lane (batched prefill, the compiled decode step)
  - `mtp`      the checkpoint's head only (block `--block`), where the checkpoint has one
  - `context`  drafts copied from each row's prompt and output only, up to `--max-draft` per round
  - `auto`     both; each row and round verifies the source expected to yield more per second
  - `draft`    a draft model's drafts (`--draft-model`, up to `--max-draft` a round), where one is given
               (and `auto` then has them too, beside the head's and the context's)
  - `raw`      mlx-vlm's own loop without speculation (`stream_generate` at B=1, else
               `BatchGenerator`), unless `--no-raw`
Decode tok/s counts steady decoding only (after every row of the batch has its first token). Each
timed pass runs on a fresh engine, which pays what the MTP lane learns once in a server's life (the
head's acceptance over its rows, each width's round time); `--served-before N` has it serve N untimed
passes of the same rows first, as a running server.
Greedy identity: every run's tokens against the first `none` run's (`greedy_differs`).

With `--profile`, one more pass a method records its steady steps (`gpu/step_recorder.py`): kernels,
their device time and launches a token on a CUDA GPU, and the host's own time by function (cProfile,
which slows the host: read its shares, not its wall time). Issue 45.2: where a lane's step loses the
time around its round against the plain step.

Two kinds of rows (`--scenario`):
  - `agent`: held-out turns of the embedded model's curriculum (`tools/agent_curriculum.py`)
    rendered by the server's renderer, one table row per family: `copy` (repeat a passage of at
    least 120 tokens), `tool` (a call whose arguments repeat the user's values), `json` (an
    object repeating given facts);
  - `copy`: a prompt built so that the model's greedy continuation copies it at `--copy-rate`:
    the model's own greedy continuation C of a seed token is generated first (plain decoding),
    then the prompt is `[seed] + C' + [seed]` where C' is C with runs replaced: per 10 tokens the
    first round(10 * rate) are C's and the rest random regular tokens (an edit: copied lines
    and new ones). The model then writes C again and a copy can be right at most on `rate` of it.
    Meant for models whose next token depends on the last one (the `--mtp-agree` models of
    `benchmarks/gpu/build_random_model.py`, a bigram cycle); the figures say how much of C the
    rows reproduced (`copied_share`).

    python benchmarks/bench_speculation.py MODEL_DIR --scenario agent --batch 1,16 --out results.json
    python benchmarks/bench_speculation.py MODEL_DIR --scenario copy --copy-rate 0.7 --batch 1
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_mtp import run_raw

from mlx_relay.bench.machine import library_versions, source_commit
from mlx_relay.bench.tables import rows_markdown
from mlx_relay.engine.lanes.mtp_lane import MTPLane
from mlx_relay.engine.lanes.plain_lane import PlainLane
from mlx_relay.engine.models.loader import LoadedModel, load_model
from mlx_relay.engine.step.core import EngineCore
from mlx_relay.messages.gpu import Finished, Generate, SamplingParams, TokenDelta
from mlx_relay.testing.engine_driver import Driver

sys.path.insert(0, str(Path(__file__).resolve().parent / "gpu"))
from step_recorder import StepRecorder, show

TOOLS = Path(__file__).resolve().parent.parent / "tools"
METHODS = ("none", "mtp", "context", "auto", "draft")


def _percentile(values: list[float], q: int) -> float:
    """The q-th percentile of `values` (nearest rank; nan for none)."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, len(ordered) * q // 100)], 3)


def run_ours(loaded: LoadedModel, batch: list[list[int]], max_tokens: int, method: str, *, block: int,
             max_draft: int, context_policy: str = "auto", recorder: StepRecorder | None = None,
             draft_model: Path | None = None, served_before: int = 0) -> dict[str, Any]:
    """One pass of `batch` through an EngineCore planned by the TextMTPExecutor for `method`
    (`recorder`: started with the steady steps, stopped after the last; "draft": `draft_model`'s
    drafts, at most `max_draft` a round; `served_before`: the engine first serves that many untimed
    passes of `batch`, as a server that has served traffic: what its lanes learned stays)."""
    # "draft": the draft model's alone; "auto" with a draft model: its drafts beside the head's and the context's
    draft = ({"draft_model": str(draft_model), "draft_tokens": max_draft}
             if draft_model is not None and method in ("draft", "auto") else {})
    d = Driver(loaded, prefix_cache=True, max_num_seqs=len(batch), prefill_batch_size=min(8, len(batch)),
               prefill_step_size=2048, mtp_max_batch=len(batch), mtp_block_size=block, mtp_policy="always",
               speculation="auto" if method == "draft" else method, max_draft_tokens=max_draft,
               context_policy=context_policy, **draft)
    engine: EngineCore = d.engine
    # as the server's warm-up does: every decode shape this batch runs at traced before timing
    if isinstance(plain := engine.lanes["plain"], PlainLane):
        plain.warm_decode(len(batch))
    if isinstance(mtp := engine.lanes.get("mtp"), MTPLane):
        mtp.warm_rounds(len(batch))
    asked = "draft" if method == "draft" else None  # the server's default method for the others
    for k in range(served_before):
        for i, p in enumerate(batch):
            d.add(Generate(f"before{k}-{i}", p, SamplingParams(max_tokens=max_tokens, speculation=asked)))
        while engine.has_work:
            engine.step()
        d.tokens.clear()
        d.finished.clear()
    sids = [d.add(Generate(f"r{i}", p, SamplingParams(max_tokens=max_tokens, speculation=asked)))
            for i, p in enumerate(batch)]
    started: set[int] = set()
    tokens, steady, base = 0, None, engine.stats()
    step_ms: list[float] = []  # each steady step's wall time (where a lane's rounds lose time: its spread)
    while engine.has_work:
        t0 = time.perf_counter()
        out = engine.step()
        if steady is not None:
            step_ms.append((time.perf_counter() - t0) * 1e3)
        for sid, ev in out.events:
            if isinstance(ev, TokenDelta):
                started.add(sid)
                d.tokens.setdefault(sid, []).extend(ev.token_ids)
                if steady is not None:
                    tokens += len(ev.token_ids)
            elif isinstance(ev, Finished):
                d.finished[sid] = ev
            else:
                raise ev
        if steady is None and len(started) == len(batch):
            mx.synchronize()
            steady, base = time.perf_counter(), engine.stats()
            if recorder is not None:
                recorder.start()
    mx.synchronize()
    if recorder is not None and steady is not None:
        recorder.stop()
    elapsed = time.perf_counter() - (steady or time.perf_counter())
    st = engine.stats()
    engine.close()
    fin = list(d.finished.values())
    return {"tok_s": tokens / elapsed if elapsed else float("nan"), "tokens": tokens, "seconds": elapsed,
            "rounds": st.mtp_rounds - base.mtp_rounds, "wide_rounds": st.wide_rounds - base.wide_rounds,
            "pipelined_rounds": st.pipelined_rounds - base.pipelined_rounds, "steps": len(step_ms),
            "step_ms_p50": _percentile(step_ms, 50), "step_ms_p90": _percentile(step_ms, 90),
            "mtp_drafted": sum(f.drafts.mtp.drafted for f in fin),
            "mtp_accepted": sum(f.drafts.mtp.accepted for f in fin),
            "context_drafted": sum(f.drafts.context.drafted for f in fin),
            "context_accepted": sum(f.drafts.context.accepted for f in fin),
            "draft_drafted": sum(f.drafts.draft.drafted for f in fin),
            "draft_accepted": sum(f.drafts.draft.accepted for f in fin),
            "ids": [d.tokens.get(sid, []) for sid in sids]}


# -- rows ---------------------------------------------------------------------------------------
def agent_rows(model: Path, family: str, n: int, seed: int, min_answer: int) -> list[list[int]]:
    """`n` held-out turns of `family` (copy / tool / json) whose reference answer has at least
    `min_answer` tokens, rendered as the server renders them."""
    sys.path.insert(0, str(TOOLS))
    from agent_curriculum import HELD_OUT, Curriculum, Mix

    cur = Curriculum(model, mix=Mix(no_think=0.0), seed=seed)
    rows: list[list[int]] = []
    index = 1000
    while len(rows) < n:
        ex = cur.example(HELD_OUT, index, family, length=1024)  # type: ignore[arg-type]
        index += 1
        answer = ex.answer or ""
        if len(cur.tokenizer.encode(answer, add_special_tokens=False)) >= min_answer:
            rows.append(cur.prompt_ids(ex))
    return rows


def copy_rows(loaded: LoadedModel, n: int, rate: float, length: int, seed: int) -> tuple[list[list[int]], list[
        list[int]]]:
    """Per row: the prompt `[s] + C' + [s]` and C (the model's greedy continuation of s)."""
    rng = random.Random(seed)
    special = min(int(t) for t in loaded.info.eos_token_ids)
    regular = min(special, loaded.info.vocab_size)
    low = min(1000, regular // 2)  # regular tokens above the byte range; small vocabularies too
    seeds = [rng.randrange(low, regular) for _ in range(n)]
    cont = run_ours(loaded, [[s] for s in seeds], length, "none", block=2, max_draft=0)["ids"]
    copied = round(10 * rate)
    prompts = []
    for s, c in zip(seeds, cont, strict=True):
        edited = [t if i % 10 < copied else rng.randrange(low, regular) for i, t in enumerate(c)]
        prompts.append([s, *edited, s])
    return prompts, cont


def copied_share(ids: list[list[int]], cont: list[list[int]]) -> float:
    """Share of the rows' tokens equal to the continuation they were built from, position by position."""
    same = sum(a == b for row, c in zip(ids, cont, strict=True) for a, b in zip(row, c, strict=False))
    return same / max(1, sum(len(r) for r in ids))


# -- the run ------------------------------------------------------------------------------------
def summarize(b: int, per: dict[str, list[dict[str, Any]]]) -> dict[str, Any]:
    med = {v: statistics.median(r["tok_s"] for r in runs) for v, runs in per.items()}
    row: dict[str, Any] = {"batch": b}
    for v, runs in per.items():
        speeds = [r["tok_s"] for r in runs]
        row[f"{v}_tok_s"] = round(med[v], 2)
        row[f"{v}_spread"] = f"{min(speeds):.1f}-{max(speeds):.1f}"
    for v in METHODS:
        if v in per and v != "none":
            row[f"{v}_vs_none"] = round(med[v] / med["none"], 3)
            if "raw" in per:
                row[f"{v}_vs_raw"] = round(med[v] / med["raw"], 3)
            r = per[v][0]
            for source in ("mtp", "context", "draft"):
                drafted = r[f"{source}_drafted"]
                if drafted:
                    row[f"{v}_{source}_acceptance"] = round(r[f"{source}_accepted"] / drafted, 3)
            row[f"{v}_wide_share"] = round(r["wide_rounds"] / max(1, r["rounds"]), 3)
            row[f"{v}_tokens_per_round"] = round(r["tokens"] / max(1, r["rounds"]), 2)
    if "raw" in per:
        row["none_vs_raw"] = round(med["none"] / med["raw"], 3)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", type=Path)
    ap.add_argument("--scenario", choices=("agent", "copy"), default="agent")
    ap.add_argument("--copy-rate", type=float, default=0.7)
    ap.add_argument("--families", default="copy,tool,json",
                    help="agent scenario: the curriculum's families, a table row each")
    ap.add_argument("--batch", default="1")
    ap.add_argument("--block", type=int, default=2)
    ap.add_argument("--max-draft", type=int, default=8,
                    help="context drafts a round at most (and a draft model's, for the draft method)")
    ap.add_argument("--draft-model", type=Path, default=None,
                    help="a draft checkpoint with the model's vocabulary: adds the method \"draft\" (its drafts)")
    ap.add_argument("--context-policy", choices=("auto", "always"), default="auto",
                    help="the engine's --context-policy (always: every proposal verified, no timing)")
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--no-raw", action="store_true")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--served-before", type=int, default=0, metavar="N",
                    help="each timed pass's engine first serves N untimed passes of the same rows (a server "
                         "that has served traffic: the round plans' prior and the widths' times learned)")
    ap.add_argument("--profile", action="store_true",
                    help="then one more pass a method with its steady steps recorded: kernels a token (on a "
                         "CUDA GPU, CUPTI through torch) and the host's functions (cProfile)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()

    loaded = load_model(args.model)
    methods = [m for m in args.methods.split(",") if (m != "mtp" or loaded.info.has_mtp)
               and (m != "draft" or args.draft_model is not None)]
    variants = methods + ([] if args.no_raw else ["raw"])
    rows, raw_runs, identity = [], {}, {}
    cases = [(b, f) for b in (int(x) for x in args.batch.split(","))
             for f in (args.families.split(",") if args.scenario == "agent" else ["copy"])]
    for b, family in cases:
        cont = None
        if args.scenario == "agent":
            min_answer = {"copy": 120, "tool": 0, "json": 12}.get(family, 0)
            batch = agent_rows(args.model, family, b, args.seed, min_answer)
        else:
            batch, cont = copy_rows(loaded, b, args.copy_rate, args.max_tokens, args.seed)
        per: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}

        def run(v: str, rows_: list[list[int]], n: int) -> dict[str, Any]:
            try:
                if v == "raw":
                    return run_raw(loaded.model, loaded.processor, None, rows_, n, args.block, batch_only=True)
                return run_ours(loaded, rows_, n, v, block=args.block, max_draft=args.max_draft,
                                context_policy=args.context_policy, draft_model=args.draft_model,
                                served_before=args.served_before if n == args.max_tokens else 0)
            finally:  # each pass's engine and its buffers gone before the next (36 GB of weights stay)
                gc.collect()
                mx.clear_cache()

        for v in variants:  # unmeasured: compile this batch's shapes
            run(v, batch, 16)
        for rep in range(args.repeats):
            for v in variants if rep % 2 == 0 else variants[::-1]:
                per[v].append(run(v, batch, args.max_tokens))
                last = per[v][-1]
                print(f"B={b} {v}: {last['tok_s']:.1f} tok/s (steps {last['steps']}, p50 {last['step_ms_p50']} ms, "
                      f"p90 {last['step_ms_p90']} ms; rounds {last['rounds']}, pipelined {last['pipelined_rounds']})",
                      flush=True)
        ref = [ids[:args.max_tokens] for ids in per["none"][0]["ids"]]
        identity[f"{b} {family}"] = [v for v, runs in per.items() if any(
            [ids[:args.max_tokens] for ids in r["ids"]] != ref for r in runs)]
        row = summarize(b, per)
        if args.profile:
            row["profile"] = {}
            for v in methods:
                rec = StepRecorder()
                r = run_ours(loaded, batch, args.max_tokens, v, block=args.block, max_draft=args.max_draft,
                             context_policy=args.context_policy, recorder=rec, draft_model=args.draft_model)
                row["profile"][v] = rec.summary(r["tokens"], r["seconds"])
                show(f"B={b} {family} {v}", row["profile"][v])
                gc.collect()
                mx.clear_cache()
        row["rows"] = family if args.scenario == "agent" else f"copy rate {args.copy_rate}"
        row["greedy_identical"] = not identity[f"{b} {family}"]
        if cont is not None:
            row["copied_share"] = round(copied_share(per["none"][0]["ids"], cont), 3)
        rows.append(row)
        for runs in per.values():
            for r in runs:
                r.pop("ids")
        raw_runs[f"{b} {family}"] = per
    table = rows_markdown([{k: v for k, v in r.items() if k != "profile"} for r in rows])
    print(table)
    if args.out is not None:
        meta = {"date": datetime.now(UTC).isoformat(timespec="seconds"), "model": str(args.model),
                "commit": source_commit(), "device": repr(mx.default_device()), "platform": platform.platform(),
                "python": sys.version, "versions": library_versions(("mlx", "mlx-lm", "mlx-vlm")),
                "args": {k: str(v) for k, v in vars(args).items()}, "greedy_differs": identity}
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"meta": meta, "rows": rows, "raw": raw_runs}, indent=1))
        args.out.with_suffix(".md").write_text(table + "\n")


if __name__ == "__main__":
    main()
