"""What a quantized KV cache (`--kv-bits`, issue 47.2) changes in the model's output, on this CPU:
greedy agreement with the unquantized cache, and the needle prompts at long lengths.

For each model (default: the two trained small models, `models/relay-tiny-coder` and the embedded
`relay-tiny-agent`, both float32) and each of `--bits` (none: unquantized; 8; 4), one in-process `Relay`
(prefix cache and MTP off, one row), greedy raw completions:

1. agreement: `--prompts` prompts of `--prompt-tokens` tokens of held-out CPython source (the needle
   benchmark's haystack: files the models never trained on), up to `--tokens` tokens each; per
   quantized setting, against the unquantized run of the same prompt: the tokens generated before the
   first difference (`prefix`, and its share of the unquantized reply, which may end sooner at an end
   of sequence) and the share of the reply's positions equal (`same`);
2. needle: at each of `--lengths` (within the model's context), `--trials` prompts with the needle
   line of `needle_specprefill.py` planted at depth 0.5: whether the continuation is the needle's
   identifier (`exact`), and whether the quantized run's first token and whole continuation equal the
   unquantized run's.

These models cannot retrieve a needle past their 256-token training windows (`exact` 0 from 512
tokens on in `benchmarks/results/needle-specprefill-cpu-2026-11-21/`), so at 8K and 32K the needle
rows measure only how often the quantized cache changes the continuation, not retrieval. A real
model's retrieval needs a GPU lease.

    python benchmarks/kv_quant_quality.py [--out DIR]
"""

from __future__ import annotations

import argparse
import asyncio
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from needle_specprefill import PromptMaker, held_out_texts, score

from mlx_relay.bench.machine import source_commit
from mlx_relay.bench.tables import rows_markdown
from mlx_relay.engine.speculation.earnings import agreed

REPO = Path(__file__).resolve().parent.parent
MODELS = {"relay-tiny-coder": REPO / "models" / "relay-tiny-coder",
          "relay-tiny-agent": REPO / "mlx_relay" / "models" / "relay-tiny-agent"}


async def run_model(path: Path, bits: int, prompts: list[list[int]], needles: list[Any], tokens: int
                    ) -> dict[str, list[Any]]:
    from mlx_relay.relay import Relay

    overrides: dict[str, Any] = {"prefix_cache": False, "mtp": False, "max_num_seqs": 1, "warmup": False,
                                 "kv_bits": bits or None}
    out: dict[str, list[Any]] = {"agreement": [], "needle": []}
    async with Relay.start(str(path), **overrides) as relay:
        for ids in prompts:
            res = await relay.chat([], prompt=ids, max_tokens=tokens, temperature=0.0, mtp=False)
            out["agreement"].append(list(res.token_ids))
        for p in needles:
            res = await relay.chat([], prompt=p.ids, max_tokens=8, temperature=0.0, mtp=False)
            out["needle"].append({"ids": list(res.token_ids), **score(res.raw_text, p.answer)})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--bits", default="none,8,4")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--lengths", default="2048,8192,32000",
                    help="needle prompt lengths (those within a model's context)")
    ap.add_argument("--trials", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    from transformers import AutoTokenizer

    tic = time.perf_counter()
    texts = held_out_texts()
    bits = [0 if b == "none" else int(b) for b in args.bits.split(",")]  # 0: unquantized
    agreement_rows, needle_rows = [], []
    for name in args.models.split(","):
        path = MODELS.get(name, Path(name))
        config = json.loads((path / "config.json").read_text())
        context = int(config.get("text_config", config).get("max_position_embeddings", 4096))
        maker = PromptMaker(AutoTokenizer.from_pretrained(str(path)), texts, args.seed)
        prompts = [maker.make(args.prompt_tokens, 0.5, 1000 + i).ids for i in range(args.prompts)]
        lengths = [n for n in (int(x) for x in args.lengths.split(",")) if n + 16 <= context]
        needles = [maker.make(n, 0.5, t) for n in lengths for t in range(args.trials)]
        runs = {}
        for b in bits:
            runs[b] = asyncio.run(run_model(path, b, prompts, needles, args.tokens))
            print(f"{name} kv_bits {b or 'none'} done ({time.perf_counter() - tic:.0f}s)", flush=True)
        base = runs[0] if 0 in runs else runs[bits[0]]
        for b in bits:
            if b == 0:
                continue
            if not prompts:
                continue
            pairs = list(zip(runs[b]["agreement"], base["agreement"], strict=True))
            pre = [agreed(x, y) for x, y in pairs]
            # shares of the unquantized reply (which may end before `--tokens` at an end of sequence)
            same = [sum(p == q for p, q in zip(x, y, strict=False)) / max(len(y), 1) for x, y in pairs]
            kept = [p / max(len(y), 1) for p, (_, y) in zip(pre, pairs, strict=True)]
            agreement_rows.append({"model": name, "kv_bits": b, "prompts": len(prompts), "tokens": args.tokens,
                                   "reply_median": statistics.median(len(y) for _, y in pairs),
                                   "prefix_median": statistics.median(pre), "prefix_min": min(pre),
                                   "prefix_share": round(statistics.mean(kept), 3),
                                   "same_share": round(statistics.mean(same), 3)})
        for i, n in enumerate(lengths):
            rows = range(i * args.trials, (i + 1) * args.trials)
            for b in bits:
                got = [runs[b]["needle"][j] for j in rows]
                ref = [base["needle"][j] for j in rows]
                pairs = list(zip(got, ref, strict=True))
                needle_rows.append({"model": name, "length": n, "kv_bits": b or "none", "trials": args.trials,
                                    "exact": sum(g["exact"] for g in got) / len(got),
                                    "first_same": sum(g["ids"][:1] == r["ids"][:1] for g, r in pairs) / len(got),
                                    "all_same": sum(g["ids"] == r["ids"] for g, r in pairs) / len(got)})
    import mlx.core as mx

    meta = {"date": datetime.now(UTC).isoformat(timespec="seconds"), "commit": source_commit(),
            "device": repr(mx.default_device()), "platform": platform.platform(), "cpus": os.cpu_count(),
            "args": {k: str(v) for k, v in vars(args).items()}, "wall_s": round(time.perf_counter() - tic, 1)}
    text = (f"# A quantized KV cache's effect on the output ({meta['date'][:10]}, {meta['device']}, "
            f"commit {meta['commit']})\n\n## Greedy agreement with the unquantized cache\n\n"
            f"{rows_markdown(agreement_rows)}\n\n## Needle prompts (depth 0.5)\n\n{rows_markdown(needle_rows)}\n")
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "kv_quality.md").write_text(text)
        (args.out / "kv_quality.json").write_text(json.dumps({"meta": meta, "agreement": agreement_rows,
                                                              "needle": needle_rows}, indent=1))


if __name__ == "__main__":
    main()
