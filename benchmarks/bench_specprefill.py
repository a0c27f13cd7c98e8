"""SpecPrefill: time to first token with and without it, by prompt length and keep fraction.

In one process (the in-process `Relay`, prefix cache off so no request can reuse another's
state), for each prompt length L and each mode -- `off` (every token prefilled) and one
`keep=K` per keep fraction (a draft model of the same tokenizer scores the prompt, the target
prefills only the top K of its chunks, the first and last always) -- the same kind of prompt is
sent `--repeats` times, alternating the order of the modes repeat by repeat (ABBA) so machine
drift is shared. Every prompt is distinct (a nonce line first, then a window of real source text
at an offset of its own) and exactly L tokens long in the target's tokenizer (chat template
included). Before the measured repeats each length is run once per mode, unmeasured: the first
run of a shape JIT-compiles kernels on CUDA.

TTFT is measured by the client: a greedy request with `max_tokens=1` (its reply is the first
token), from the call to its result, so it includes the draft's scoring. The request's
SpecPrefill report gives the scored and kept tokens, and the scorer's counters its GPU time.
Each cell is the median of the repeats; `speedup` is TTFT(off) / TTFT(mode) of the medians.

    python benchmarks/bench_specprefill.py --target MODEL --draft DRAFT [--lengths 8192,16384,32768] \
        [--keeps 0.3,0.2] [--repeats 2] [--out DIR]
    python benchmarks/bench_specprefill.py --target MODEL --no-specprefill   # the `off` path alone

CPU smoke run: `--target $(fixture bf16) --draft models/relay-tiny-coder --lengths 1024,2048`
(both use the fixtures' 1026-token tokenizer).
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
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import anyio
import msgspec

from mlx_relay.bench.machine import library_versions
from mlx_relay.bench.tables import rows_markdown

REPO = Path(__file__).resolve().parent.parent
LIBRARIES = ("mlx", "mlx-lm", "mlx-vlm", "transformers")
SOURCE_DIRS = ("mlx_relay", "tests", "benchmarks", "tools")


def corpus_text() -> str:
    """Real text for the prompts: this repository's Python sources (they travel with the tree)."""
    files = sorted(p for d in SOURCE_DIRS for p in (REPO / d).rglob("*.py"))
    return "\n\n".join(p.read_text(encoding="utf-8", errors="replace") for p in files)


class PromptMaker:
    """Distinct prompts of exactly `n` tokens in the target's tokenizer."""

    def __init__(self, tokenizer: Any, fmt: str) -> None:
        self.tok = tokenizer
        self.fmt = fmt
        self.ids: list[int] = tokenizer.encode(corpus_text(), add_special_tokens=False)

    def _window(self, start: int, n: int) -> list[int]:
        reps = (start + n) // len(self.ids) + 1
        return (self.ids * reps)[start:start + n] if reps > 1 else self.ids[start:start + n]

    def _rendered_len(self, content: str) -> int:
        text = self.tok.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                            tokenize=False)
        return len(self.tok(text, add_special_tokens=False)["input_ids"])

    def make(self, n: int, nonce: int) -> dict[str, Any]:
        """Request kwargs (`messages` plus `prompt` for raw prompts) for prompt `nonce` of `n` tokens."""
        head = f"# Request {nonce}: read this code and answer the question at its end.\n"
        start = (nonce * 7919) % max(len(self.ids) - 1, 1)
        if self.fmt == "raw":
            head_ids = self.tok.encode(head, add_special_tokens=False)
            return {"messages": [], "prompt": (head_ids + self._window(start, n))[:n]}
        tail = "\n\nWhich function above is the most important? Answer in one word."
        text = str(self.tok.decode(self._window(start, n + 64)))
        for shift in range(16):  # a shifted cut when one character adds two tokens at the mark
            content = self._fit(head, text[shift:], tail, n)
            if content is not None:
                return {"messages": [{"role": "user", "content": content}]}
        raise RuntimeError(f"cannot build a chat prompt of exactly {n} tokens")

    def _fit(self, head: str, body: str, tail: str, n: int) -> str | None:
        """The longest cut of `body` whose rendered prompt is `n` tokens (binary search on characters)."""
        lo, hi = 0, len(body)
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self._rendered_len(head + body[:mid] + tail) <= n:
                lo = mid
            else:
                hi = mid - 1
        content = head + body[:lo] + tail
        return content if self._rendered_len(content) == n else None


def mode_names(keeps: list[float], specprefill: bool) -> list[str]:
    return ["off"] + ([f"keep={k:g}" for k in keeps] if specprefill else [])


