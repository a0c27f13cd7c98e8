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
(d) restart: the disk tier (ours with `--prefix-cache-dir`; mlx-vlm with APC_DISK_ENABLED=1 and
             APC_DISK_PATH): a server takes each long system prompt cold, then as a memory hit
             (another user turn); it is stopped once its writes have landed (ours: the cache
             stats say so; mlx-vlm: `--peer-disk-wait` seconds), a fresh server process on the
             same directory answers the cold request's prompt again: the disk hit (ours: after
             the cache stats say its preload of the disk tier into memory is done, so with
             `--prefix-cache-preload` above 0 the "disk hit" is served from memory). Reported:
             cold, memory hit, disk hit, disk/memory and cold/disk, and whether the disk hit's
             greedy reply equals the cold one's (`--restart-tokens` tokens).

A nonce at the very start of each prompt keeps repeats independent. TTFT is measured by the
client: request sent to the first streamed content delta. Each cell is the median of
`--repeats`; warm/cold is the ratio of medians.

    python benchmarks/bench_prefix_cache.py MODEL [--system-tokens 8192] [--no-peer] [--out DIR]
        [--scenarios system,turn10,image,restart]

MODEL `fixture-fp32-16k` is the tiny float32 fixture with a 16,384-token context (random
weights, vision tower and MTP head; `FixtureSpec(variant="fp32", max_position_embeddings=16384)`,
built on first use): the embedded default model's 4,096-token context is too short for an
8,192-token system prompt. On a GPU, name a real checkpoint, e.g.

    python benchmarks/bench_prefix_cache.py ~/models/Qwen3.5-9B-MLX-bf16 --scenarios restart,system \
        --warmup-repeats 1 --ours-variant no-mtp=--no-mtp --out benchmarks/results/prefix-disk-gpu-h200-DATE
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
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


def restart_prompts(tok: Any, n: int, nonces: list[int]) -> list[tuple[str, list[dict[str, Any]]]]:
    out = []
    for nonce in nonces:
        system = f"Session {nonce}. " + filler(tok, n, nonce)
        out.append((system, [{"role": "system", "content": system}, {"role": "user", "content": "List the files."}]))
    return out


def wait_for_writes(s: Server, expected: int, timeout: float = 600.0) -> dict[str, Any]:
    """Ours: poll the cache stats until `expected` files were written and none is under way."""
    deadline = time.monotonic() + timeout
    while True:
        disk = httpx.get(s.url + "/v1/cache/stats", timeout=30).json()["prefix_cache"].get("disk") or {}
        if disk.get("writes", 0) >= expected and disk.get("pending_writes", 1) == 0:
            return dict(disk)
        if time.monotonic() > deadline:
            raise RuntimeError(f"{s.name}: the snapshot writes did not land: {disk}")
        time.sleep(0.2)


def wait_for_preload(s: Server, timeout: float = 600.0) -> dict[str, Any]:
    """Ours: poll the cache stats until the start-up preload of the disk tier has ended (or is off)."""
    deadline = time.monotonic() + timeout
    while True:
        disk = httpx.get(s.url + "/v1/cache/stats", timeout=30).json()["prefix_cache"].get("disk") or {}
        preloaded = disk.get("preloaded") or {"state": "off"}
        if preloaded["state"] in ("done", "off"):
            return dict(preloaded)
        if time.monotonic() > deadline:
            raise RuntimeError(f"{s.name}: the preload did not end: {preloaded}")
        time.sleep(0.1)


def scenario_restart(first: Server, second: Server, tok: Any, args: argparse.Namespace, ours: bool
                     ) -> dict[str, Any]:
    """Cold and memory hit on `first`, disk hit on `second` (a fresh process, same directory)."""
    nonces = [777_000 + r for r in range(-args.warmup_repeats, args.repeats)]
    prompts = restart_prompts(tok, args.system_tokens, nonces)
    cold: list[float] = []
    warm: list[float] = []
    cold_text: list[str] = []
    with first:
        first.chat([{"role": "user", "content": "warm up"}], 2)
        for system, msgs in prompts:
            c, text, _ = first.chat(msgs, args.restart_tokens)
            w, _, _ = first.chat([{"role": "system", "content": system}, {"role": "user", "content": "Run the tests."}],
                                 2)
            cold.append(c)
            warm.append(w)
            cold_text.append(text)
        disk_written = wait_for_writes(first, len(prompts)) if ours else None
        if not ours:
            time.sleep(args.peer_disk_wait)
    disk: list[float] = []
    same: list[bool] = []
    cached: list[int] = []
    with second:
        preloaded = wait_for_preload(second) if ours else None
        second.chat([{"role": "user", "content": "warm up"}], 2)  # a fresh process's first request
        for (_, msgs), text in zip(prompts, cold_text, strict=True):
            d, text2, usage = second.chat(msgs, args.restart_tokens)
            disk.append(d)
            same.append(text2 == text)
            cached.append(int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0))
        stats = httpx.get(second.url + "/v1/cache/stats", timeout=30).json() if ours else {}
    k = args.warmup_repeats  # the first k of each list were unmeasured warm-up passes
    cold, warm, disk, same, cached = cold[k:], warm[k:], disk[k:], same[k:], cached[k:]
    mc, mw, md = statistics.median(cold), statistics.median(warm), statistics.median(disk)
    out = {"cold_ttft_s": round(mc, 4), "memory_hit_ttft_s": round(mw, 4), "disk_hit_ttft_s": round(md, 4),
           "disk_over_memory": round(md / mw, 3), "cold_over_disk": round(mc / md, 2),
           "disk_reply_equals_cold": all(same), "cached_tokens": cached,
           "runs": [[round(c, 4), round(w, 4), round(d, 4)] for c, w, d in zip(cold, warm, disk, strict=True)]}
    if ours:
        out["disk_stats_after_restart"] = stats["prefix_cache"]["disk"]
        out["disk_stats_before_restart"] = disk_written
        out["preload_before_requests"] = preloaded
    print(f"{first.name:12s} restart cold {mc * 1000:9.1f} ms  memory hit {mw * 1000:8.1f} ms  "
          f"disk hit {md * 1000:8.1f} ms  disk/memory {md / mw:.2f}  cold/disk {mc / md:.1f}  "
          f"same reply {all(same)}  cached_tokens {cached[-1] if cached else 0}"
          + (f"  preloaded {preloaded.get('entries', 0)} files in {preloaded.get('seconds', 0.0):.2f} s"
             if preloaded else ""), flush=True)
    return out


