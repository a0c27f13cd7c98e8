"""The raw library loop, the floor every server is measured against: mlx-vlm's continuous
`BatchGenerator` on the model's LanguageModel, no server, no HTTP, no detokenization.

For each batch size N it inserts N prompts of `--prompt-tokens` tokens at once and generates
`--max-tokens` each (greedy), after a warm-up of the same shapes, and reports aggregate
completion tok/s (prefill included), steady decode tok/s (all rows decoding) and time to the
first token. Writes JSON to --out.

    python benchmarks/gpu/raw_batch_loop.py MODEL_DIR --batch 1,4,16,64 --out raw.json
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path
from typing import Any


def run_batch(model: Any, processor: Any, n: int, prompt_tokens: int, max_tokens: int, vocab: int,
              seed: int) -> dict[str, float]:
    import mlx.core as mx
    from mlx_vlm.generate.ar import BatchGenerator

    rng = random.Random(seed)
    prompts = [[rng.randrange(100, vocab) for _ in range(prompt_tokens)] for _ in range(n)]
    gen = BatchGenerator(model.language_model, processor, completion_batch_size=n + 8, prefill_batch_size=8,
                         compute_logprobs=False, greedy_sampling=True)
    kwargs = []
    for p in prompts:
        emb = model.get_input_embeddings(mx.array([p]), None)
        kwargs.append({k: v for k, v in emb.to_dict().items() if v is not None})
    tic = time.perf_counter()
    gen.insert(prompts, max_tokens=[max_tokens] * n, prompt_kwargs=kwargs)
    first: float | None = None
    steady_t0: float | None = None
    steady_tokens = 0
    total = 0
    counts = [0] * n
    while gen.has_work:
        _, responses = gen.next()
        now = time.perf_counter()
        if responses and first is None:
            first = now - tic
        for r in responses:
            counts[r.uid % n] += 1
        total += len(responses)
        if len(responses) == n and steady_t0 is None:
            steady_t0 = now
        elif steady_t0 is not None and len(responses) == n:
            steady_tokens += n
            steady_end = now
    wall = time.perf_counter() - tic
    gen.close()
    steady = steady_tokens / (steady_end - steady_t0) if steady_tokens else float("nan")
    return {"batch": n, "aggregate_tok_s": total / wall, "steady_decode_tok_s": steady,
            "ttft_first_s": first or float("nan"), "wall_s": wall, "completion_tokens": total}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", type=Path)
    parser.add_argument("--batch", default="1,4,16,64")
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    import mlx.core as mx
    import mlx_vlm

    from mlx_relay.engine.models.loader import detect_backend

    model, processor = mlx_vlm.load(str(args.model))
    vocab = len(processor.tokenizer)
    results = []
    for n in (int(x) for x in args.batch.split(",")):
        run_batch(model, processor, n, args.prompt_tokens, 8, vocab, args.seed)  # warm this shape
        r = run_batch(model, processor, n, args.prompt_tokens, args.max_tokens, vocab, args.seed + 1)
        r["peak_memory_gb"] = mx.get_peak_memory() / 1e9
        results.append(r)
        print(json.dumps(r), flush=True)
    args.out.write_text(json.dumps({"backend": detect_backend(), "prompt_tokens": args.prompt_tokens,
                                    "max_tokens": args.max_tokens, "results": results}, indent=2))


if __name__ == "__main__":
    main()
