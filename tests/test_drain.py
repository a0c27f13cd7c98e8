"""Graceful drain (SIGTERM): no new requests, the running ones finish within --drain-timeout, the
rest end with a retryable error as their terminal event, then the process exits 0; a second
signal exits at once. In-process (the same server `mlx-relay serve` runs) and as a real process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from mlx_relay.relay import default_config
from mlx_relay.testing.live_server import LiveServer, free_port

# a reply that cannot end on its own for thousands of tokens: a 20,000-character string first
ENDLESS = {"type": "json_schema", "json_schema": {"name": "x", "schema": {
    "type": "object", "properties": {"s": {"type": "string", "minLength": 20000}}, "required": ["s"]}}}
USER = [{"role": "user", "content": "Say hi."}]


def read_stream(url: str, path: str, body: dict[str, Any], out: list[str]) -> None:
    """Collects the stream's data lines (events for Anthropic) until the server ends it."""
    try:
        with httpx.stream("POST", url + path, json=body, timeout=60) as r:
            out.append(f"status {r.status_code}")
            for line in r.iter_lines():
                if line.startswith(("data: ", "event: ")):
                    out.append(line)
    except httpx.HTTPError as exc:
        out.append(f"broken {type(exc).__name__}")


def start_reading(url: str, path: str, body: dict[str, Any]) -> tuple[threading.Thread, list[str]]:
    out: list[str] = []
    thread = threading.Thread(target=read_stream, args=(url, path, body, out), daemon=True)
    thread.start()
    return thread, out


def wait_running(url: str, n: int) -> None:
    deadline = time.monotonic() + 30
    while httpx.get(url + "/health", timeout=10).json().get("running", 0) < n:
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_drain_finishes_what_it_can_and_ends_the_rest(fp32_model: Path) -> None:
    config = default_config(fp32_model, served_model_name="tiny", max_num_seqs=4, warmup=False, drain_timeout_s=1.5)
    with LiveServer(config) as live:
        url = live.url
        endless, endless_out = start_reading(url, "/v1/chat/completions", {
            "messages": USER, "max_tokens": 4000, "stream": True, "response_format": ENDLESS})
        anthropic, anthropic_out = start_reading(url, "/v1/messages", {
            "model": "tiny", "max_tokens": 3000, "stream": True, "messages": USER,
            "tools": [{"name": "f", "input_schema": {"type": "object", "properties": {
                "s": {"type": "string", "minLength": 20000}}, "required": ["s"]}}],
            "tool_choice": {"type": "tool", "name": "f"}})
        wait_running(url, 2)
        short, short_out = start_reading(url, "/v1/chat/completions", {
            "messages": USER, "max_tokens": 60, "stream": True, "temperature": 0, "stop": ["NEVER"]})
        deadline = time.monotonic() + 30
        while len(short_out) < 3:  # it is generating: the drain lets it finish
            assert time.monotonic() < deadline
            time.sleep(0.01)
        live.drain()
        time.sleep(0.2)
        r = httpx.post(url + "/v1/chat/completions", json={"messages": USER, "max_tokens": 2}, timeout=10)
        assert r.status_code == 503 and r.headers["retry-after"], r.text
        health = httpx.get(url + "/health", timeout=10)
        assert health.status_code == 503 and health.json()["status"] == "draining"
        for thread in (endless, anthropic, short):
            thread.join(15)
        assert live.join(15), "the server did not stop after the drain"
    assert short_out[0] == "status 200" and short_out[-1] == "data: [DONE]"
    assert json.loads(short_out[-2][6:])["choices"][0]["finish_reason"] in ("length", "stop")
    assert endless_out[0] == "status 200" and endless_out[-1] == "data: [DONE]", endless_out[-3:]
    assert json.loads(endless_out[-2][6:])["error"]["code"] == "server_shutting_down"
    assert anthropic_out[0] == "status 200" and anthropic_out[-2] == "event: error", anthropic_out[-4:]
    assert json.loads(anthropic_out[-1][6:])["error"]["type"] == "overloaded_error"  # clients retry it


def serve(model: Path, *flags: str) -> tuple[subprocess.Popen[str], str]:
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "mlx_relay.cli", "serve", str(model), "--port", str(port), "--served-model-name",
         "tiny", "--no-warmup", *flags],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.startswith("mlx-relay ready"), line + proc.stderr.read() if proc.stderr else line
    return proc, f"http://127.0.0.1:{port}"


def wait_exit(proc: subprocess.Popen[str], within_s: float) -> int:
    try:
        return proc.wait(within_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError(f"still running {within_s}s after the signal") from None


def test_sigterm_drains_and_exits_0_and_a_second_signal_exits_at_once(fp32_model: Path) -> None:
    endless = {"messages": USER, "max_tokens": 4000, "stream": True, "response_format": ENDLESS}
    proc, url = serve(fp32_model, "--drain-timeout", "1")
    thread, out = start_reading(url, "/v1/chat/completions", endless)
    wait_running(url, 1)
    proc.send_signal(signal.SIGTERM)
    assert wait_exit(proc, 20) == 0
    thread.join(10)
    assert out[-1] == "data: [DONE]" and "server_shutting_down" in out[-2], out[-3:]

    proc, url = serve(fp32_model, "--drain-timeout", "60")
    thread, out = start_reading(url, "/v1/chat/completions", endless)
    wait_running(url, 1)
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    tic = time.monotonic()
    proc.send_signal(signal.SIGINT)
    assert wait_exit(proc, 15) == 1 and time.monotonic() - tic < 15  # not the 60 s drain
    thread.join(10)