def run_server(s: Server, tok: Any, args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {}
    cells: dict[str, list[tuple[float, float, int]]] = {"system": [], "turn10": [], "image": []}
    wanted = set(args.scenarios)
    if not wanted & set(cells):
        return out
    with s:
        s.chat([{"role": "user", "content": "warm up"}], 2)
        for r in range(-args.warmup_repeats, args.repeats):
            nonce = 1000 * (r + 1) if r >= 0 else 999_000 + r
            # r < 0: unmeasured, first use of each shape (JIT-compiled kernels on CUDA)
            row = {}
            if "system" in wanted:
                row["system"] = scenario_system(s, tok, args.system_tokens, nonce)
            if "turn10" in wanted:
                row["turn10"] = scenario_turn10(s, tok, nonce, args.turn_system_tokens, args.tool_tokens,
                                                args.reply_tokens)
            if "image" in wanted and args.image_size:
                row["image"] = scenario_image(s, nonce, args.image_size)
            if r >= 0:
                for name, cell in row.items():
                    cells[name].append(cell)
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
    ap.add_argument("--ours-flags", default="", metavar="FLAGS",
                    help="flags added to ours (every variant), e.g. on a GPU \"--prefill-shapes exact --no-warmup\" "
                         "with --warmup-repeats 1: the fixed-shape warm-up takes minutes per server start")
    ap.add_argument("--ours-variant", action="append", default=None, metavar="NAME=FLAGS",
                    help="also run ours with these extra serve flags, e.g. no-mtp=--no-mtp (repeatable)")
    ap.add_argument("--port", type=int, default=8931)
    ap.add_argument("--scenarios", type=lambda v: v.split(","), default=["system", "turn10", "image", "restart"],
                    help="comma-separated: system, turn10, image, restart (default: all)")
    ap.add_argument("--restart-tokens", type=int, default=8,
                    help="greedy reply tokens compared between the cold request and the disk hit")
    ap.add_argument("--peer-disk-wait", type=float, default=10.0,
                    help="seconds the peer gets to write its disk cache before it is stopped")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    from transformers import AutoTokenizer

    if args.model == "fixture-fp32-16k":
        from mlx_relay.testing.fixtures import FixtureSpec, fixture_path

        args.model = str(fixture_path(FixtureSpec(variant="fp32", max_position_embeddings=16384)))
    tok = AutoTokenizer.from_pretrained(args.model)
    base = [sys.executable, "-m", "mlx_relay.cli", "serve", args.model, "--port", str(args.port),
            "--prefix-min-snapshot-tokens", "64", "--log-level", "warning", *args.ours_flags.split()]
    ours = [("ours", base)]
    for variant in args.ours_variant or []:
        name, _, flags = variant.partition("=")
        ours.append((f"ours-{name}", [*base, *flags.split()]))
    peer = [sys.executable, "-m", "mlx_vlm.server", "--model", args.model, "--port", str(args.port + 1)]
    results: dict[str, Any] = {"model": args.model, "commit": _commit(),
                               "args": {k: str(v) for k, v in vars(args).items()}}
    for name, cmd in ours:
        results[name] = run_server(Server(name, cmd, {}, args.port, args.model), tok, args)
        if "restart" in args.scenarios:
            with tempfile.TemporaryDirectory(prefix="bench-prefix-disk-") as d:
                disk_cmd = [*cmd, "--prefix-cache-dir", d]
                results[name]["restart"] = scenario_restart(
                    Server(name, disk_cmd, {}, args.port, args.model),
                    Server(f"{name}-restarted", disk_cmd, {}, args.port, args.model), tok, args, ours=True)
    if not args.no_peer:
        results["mlx-vlm"] = run_server(Server("mlx-vlm", peer, {"APC_ENABLED": "1", "APC_DISK_ENABLED": "0"},
                                               args.port + 1, args.model), tok, args)
        if "restart" in args.scenarios:
            d = tempfile.mkdtemp(prefix="bench-prefix-disk-peer-")
            env = {"APC_ENABLED": "1", "APC_DISK_ENABLED": "1", "APC_DISK_PATH": d}
            try:
                results["mlx-vlm"]["restart"] = scenario_restart(
                    Server("mlx-vlm", peer, env, args.port + 1, args.model),
                    Server("mlx-vlm-restarted", peer, env, args.port + 1, args.model), tok, args, ours=False)
            finally:
                shutil.rmtree(d, ignore_errors=True)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "prefix_cache.json").write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


if __name__ == "__main__":
    main()
