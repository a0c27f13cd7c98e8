"""First benchmark: what our layers cost over the raw library loop, on one model and machine.

Measures, in one process and alternating round by round so machine drift cancels:
  (a) batch-1 decode tok/s through the raw mlx-vlm loop (`generate_step`, greedy);
  (b) the same through the in-process API (`Relay.stream_chat`);
  (c) the same through HTTP streaming (uvicorn on loopback, SSE);
  (d) HTTP streaming again with the engine in a process of its own (`engine_process="on"`:
      no Python of the server shares the GIL with the thread that steps the engine);
and aggregate completion tok/s at 1, 4 and 16 concurrent HTTP streams. (b), (c) and the
aggregate run the engine as `--engine-process` says (default off: on a thread of the server, so
(c) against (d) is thread against process). Ours decodes plainly like the raw loops unless
`--mtp`. Prints a markdown table with ratios and writes JSON next to it under benchmarks/results/.

    python benchmarks/bench_decode.py [--model DIR] [--max-tokens 128] [--rounds 3] [--engine-process off]
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

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import httpx
import msgspec

from mlx_relay.bench.machine import source_commit
from mlx_relay.chat.types import ChatMessage
from mlx_relay.relay import Relay, default_config
from mlx_relay.testing.fixtures import FixtureSpec, fixture_path
from mlx_relay.testing.live_server import LiveServer

PROMPT = "Write a long story about a robot that learns to paint, with many details."


def decode_rate(times: list[float]) -> float:
    """tok/s over the decode phase: tokens after the first, over the time since the first."""
    if len(times) < 2 or times[-1] <= times[0]:
        return float("nan")
    return (len(times) - 1) / (times[-1] - times[0])


def raw_loops(model_dir: Path, prompt_ids: list[int], max_tokens: int, rounds: int) -> dict[str, list[float]]:
    """The raw library loops on their own thread (MLX work stays on one thread): mlx-vlm's
    single-sequence `generate_step` and its continuous `BatchGenerator` with one row."""
    from mlx_relay.engine.hosting.gpu_thread import GPUThread

    def run() -> dict[str, list[float]]:
        import mlx.core as mx
        import mlx_vlm
        from mlx_vlm.generate.ar import BatchGenerator, generate_step

        model, processor = mlx_vlm.load(str(model_dir))
        rates: dict[str, list[float]] = {"raw": [], "raw_batchgen": []}
        for r in range(rounds + 1):  # the first round warms the kernels
            times = []
            for _token, _ in generate_step(mx.array([prompt_ids]), model, None, None, max_tokens=max_tokens,
                                           temperature=0.0):
                times.append(time.perf_counter())
            gen = BatchGenerator(model.language_model, processor, compute_logprobs=False, greedy_sampling=True)
            emb = model.get_input_embeddings(mx.array([prompt_ids]), None)
            kwargs = {k: v for k, v in emb.to_dict().items() if v is not None}
            gen.insert([prompt_ids], max_tokens=[max_tokens], prompt_kwargs=[kwargs])
            bg_times = []
            while gen.has_work:
                if gen.next()[1]:
                    bg_times.append(time.perf_counter())
            gen.close()
            if r:
                rates["raw"].append(decode_rate(times))
                rates["raw_batchgen"].append(decode_rate(bg_times))
        return rates

    thread = GPUThread("bench-raw", on_fatal=lambda exc: None)
    thread.start()
    try:
        return thread.submit(run).result()
    finally:
        thread.stop(30)


async def in_process(relay: Relay, max_tokens: int) -> tuple[float, int]:
    """Through the same actors as a request (admission, normalizer, GPU executor), counting the
    token ids each event carries."""
    from mlx_relay.messages.gpu import TokenDelta
    from mlx_relay.service import ChatRequest

    assert relay.service is not None
    req = ChatRequest(messages=[ChatMessage(role="user", content=PROMPT)], max_tokens=max_tokens, temperature=0.0)
    first_t, first_n, last_t, total = 0.0, 0, 0.0, 0
    async with relay.generate(req) as events:
        async for ev in events:
            if isinstance(ev, TokenDelta):
                now = time.perf_counter()
                if not total:
                    first_t, first_n = now, len(ev.token_ids)
                last_t = now
                total += len(ev.token_ids)
    return (total - first_n) / (last_t - first_t), total


async def http_stream(client: httpx.AsyncClient, url: str, max_tokens: int) -> tuple[float, int]:
    """SSE through uvicorn. Chunks carry text, not token counts: the rate is (completion tokens
    - 1) over the time from the first content chunk to the finish chunk."""
    body = {"messages": [{"role": "user", "content": PROMPT}], "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    first_t = last_t = 0.0
    tokens = 0
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            elif chunk["choices"]:
                choice = chunk["choices"][0]
                if choice["delta"].get("content") and not first_t:
                    first_t = time.perf_counter()
                if choice["finish_reason"]:
                    last_t = time.perf_counter()
    rate = (tokens - 1) / (last_t - first_t) if last_t > first_t else float("nan")
    return rate, tokens


async def concurrent_http(url: str, n: int, max_tokens: int) -> float:
    async with httpx.AsyncClient(timeout=600) as client:
        tic = time.perf_counter()
        results = await asyncio.gather(*(http_stream(client, url, max_tokens) for _ in range(n)))
        wall = time.perf_counter() - tic
    return sum(tokens for _, tokens in results) / wall


async def http_rounds(url: str, max_tokens: int, rounds: int) -> list[float]:
    """Batch-1 SSE decode rates, one per round, after a warm-up request."""
    async with httpx.AsyncClient(timeout=600) as client:
        await http_stream(client, url, max_tokens)  # warm
        return [(await http_stream(client, url, max_tokens))[0] for _ in range(rounds)]


async def main_async(args: argparse.Namespace) -> dict:
    model = Path(args.model) if args.model else fixture_path(FixtureSpec("bf16", 0))
    ours = dict(args.ours)
    async with Relay.start(model, max_num_seqs=16, mtp=args.mtp, **{"engine_process": args.engine_process, **ours}
                           ) as relay:
        assert relay.service is not None
        from mlx_relay.messages.prompt import Render

        rendered = await relay.service.actors.normalizer.request(Render([ChatMessage(role="user", content=PROMPT)]))
        prompt_ids = rendered.token_ids
        info = relay.info
        await in_process(relay, args.max_tokens)  # warm
        inproc = []
        generated = 0
        for _ in range(args.rounds):
            rate, generated = await in_process(relay, args.max_tokens)
            inproc.append(rate)

    raws = await asyncio.to_thread(raw_loops, model, prompt_ids, args.max_tokens, args.rounds)

    config = default_config(model, served_model_name="bench", max_num_seqs=16, max_queue=64, mtp=args.mtp,
                            **{"engine_process": args.engine_process, **ours})
    with LiveServer(config) as server:
        http = await http_rounds(server.url, args.max_tokens, args.rounds)
        aggregate = {}
        for n in (1, 4, 16):
            await concurrent_http(server.url, n, args.max_tokens)  # warm this batch shape
            aggregate[n] = statistics.median([await concurrent_http(server.url, n, args.max_tokens)
                                              for _ in range(args.rounds)])
    with LiveServer(msgspec.structs.replace(config, engine=msgspec.structs.replace(
            config.engine, engine_process="on"))) as server:
        http_process = await http_rounds(server.url, args.max_tokens, args.rounds)

    samples = {**raws, "inproc": inproc, "http": http, "http_process": http_process}
    med = {k: statistics.median(v) for k, v in samples.items()}
    return {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": f"{platform.system()} {platform.machine()}, {os.cpu_count()} cores",
        "backend": info.backend if info else "?",
        "model": str(model),
        "max_tokens": args.max_tokens,
        "generated_tokens": generated,
        "rounds": args.rounds,
        "mtp": args.mtp,
        "ours_overrides": ours,
        "engine_process": args.engine_process,  # of the inproc and http paths (http_process: on)
        "commit": source_commit(),
        "batch1_decode_tok_s": med,
        "batch1_samples": samples,
        "ratios": {f"{k}_over_raw": v / med["raw"] for k, v in med.items() if k != "raw"},
        "aggregate_http_tok_s": aggregate,
        "versions": versions(),
    }


def versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    def one(name: str) -> str:
        try:
            return version(name)
        except PackageNotFoundError:  # run from a source tree (the GPU kit puts the repo on PYTHONPATH)
            return "source tree"

    return {p: one(p) for p in ("mlx", "mlx-lm", "mlx-vlm", "mlx-relay")}


def to_markdown(r: dict) -> str:
    m = r["batch1_decode_tok_s"]
    lines = [
        f"# Decode overhead, {r['date']} ({r['machine']}, {r['backend']} backend)",
        "",
        f"Model `{Path(r['model']).name}`, {r['generated_tokens']} tokens per request, median of {r['rounds']} rounds; "
        f"commit {r['commit']}; ours {'with' if r['mtp'] else 'without'} MTP, engine process "
        f"{r.get('engine_process', 'off')} (HTTP SSE, engine process: on).",
        "",
        "| path | batch-1 decode tok/s | vs raw loop |",
        "|---|---:|---:|",
        f"| raw mlx-vlm `generate_step` | {m['raw']:.1f} | 1.00 |",
        f"| raw mlx-vlm `BatchGenerator`, 1 row | {m['raw_batchgen']:.1f} "
        f"| {r['ratios']['raw_batchgen_over_raw']:.2f} |",
        f"| in-process API (Relay actors) | {m['inproc']:.1f} | {r['ratios']['inproc_over_raw']:.2f} |",
        f"| HTTP SSE stream | {m['http']:.1f} | {r['ratios']['http_over_raw']:.2f} |",
        f"| HTTP SSE stream, engine process | {m['http_process']:.1f} | {r['ratios']['http_process_over_raw']:.2f} |",
        "",
        "| concurrent HTTP streams | aggregate completion tok/s | vs 1 stream |",
        "|---:|---:|---:|",
    ]
    agg = r["aggregate_http_tok_s"]
    base = agg[1] if 1 in agg else agg["1"]
    for n, v in agg.items():
        lines.append(f"| {n} | {v:.1f} | {v / base:.2f} |")
    lines.append("")
    lines.append("Versions: " + ", ".join(f"{k} {v}" for k, v in r["versions"].items()))
    return "\n".join(lines)


def override(text: str) -> tuple[str, object]:
    """KEY=VALUE, a `build_config` override; the value read as JSON where it parses
    (numbers, true/false, null), else as a string."""
    key, sep, raw = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"{text!r} is not KEY=VALUE")
    try:
        return key, json.loads(raw)
    except json.JSONDecodeError:
        return key, raw


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="checkpoint dir (default: the bf16 tiny fixture)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--mtp", action="store_true",
                        help="our paths with MTP (off by default: the raw loops decode plainly, and the tiny "
                             "fixtures' random heads are never right)")
    parser.add_argument("--ours", type=override, action="append", default=[], metavar="KEY=VALUE",
                        help="a server setting for our paths (build_config's names), e.g. prefill_shapes=exact "
                             "warmup=false: on a GPU the fixed-shape prefill warm-up takes minutes at start")
    parser.add_argument("--engine-process", choices=("auto", "on", "off"), default="off",
                        help="where the engine of the in-process API and HTTP paths runs (default off: a thread "
                             "of the server; the 'engine process' path always runs it in a process of its own)")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    args = parser.parse_args()
    result = asyncio.run(main_async(args))
    md = to_markdown(result)
    print(md)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"decode-{result['backend']}-{result['date'][:10]}"
    (out / f"{stem}.json").write_text(json.dumps(result, indent=2))
    (out / f"{stem}.md").write_text(md + "\n")
    print(f"\nwrote {out / stem}.{{json,md}}", file=sys.stderr)


if __name__ == "__main__":
    main()
