"""One large prompt must not delay anyone else (issue 15, point 2), measured on a server process.

A copy of the fp32 test fixture whose config declares a 1M-token context (so a 10 MB prompt is
not refused by its character count: it is really rendered and tokenized, ~2M tokens, and only
then refused by its token count) is served by `mlx-relay serve`. Measured, in one run:

(a) alone:       time to first token of a small streamed chat request, nothing else running;
(b) large:       the same while two ~10 MB prompts are being prepared (one as a chat request,
                 one through Anthropic's count_tokens, which takes no admission slot);
(c) rejected:    the same while two 12 MB prompts hit a server with the fixture's own 4,096-token
                 context (refused by the character bound before any tokenizing);
(d) memory:      the server's RSS before the rounds of (b) and after each (1 s after it ended),
                 each time after a cache flush, which empties MLX's buffer cache (the small
                 requests' own arrays, not the large prompts' memory); then one 10 MB prompt at
                 a time, three times, with no flush: RSS 1 s after each against before them.

TTFT is client-side (request sent to the first content delta), median and max over `--repeats`;
the figure that matters is the delay over (a): the issue asks for at most 100 ms.

    python benchmarks/bench_prompt_isolation.py [--repeats 20] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import msgspec

from mlx_relay.bench.machine import environment, process_rss_mb
from mlx_relay.bench.tables import rows_markdown
from mlx_relay.testing.fixtures import FixtureSpec, fixture_path
from mlx_relay.testing.serve_process import ServeProcess

SMALL = {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 1, "stream": True, "temperature": 0}


def long_context_copy(dest: Path, context: int) -> Path:
    src = fixture_path(FixtureSpec(variant="fp32", seed=0))
    shutil.copytree(src, dest)
    config = json.loads((dest / "config.json").read_text())
    for section in (config, config.get("text_config", {})):
        if "max_position_embeddings" in section:
            section["max_position_embeddings"] = context
    (dest / "config.json").write_text(json.dumps(config))
    return dest


def serve(model: Path) -> ServeProcess:
    return ServeProcess(str(model), "--served-model-name", "tiny", "--max-num-seqs", "4", "--render-timeout", "120")


def settled_rss(server: ServeProcess) -> float:
    """The server's RSS with MLX's buffer cache emptied (a cache flush): what the small requests
    that run beside the large prompts leave in MLX's cache is not the large prompts' memory."""
    httpx.post(server.url + "/v1/cache/flush", timeout=30)
    time.sleep(0.5)
    return process_rss_mb(server.pid)


def ttft(url: str) -> float:
    tic = time.perf_counter()
    with httpx.stream("POST", url + "/v1/chat/completions", json=SMALL, timeout=300) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and '"content":"' in line and '"content":""' not in line:
                break
            if line == "data: [DONE]":
                break
    return time.perf_counter() - tic


def measure(url: str, repeats: int) -> list[float]:
    out = []
    for _ in range(repeats):
        out.append(ttft(url))
        time.sleep(0.05)
    return out


def big_prompts(url: str, text: str, workdir: Path,
                routes: tuple[str, ...] = ("/v1/chat/completions", "/v1/messages/count_tokens"),
                ) -> tuple[list[threading.Thread], list[int]]:
    """Sends the large prompts with curl, in processes of their own (as other clients would:
    sending 10 MB from this process would hold its GIL and delay its own TTFT measurements)."""
    statuses: list[int] = []
    messages = [{"role": "user", "content": text}]
    chat, count = workdir / "chat.json", workdir / "count.json"
    chat.write_text(json.dumps({"messages": messages}))
    count.write_text(json.dumps({"model": "tiny", "messages": messages}))

    def send(path: str, body: Path) -> None:
        out = subprocess.run(["curl", "-s", "-o", "/dev/null", "-w", "%{http_code}", "-H",
                              "content-type: application/json", "--data-binary", f"@{body}", url + path],
                             capture_output=True, text=True, timeout=300)
        statuses.append(int(out.stdout or 0))

    threads = [threading.Thread(target=send, args=(r, count if "count_tokens" in r else chat)) for r in routes]
    for t in threads:
        t.start()
    return threads, statuses


def row(name: str, times: list[float], alone: list[float] | None) -> dict[str, Any]:
    med = statistics.median(times)
    p95 = sorted(times)[min(len(times) - 1, int(0.95 * len(times)))]
    r: dict[str, Any] = {"case": name, "n": len(times), "ttft_median_ms": round(med * 1000, 1),
                         "ttft_p95_ms": round(p95 * 1000, 1), "ttft_max_ms": round(max(times) * 1000, 1)}
    if alone is not None:
        base = statistics.median(alone)
        r["delay_median_ms"] = round((med - base) * 1000, 1)
        r["delay_p95_ms"] = round((p95 - base) * 1000, 1)
        r["delay_max_ms"] = round((max(times) - base) * 1000, 1)
    return r


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--mb", type=float, default=10.0, help="size of the large prompts")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of two large prompts")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    text = ("the quick brown fox jumps over the lazy dog " * int(args.mb * 1e6 / 44 + 1))[: int(args.mb * 1e6)]
    rows: list[dict[str, Any]] = []
    memory: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as tmp:
        server = serve(long_context_copy(Path(tmp) / "long", 1 << 20))
        try:
            measure(server.url, 3)  # warm
            alone = measure(server.url, args.repeats)
            rows.append(row("alone", alone, None))
            memory["before_mb"] = settled_rss(server)
            statuses: list[int] = []
            for round_ in range(args.rounds):
                tic = time.perf_counter()
                threads, round_statuses = big_prompts(server.url, text, Path(tmp))
                during: list[float] = []
                while any(t.is_alive() for t in threads):
                    during.append(ttft(server.url))
                    time.sleep(0.05)
                large_s = time.perf_counter() - tic
                statuses += round_statuses
                rows.append(row(f"round {round_ + 1}: two {args.mb:g} MB prompts being prepared ({large_s:.1f} s)",
                                during, alone))
                time.sleep(1.0)
                memory[f"after_round_{round_ + 1}_mb"] = settled_rss(server)
            memory["after_large_mb"] = memory[f"after_round_{args.rounds}_mb"]
            memory["large_statuses"] = statuses  # type: ignore[assignment]
            # one large prompt at a time, no flush: the server's RSS 1 s after each has ended
            memory["single_before_mb"] = process_rss_mb(server.pid)
            for i in range(3):
                threads, _ = big_prompts(server.url, text, Path(tmp), routes=("/v1/chat/completions",))
                threads[0].join()
                time.sleep(1.0)
                memory[f"single_{i + 1}_after_mb"] = process_rss_mb(server.pid)
        finally:
            server.stop()
        server = serve(fixture_path(FixtureSpec(variant="fp32", seed=0)))
        try:
            measure(server.url, 3)
            alone = measure(server.url, args.repeats)
            huge = text * 2  # 2 x the size: refused by the character bound of a 4,096-token context
            threads, statuses = big_prompts(server.url, huge, Path(tmp))
            rejected = []
            while any(t.is_alive() for t in threads) or len(rejected) < args.repeats:
                rejected.append(ttft(server.url))
                if len(rejected) >= args.repeats and not any(t.is_alive() for t in threads):
                    break
            rows.append(row(f"two {2 * args.mb:g} MB prompts refused (4,096-token context)", rejected, alone))
            memory["rejected_statuses"] = statuses  # type: ignore[assignment]
        finally:
            server.stop()
    memory["rss_after_vs_before"] = round(memory["after_large_mb"] / memory["before_mb"], 3)
    memory["single_worst_vs_before"] = round(max(memory[f"single_{i + 1}_after_mb"] for i in range(3))
                                             / memory["single_before_mb"], 3)
    env = environment()
    report = {"rows": rows, "memory": memory, "repeats": args.repeats, "environment": msgspec.to_builtins(env)}
    md = (f"commit {env.commit}, {env.date}, {env.machine.processor} ({env.machine.cpu_count} cores)\n\n"
          + rows_markdown(rows) + "\n\n" + rows_markdown([{k: v for k, v in memory.items()}]))
    print(md)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "prompt_isolation.json").write_text(json.dumps(report, indent=2))
        (args.out / "prompt_isolation.md").write_text(md + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