def mode_kwargs(mode: str, specprefill: bool) -> dict[str, Any]:
    """Per-request SpecPrefill fields for a mode (none at all in the `--no-specprefill` dry mode)."""
    if not specprefill:
        return {}
    if mode == "off":
        return {"specprefill": False}
    return {"specprefill": True, "specprefill_keep": float(mode.removeprefix("keep="))}


async def scoring_seconds(relay: Any) -> float:
    stats = await relay.specprefill_stats() if hasattr(relay, "specprefill_stats") else {}
    return float(stats.get("scoring_seconds", 0.0))


async def one_request(relay: Any, request: dict[str, Any], mode: str, specprefill: bool, mtp: bool) -> dict[str, Any]:
    """TTFT (a 1-token greedy request, client side), the SpecPrefill report, the draft's GPU time."""
    score0 = await scoring_seconds(relay) if specprefill else 0.0
    t0 = time.perf_counter()
    res = await relay.chat(request["messages"], **{k: v for k, v in request.items() if k != "messages"},
                           max_tokens=1, temperature=0.0, mtp=mtp, **mode_kwargs(mode, specprefill))
    ttft = time.perf_counter() - t0
    report = getattr(res, "specprefill", None)
    row: dict[str, Any] = {"ttft_s": ttft, "prompt_tokens": res.usage.prompt_tokens, "first_token": res.token_ids[:1]}
    if report is not None:
        row.update(ran=report.ran, scored_tokens=report.scored_tokens, kept_tokens=report.kept_tokens,
                   keep_fraction=report.keep_fraction, fallback=report.fallback)
    if specprefill:
        row["scoring_s"] = await scoring_seconds(relay) - score0
    return row


async def run_length(relay: Any, maker: PromptMaker, n: int, modes: list[str], args: argparse.Namespace,
                     specprefill: bool) -> dict[str, list[dict[str, Any]]]:
    per: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    nonce = n * 1000
    for _ in range(args.warmup):  # unmeasured: first use of this length's shapes (CUDA JIT)
        for m in modes:
            nonce += 1
            row = await one_request(relay, maker.make(n, nonce), m, specprefill, not args.no_mtp)
            print(f"  warm L={n} {m:9s} {row['ttft_s'] * 1000:9.1f} ms", flush=True)
    for rep in range(args.repeats):
        for m in modes if rep % 2 == 0 else modes[::-1]:
            nonce += 1
            row = await one_request(relay, maker.make(n, nonce), m, specprefill, not args.no_mtp)
            per[m].append(row)
            kept = f" kept {row['kept_tokens']}/{row['scored_tokens']}" if "kept_tokens" in row else ""
            fb = f" fallback: {row['fallback']}" if row.get("fallback") else ""
            print(f"  L={n} rep {rep} {m:9s} {row['ttft_s'] * 1000:9.1f} ms "
                  f"(prompt {row['prompt_tokens']}){kept}{fb}", flush=True)
    return per


