"""The library lane (mlx-vlm's `BatchGenerator`, what the engine runs with the prefix cache off)
against the plain lane (our batched prefill and compiled decode step) on one workload (issue 44.6):

    python benchmarks/library_lane.py [MODEL] [--rows 16] [--prompt 256] [--tokens 64] [--repeats 3]

In one process, on the calling thread (as the engine's thread), an `EngineCore` per lane: `--rows`
requests of `--prompt` random tokens each, greedy, `--tokens` out, MTP off, all added at once, the
engine stepped until they end. Alternating the lanes `--repeats` times, each run timed whole
(prefill and decode: the first tokens of the last row and every token after), with the outputs
compared (greedy: the lanes must agree where their arithmetic does). Prints each lane's median
seconds, output tokens a second and the ratio.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from pathlib import Path
from typing import Any

from mlx_relay.config import EngineConfig
from mlx_relay.engine.models.loader import load_model
from mlx_relay.engine.step.core import EngineCore
from mlx_relay.messages.gpu import Finished, Generate, SamplingParams, TokenDelta

DEFAULT_MODEL = Path(__file__).resolve().parents[1] / "mlx_relay" / "models" / "relay-tiny-agent"


def run(loaded: Any, *, library: bool, prompts: list[list[int]], tokens: int) -> tuple[float, list[list[int]]]:
    config = EngineConfig(model_path=loaded.info.model_path, max_num_seqs=len(prompts), mtp=False, warmup=False)
    engine = EngineCore(loaded, config, prefix_cache=not library)
    lane = "library" if library else "plain"
    assert lane in engine.lanes, engine.lanes
    out: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    tic = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add(i, Generate(f"r{i}", prompt, SamplingParams(max_tokens=tokens)))
    done = 0
    while done < len(prompts):
        for rid, event in engine.step().events:
            if isinstance(event, TokenDelta):
                out[rid] += event.token_ids
            elif isinstance(event, Finished):
                done += 1
    seconds = time.perf_counter() - tic
    engine.close()
    return seconds, [out[i] for i in range(len(prompts))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?", type=Path, default=DEFAULT_MODEL)
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    loaded = load_model(args.model)
    rng = random.Random(0)
    vocab = loaded.info.vocab_size
    prompts = [[rng.randrange(10, vocab - 1) for _ in range(args.prompt)] for _ in range(args.rows)]
    times: dict[str, list[float]] = {"plain": [], "library": []}
    outputs: dict[str, list[list[int]]] = {}
    run(loaded, library=False, prompts=prompts[:2], tokens=4)  # warm both paths once
    run(loaded, library=True, prompts=prompts[:2], tokens=4)
    for _ in range(args.repeats):
        for lane in ("plain", "library"):
            seconds, outputs[lane] = run(loaded, library=lane == "library", prompts=prompts, tokens=args.tokens)
            times[lane].append(seconds)
    total = sum(len(o) for o in outputs["plain"])
    same = sum(a == b for a, b in zip(outputs["plain"], outputs["library"], strict=True))
    print(f"{args.rows} rows x {args.prompt} prompt tokens, {args.tokens} out, {loaded.info.backend}; "
          f"identical outputs: {same}/{args.rows}")
    for lane, ts in times.items():
        med = statistics.median(ts)
        print(f"  {lane:8s} {med:7.2f} s (runs {', '.join(f'{t:.2f}' for t in ts)})  {total / med:8.1f} tok/s")
    print(f"  plain / library time: {statistics.median(times['plain']) / statistics.median(times['library']):.2f}")


if __name__ == "__main__":
    main()
