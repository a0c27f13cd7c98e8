"""Batch-1 greedy decode through mlx-lm's tensor parallelism: does `Model.shard(group)` cut ms/token?

mlx-lm's qwen3_5 / qwen3_5_moe `Model.shard` splits the attention, GatedDeltaNet, MLP / MoE and
head projections over the ranks of a group and all-reduces with `mx.distributed.all_sum`. This
loads MODEL with mlx-lm's `load_model` (lazy; its `sanitize` drops an mlx-vlm checkpoint's
`vision_tower.*` and MTP `mtp.*` weights, so mlx-vlm's format loads as is), shards it when run
on more than one rank, and decodes `--max-tokens` tokens greedily at batch 1 after a fixed prompt
of `--prompt-tokens` seeded random ids, through mlx-lm's own `generate_step` (the same code for 1
and N ranks). One unmeasured warm-up round, then `--repeats` rounds; per round the prefill time
(to the first token) and decode ms/token (first to last token over max_tokens - 1). Rank 0 prints
a summary line and writes JSON (`--out`), with the first round's tokens; `--compare` an earlier
JSON (the 1-rank run) prints the ms/token ratio (this / that) and how many leading tokens agree
(a sharded all_sum sums in another order, so long greedy runs may part on near-ties).

    python benchmarks/bench_tensor_parallel.py MODEL [--max-tokens 128] --out tp1.json
    mlx.launch --backend nccl -n 2 -- python3 benchmarks/bench_tensor_parallel.py MODEL \\
        --out tp2.json --compare tp1.json

(`--backend ring` with a hostfile runs the 2-rank case on CPUs, for checking the script.)
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from importlib.metadata import version
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm.generate import generate_step
from mlx_lm.utils import load_model


def greedy(logprobs: mx.array) -> mx.array:
    return mx.argmax(logprobs, axis=-1)


def one_round(model: Any, prompt: mx.array, max_tokens: int) -> tuple[float, float, list[int]]:
    """(prefill seconds, decode ms per token, generated ids) of one greedy generation."""
    tokens: list[int] = []
    tic = first = last = time.perf_counter()
    for token, _ in generate_step(prompt, model, max_tokens=max_tokens, sampler=greedy):
        last = time.perf_counter()  # generate_step yields `y.item()`: the token is on the host
        if not tokens:
            first = last
        tokens.append(int(token))
    return first - tic, (last - first) * 1e3 / max(len(tokens) - 1, 1), tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", type=Path)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0, help="seed of the prompt's random ids")
    parser.add_argument("--out", type=Path, help="JSON results (rank 0)")
    parser.add_argument("--compare", type=Path, help="an earlier run's JSON, e.g. the 1-rank one")
    args = parser.parse_args()

    group = mx.distributed.init()
    rank, size = group.rank(), group.size()

    def barrier() -> None:
        mx.eval(mx.distributed.all_sum(mx.array(1.0), group=group))

    tic = time.perf_counter()
    model, config = load_model(args.model, lazy=True)
    if size > 1:
        model.shard(group)
    mx.eval(model.parameters())
    barrier()
    load_s = time.perf_counter() - tic

    vocab = int(config.get("text_config", config)["vocab_size"])
    rng = random.Random(args.seed)
    prompt = mx.array([rng.randrange(vocab) for _ in range(args.prompt_tokens)], dtype=mx.uint32)

    one_round(model, prompt, args.max_tokens)  # warm-up
    prefill_s: list[float] = []
    ms_per_token: list[float] = []
    tokens: list[int] = []
    for i in range(args.repeats):
        barrier()
        prefill, ms, generated = one_round(model, prompt, args.max_tokens)
        prefill_s.append(prefill)
        ms_per_token.append(ms)
        if i == 0:
            tokens = generated
    peak_gb = mx.get_peak_memory() / 1e9
    print(f"rank {rank}/{size}: peak memory {peak_gb:.3f} GB, load {load_s:.1f}s", flush=True)
    barrier()
    if rank != 0:
        return

    med = statistics.median(ms_per_token)
    print(f"ranks {size}: decode {med:.2f} ms/token (min {min(ms_per_token):.2f}, max {max(ms_per_token):.2f}; "
          f"{args.repeats} x {args.max_tokens} tokens) = {1e3 / med:.1f} tok/s, "
          f"prefill {statistics.median(prefill_s):.3f}s ({args.prompt_tokens} tokens)", flush=True)
    result: dict[str, Any] = {
        "model": str(args.model),
        "ranks": size,
        "device": f"{mx.default_device()} {mx.device_info().get('device_name', '')}".strip(),
        "mlx": mx.__version__,
        "mlx_lm": version("mlx-lm"),
        "max_tokens": args.max_tokens,
        "prompt_tokens": args.prompt_tokens,
        "seed": args.seed,
        "decode_ms_per_token": ms_per_token,
        "prefill_s": prefill_s,
        "peak_memory_gb_rank0": peak_gb,
        "load_s": load_s,
        "tokens": tokens,
    }
    if args.compare is not None:
        other = json.loads(args.compare.read_text())
        ratio = med / statistics.median(other["decode_ms_per_token"])
        agree = next((i for i, (a, b) in enumerate(zip(tokens, other["tokens"], strict=False)) if a != b),
                     min(len(tokens), len(other["tokens"])))
        print(f"vs {args.compare} ({other['ranks']} rank(s)): ms/token ratio {ratio:.3f} (this / that), "
              f"{agree}/{len(tokens)} leading greedy tokens agree", flush=True)
        result["compare"] = {"path": str(args.compare), "ratio": ratio, "agree_leading": agree}
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