def summarize(results: dict[str, dict[str, list[dict[str, Any]]]]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for n, per in results.items():
        off = statistics.median(r["ttft_s"] for r in per["off"])
        for mode, runs in per.items():
            med = statistics.median(r["ttft_s"] for r in runs)
            last = runs[-1]
            row: dict[str, Any] = {
                "length": int(n), "mode": mode, "prompt_tokens": last["prompt_tokens"],
                "ttft_ms": round(med * 1000, 1), "speedup": round(off / med, 3),
                "ran": last.get("ran", ""), "scored": last.get("scored_tokens", ""),
                "kept": last.get("kept_tokens", ""),
                "kept_share": round(last["kept_tokens"] / last["scored_tokens"], 3)
                if last.get("scored_tokens") else "",
                "scoring_ms": round(statistics.median(r["scoring_s"] for r in runs) * 1000, 1)
                if "scoring_s" in last else "",
                "fallback": last.get("fallback") or "",
                "runs_ms": "/".join(f"{r['ttft_s'] * 1000:.0f}" for r in runs),
            }
            rows.append(row)
    return rows




def relay_overrides(args: argparse.Namespace, specprefill: bool, lengths: list[int]) -> dict[str, Any]:
    kw: dict[str, Any] = {"prefix_cache": False, "max_num_seqs": args.max_num_seqs, "warmup": True,
                          "prefill_step_size": args.prefill_step_size}
    if args.no_mtp:
        kw["mtp"] = False
    if specprefill:
        kw.update(specprefill_draft_model=str(args.draft),
                  specprefill_threshold=args.threshold or max(min(lengths) // 2, 1),
                  specprefill_chunk_size=args.chunk_size,
                  specprefill_keep_fraction=args.default_keep)
        if args.query_window:
            kw["specprefill_query_window"] = args.query_window
    return kw


async def amain(args: argparse.Namespace) -> None:
    import mlx.core as mx
    from transformers import AutoTokenizer

    from mlx_relay.relay import Relay

    lengths = [int(x) for x in args.lengths.split(",")]
    keeps = [float(x) for x in args.keeps.split(",")]
    specprefill = args.draft is not None and not args.no_specprefill
    modes = mode_names(keeps, specprefill)
    maker = PromptMaker(AutoTokenizer.from_pretrained(str(args.target)), args.format)
    overrides = relay_overrides(args, specprefill, lengths)
    print(f"target {args.target}, draft {args.draft if specprefill else '(none)'}; modes {modes}; "
          f"{overrides}", flush=True)
    results: dict[str, dict[str, list[dict[str, Any]]]] = {}
    tic = time.perf_counter()
    meta = {"date": datetime.now(UTC).isoformat(timespec="seconds"), "target": str(args.target),
            "draft": str(args.draft) if specprefill else None, "device": repr(mx.default_device()),
            "platform": platform.platform(), "processor": platform.processor(), "cpus": os.cpu_count(),
            "python": sys.version, "versions": library_versions(LIBRARIES), "relay_overrides": overrides,
            "args": {k: str(v) for k, v in vars(args).items()}}
    async with Relay.start(str(args.target), **overrides) as relay:
        meta["ready_s"] = round(time.perf_counter() - tic, 1)
        print(f"ready after {meta['ready_s']}s", flush=True)
        draft_info = relay.info.draft if relay.info is not None else None
        if draft_info is not None:  # which library runs the draft (mlx-vlm for a qwen3_5-family one)
            meta["draft_info"] = msgspec.to_builtins(draft_info)
            print(f"draft: {draft_info.model_type} through {draft_info.library}, "
                  f"{draft_info.attention_layers} attention layers scored, loaded in {draft_info.load_seconds:.1f}s",
                  flush=True)
        for n in lengths:
            results[str(n)] = await run_length(relay, maker, n, modes, args, specprefill)
            print(f"L={n} done after {time.perf_counter() - tic:.1f}s", flush=True)
            meta["wall_s"] = round(time.perf_counter() - tic, 1)
            write_outputs(args.out, meta, results, final=False)  # a run cut short keeps what it measured
        meta["specprefill_stats"] = await relay.specprefill_stats() if hasattr(relay, "specprefill_stats") else {}
    print(write_outputs(args.out, meta, results, final=True))


def write_outputs(out: Path | None, meta: dict[str, Any], results: dict[str, dict[str, list[dict[str, Any]]]],
                  final: bool) -> str:
    """The markdown table; with `out`, also specprefill.json and specprefill.md there."""
    rows = summarize(results)
    table = rows_markdown(rows)
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        body = {"meta": {**meta, "complete": final}, "rows": rows, "raw": results}
        (out / "specprefill.json").write_text(json.dumps(body, indent=1, default=str))
        (out / "specprefill.md").write_text(table + "\n")
    return table


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", type=Path, required=True, help="the served model")
    ap.add_argument("--draft", type=Path, default=None, help="SpecPrefill's draft (same tokenizer); none: off only")
    ap.add_argument("--no-specprefill", action="store_true", help="dry mode: no draft, the `off` path alone")
    ap.add_argument("--lengths", default="8192,16384,32768", help="prompt tokens, comma-separated")
    ap.add_argument("--keeps", default="0.3,0.2", help="keep fractions, one mode each")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=1, help="unmeasured passes per length (every mode once each)")
    ap.add_argument("--threshold", type=int, default=0, help="SpecPrefill threshold (0: half the shortest length)")
    ap.add_argument("--chunk-size", type=int, default=64)
    ap.add_argument("--query-window", type=int, default=0, help="0: the server's default")
    ap.add_argument("--default-keep", type=float, default=0.3, help="the server's keep fraction (requests set theirs)")
    ap.add_argument("--format", choices=("chat", "raw"), default="chat",
                    help="chat: one user message (template included in the length); raw: token ids, no template")
    ap.add_argument("--max-num-seqs", type=int, default=4)
    ap.add_argument("--prefill-step-size", type=int, default=2048)
    ap.add_argument("--no-mtp", action="store_true", help="the engine without MTP (default: as served)")
    ap.add_argument("--out", type=Path, default=None, help="directory for specprefill.json and specprefill.md")
    return ap.parse_args(argv)


def main() -> None:
    anyio.run(amain, parse_args())


if __name__ == "__main__":
    main()
