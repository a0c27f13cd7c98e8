"""Prefix cache: time to first token, cold versus warm, ours next to mlx-vlm's own server with APC.

Three agent-shaped scenarios, each measured on a server process of its own (ours, then
`python -m mlx_vlm.server` with APC_ENABLED=1), on the same checkpoint, in one run:

(a) system:  a long system prompt (default 8,192 tokens) and a short user turn; cold is the first
             request, warm is the same system prompt with another user turn;
(b) turn10:  turn 10 of an agent conversation (system prompt, then per turn a tool-output-sized
             user message and the server's own reply); warm is turn 10 after turns 1-9 were
             played on the server, cold is the same conversation behind a different first token
             (nothing reusable);
(c) image:   the same image asked twice with different questions; cold is the first ask.

A nonce at the very start of each prompt keeps repeats independent. TTFT is measured by the
client: request sent to the first streamed content delta. Each cell is the median of
`--repeats`; warm/cold is the ratio of medians.

    python benchmarks/bench_prefix_cache.py MODEL [--system-tokens 8192] [--no-peer] [--out DIR]
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

WORDS = ("module function return value cache token batch prefix kernel thread actor message stream "
         "schedule decode prefill snapshot budget evict request reply tool result error retry").split()


def filler(tok: Any, n_tokens: int, seed: int) -> str:
    """Text of about `n_tokens` tokens (deterministic per seed)."""
    rng = np.random.default_rng(seed)
    parts: list[str] = []
    text = ""
    while True:
        parts.append(" ".join(rng.choice(WORDS, 12)) + f" ({len(parts)}).")
        if len(parts) % 16 == 0:
            text = " ".join(parts)
            if len(tok.encode(text, add_special_tokens=False)) >= n_tokens:
                break
    ids = tok.encode(text, add_special_tokens=False)[:n_tokens]
    return str(tok.decode(ids))


def png_url(seed: int, size: int) -> str:
    from PIL import Image

    rng = np.random.default_rng(seed)
    img = Image.fromarray(rng.integers(0, 255, (size, size, 3), dtype=np.uint8))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


class Server:
    def __init__(self, name: str, cmd: list[str], env: dict[str, str], port: int, model_field: str) -> None:
        self.name, self.cmd, self.env, self.port, self.model = name, cmd, env, port, model_field
        self.url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> Server:
        log = open(f"/tmp/bench-prefix-{self.name}.log", "wb")
        self.proc = subprocess.Popen(self.cmd, env={**os.environ, **self.env}, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 900
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited; see /tmp/bench-prefix-{self.name}.log")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(1)
        raise RuntimeError(f"{self.name} did not start")

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()

    def chat(self, messages: list[dict[str, Any]], max_tokens: int) -> tuple[float, str, dict[str, Any]]:
        """(TTFT seconds, reply text, usage) of one streamed greedy request."""
        body = {"model": self.model, "messages": messages, "max_tokens": max_tokens, "temperature": 0.0,
                "stream": True, "stream_options": {"include_usage": True}}
        t0 = time.perf_counter()
        ttft = None
        text: list[str] = []
        usage: dict[str, Any] = {}
        with httpx.stream("POST", self.url + "/v1/chat/completions", json=body, timeout=1800) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                usage = chunk.get("usage") or usage
                for ch in chunk.get("choices") or []:
                    delta = ch.get("delta") or {}
                    piece = delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning")
                    if piece:
                        if ttft is None:
                            ttft = time.perf_counter() - t0
                        text.append(piece)
        return (ttft if ttft is not None else time.perf_counter() - t0), "".join(text), usage


def scenario_system(s: Server, tok: Any, n: int, nonce: int) -> tuple[float, float, int]:
    system = f"Session {nonce}. " + filler(tok, n, nonce)
    cold, _, _ = s.chat([{"role": "system", "content": system}, {"role": "user", "content": "List the files."}], 2)
    warm, _, u = s.chat([{"role": "system", "content": system}, {"role": "user", "content": "Run the tests."}], 2)
    return cold, warm, int((u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


def scenario_turn10(s: Server, tok: Any, nonce: int, system_tokens: int, tool_tokens: int,
                    reply_tokens: int) -> tuple[float, float, int]:
    system = filler(tok, system_tokens, 7)
    msgs: list[dict[str, Any]] = [{"role": "system", "content": f"Session {nonce}. " + system}]
    for turn in range(1, 10):
        msgs.append({"role": "user", "content": f"Tool output {turn}: " + filler(tok, tool_tokens, 100 + turn)})
        _, reply, _ = s.chat(msgs, reply_tokens)
        msgs.append({"role": "assistant", "content": reply})
    msgs.append({"role": "user", "content": "Tool output 10: " + filler(tok, tool_tokens, 110)})
    warm, _, u = s.chat(msgs, 2)
    cold_msgs = [{"role": "system", "content": f"Session {nonce + 10**6}. " + system}, *msgs[1:]]
    cold, _, _ = s.chat(cold_msgs, 2)
    return cold, warm, int((u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


def scenario_image(s: Server, nonce: int, size: int) -> tuple[float, float, int]:
    url = png_url(nonce, size)

    def ask(q: str) -> list[dict[str, Any]]:
        return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                             {"type": "text", "text": q}]}]

    cold, _, _ = s.chat(ask("What is in this picture?"), 2)
    warm, _, u = s.chat(ask("Which colours dominate it?"), 2)
    return cold, warm, int((u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


def run_server(s: Server, tok: Any, args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    cells: dict[str, list[tuple[float, float, int]]] = {"system": [], "turn10": [], "image": []}
    s.chat([{"role": "user", "content": "warm up"}], 2)
    for r in range(-args.warmup_repeats, args.repeats):
        if r < 0:  # unmeasured: first use of each shape (JIT-compiled kernels on CUDA)
            scenario_system(s, tok, args.system_tokens, 999_000 + r)
            scenario_turn10(s, tok, 999_000 + r, args.turn_system_tokens, args.tool_tokens, args.reply_tokens)
            if args.image_size:
                scenario_image(s, 999_000 + r, args.image_size)
            continue
        nonce = 1000 * (r + 1)
        cells["system"].append(scenario_system(s, tok, args.system_tokens, nonce))
        cells["turn10"].append(scenario_turn10(s, tok, nonce, args.turn_system_tokens, args.tool_tokens,
                                               args.reply_tokens))
        if args.image_size:
            cells["image"].append(scenario_image(s, nonce, args.image_size))
    for name, rows in cells.items():
        if not rows:
            continue
        cold = statistics.median(c for c, _, _ in rows)
        warm = statistics.median(w for _, w, _ in rows)
        out[name] = {"cold_ttft_s": round(cold, 4), "warm_ttft_s": round(warm, 4),
                     "warm_over_cold": round(warm / cold, 4), "cached_tokens": rows[-1][2],
                     "runs": [[round(c, 4), round(w, 4), k] for c, w, k in rows]}
        print(f"{s.name:12s} {name:7s} cold {cold * 1000:9.1f} ms  warm {warm * 1000:9.1f} ms  "
              f"warm/cold {warm / cold:.3f}  cached_tokens {rows[-1][2]}", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--system-tokens", type=int, default=8192)
    ap.add_argument("--turn-system-tokens", type=int, default=1024)
    ap.add_argument("--tool-tokens", type=int, default=256)
    ap.add_argument("--reply-tokens", type=int, default=32)
    ap.add_argument("--image-size", type=int, default=448, help="0: skip the image scenario")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--warmup-repeats", type=int, default=0, help="unmeasured passes first (1 on CUDA)")
    ap.add_argument("--no-peer", action="store_true", help="skip mlx-vlm's server")
    ap.add_argument("--ours-variant", action="append", default=None, metavar="NAME=FLAGS",
                    help="also run ours with these extra serve flags, e.g. no-mtp=--no-mtp (repeatable)")
    ap.add_argument("--port", type=int, default=8931)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.model)
    servers = [Server("ours", [sys.executable, "-m", "mlx_relay.cli", "serve", args.model, "--port", str(args.port),
                               "--prefix-min-snapshot-tokens", "64", "--log-level", "warning"], {}, args.port,
                      args.model)]
    for variant in args.ours_variant or []:
        name, _, flags = variant.partition("=")
        servers.append(Server(f"ours-{name}", [*servers[0].cmd, *flags.split()], {}, args.port, args.model))
    if not args.no_peer:
        servers.append(Server("mlx-vlm", [sys.executable, "-m", "mlx_vlm.server", "--model", args.model,
                                          "--port", str(args.port + 1)],
                              {"APC_ENABLED": "1", "APC_DISK_ENABLED": "0"}, args.port + 1, args.model))
    results: dict[str, Any] = {"model": args.model, "args": {k: str(v) for k, v in vars(args).items()}}
    for server in servers:
        with server:
            results[server.name] = run_server(server, tok, args)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "prefix_cache.json").write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
