"""Prefill side by side (issue 43, point 2): our server against the raw mlx-vlm forward, per prompt size.

Two targets, one model, the same prompts:

  ours  a running `mlx-relay serve` (started here, or `--url` of one already running): one streamed
        request with max_tokens 1 per run. Uncached sizes go to `/v1/completions` with N random token
        ids (the same ids the raw run gets; `--ours-api chat` sends N tokens of random words as one
        user message instead). TTFT: from sending the request to the first token event of the
        stream; the token counts are the `usage` the server reports (`prompt_tokens`,
        `prompt_tokens_details.cached_tokens`). The cached case: a request whose system prompt is
        the prefix (the system prompt's end is a snapshot boundary) and a short user message, untimed,
        then the same system prompt with a user message of the suffix's length, timed.
  raw   mlx-vlm's own forward in a process of its own (loaded once): `mlx_vlm.load`, the model's
        prompt cache (`mlx_vlm.models.cache.make_prompt_cache`: its `make_cache()`), and
        `mlx_vlm.generate.ar.generate_step` itself, whose prefill is the library's own chunking
        (`DEFAULT_PREFILL_STEP_SIZE` tokens a chunk, the caches evaluated after each) followed by the
        last position's logits and the first token's sampling (max_tokens 0: nothing decoded after
        it), under `wired_limit` as mlx-vlm's stream_generate runs it. Timed with `mx.synchronize`;
        peak memory is `mx.get_peak_memory()` after `mx.reset_peak_memory()`. The cached case
        prefills the prefix untimed into the same cache, then times the suffix (with the whole
        prompt's rotary positions passed, as mlx-vlm's own prompt cache does).

tok_s = uncached prompt tokens / TTFT. Peak memory of ours: the server's `mlx_relay:gpu_memory_peak_bytes`
(`/metrics`), which counts since the server started: no route resets it over HTTP (the engine's
`ResetPeakMemory` is reached in-process only, `Relay.reset_peak_memory`), so each run records the gauge
before and after, and `peak_exact` says whether the run raised it (the value is then that run's own
peak; otherwise it is an upper bound). The raw peak is per run.

Order: `alternate` runs the targets in waves (ours, raw, ours, raw, ...) per size with both loaded at
once; `phases` runs all of ours with our server up, stops it, then all of raw (two copies of a 38 GB
model do not fit an 80 GB H100 beside their caches); `auto` picks alternate when the device's memory
holds both with room for the largest prompt's caches, else phases. The JSON says which and why.

    python benchmarks/bench_prefill.py MODEL [--url URL] [--sizes 2048,8192,32768,131072]
        [--cached 28672+4096] [--repeats 3] [--targets ours,raw] [--order auto|alternate|phases]
        [--ours-flags "..."] [--out prefill.json]

A dry run on the embedded model (4K context): `--sizes 256,1024 --cached 1024+256 --repeats 2
--ours-flags=--no-warmup`. The GPU job: `JOBS=prefill bash benchmarks/gpu/device_steps.sh start`
(benchmarks/gpu/README.md, "Prefill side by side").
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import random
import re
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import httpx

PEAK_METRIC = "mlx_relay:gpu_memory_peak_bytes"
SERVED_NAME = "bench"
OPENER = "Begin."  # the untimed request's user message in the cached case
CALIBRATION_SYSTEM, CALIBRATION_USER = 320, 32  # content tokens of the calibration requests (the system
# prompt above the server's --prefix-min-snapshot-tokens, 256 by default, so that it leaves a snapshot)
GB = 1e9


# ---------------------------------------------------------------------------------------- cases


@dataclass(frozen=True)
class Case:
    """One prompt shape: `tokens` in all, the first `cached` of them already in the cache."""

    tokens: int
    cached: int = 0

    @property
    def uncached(self) -> int:
        return self.tokens - self.cached

    @property
    def label(self) -> str:
        return f"{self.cached}+{self.uncached}" if self.cached else str(self.tokens)


def parse_cases(sizes: str, cached: str) -> list[Case]:
    """`--sizes 2048,8192` and `--cached 28672+4096[,PREFIX+SUFFIX]` ("" or "none": no cached case)."""
    cases = [Case(int(s)) for s in sizes.split(",") if s.strip()]
    for spec in cached.split(","):
        if spec.strip() and spec.strip() != "none":
            prefix, _, suffix = spec.partition("+")
            if not suffix:
                raise SystemExit(f"--cached wants PREFIX+SUFFIX, got {spec!r}")
            cases.append(Case(int(prefix) + int(suffix), int(prefix)))
    if any(c.uncached <= 0 or c.cached < 0 for c in cases):
        raise SystemExit("every size and suffix must be positive")
    return cases


def run_seed(base: int, case_index: int, repeat: int) -> int:
    """One seed per (case, repeat): ours and raw get the same prompt, every run another one."""
    return base * 1_000_003 + case_index * 1000 + repeat


def prompt_ids(n: int, seed: int, low: int, high: int) -> list[int]:
    """`n` random regular token ids in [low, high), drawn from `seed`."""
    rng = random.Random(seed)
    return [rng.randrange(low, high) for _ in range(n)]


# ---------------------------------------------------------------------------------- the model


def _text_config(model: Path) -> dict[str, Any]:
    config = json.loads((model / "config.json").read_text())
    return {**config, **config.get("text_config", {})}


def model_context(model: Path) -> int:
    """The checkpoint's context length (its text model's `max_position_embeddings`)."""
    return int(_text_config(model).get("max_position_embeddings", 0)) or 1 << 30


def weights_bytes(model: Path) -> int:
    return sum(p.stat().st_size for p in model.glob("*.safetensors"))


def kv_bytes_per_token(model: Path) -> int:
    """Attention keys and values per prompt token (bf16), an estimate for the memory plan."""
    t = _text_config(model)
    layers = int(t.get("num_hidden_layers", 1))
    if "layer_types" in t:
        attention = sum(1 for kind in t["layer_types"] if kind == "full_attention")
    elif t.get("full_attention_interval"):
        attention = layers // int(t["full_attention_interval"])
    else:
        attention = layers
    heads = int(t.get("num_key_value_heads", t.get("num_attention_heads", 1)))
    head_dim = int(t.get("head_dim", int(t.get("hidden_size", 0)) // max(int(t.get("num_attention_heads", 1)), 1)))
    return attention * 2 * heads * head_dim * 2


def regular_vocab(model: Path) -> int:
    """Token ids below this are the tokenizer's regular ones (its added/special tokens come after)."""
    from tokenizers import Tokenizer

    return int(Tokenizer.from_file(str(model / "tokenizer.json")).get_vocab_size(with_added_tokens=False))


def card() -> tuple[str, float | None]:
    """The GPU's name and memory (GB) from nvidia-smi, or ("cpu", None)."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return "cpu", None
    if out.returncode != 0 or not out.stdout.strip():
        return "cpu", None
    name, _, mib = out.stdout.strip().splitlines()[0].rpartition(",")
    try:
        return name.strip(), float(mib) * 2**20 / GB
    except ValueError:
        return out.stdout.strip().splitlines()[0], None


def device_used_gb() -> float | None:
    """Memory in use on the first GPU, every process's (nvidia-smi), None without one."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30)
        return float(out.stdout.strip().splitlines()[0]) * 2**20 / GB if out.returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired, ValueError, IndexError):
        return None


def wait_device_below(gb: float, timeout_s: float) -> float | None:
    """Between phases: until the device's memory in use falls below `gb` (the stopped server's engine
    process gone), or `timeout_s`; what it was last."""
    deadline = time.monotonic() + timeout_s
    used = device_used_gb()
    while used is not None and used >= gb and time.monotonic() < deadline:
        time.sleep(1.0)
        used = device_used_gb()
    return used


def commit() -> str:
    """COMMIT from the environment (a copy of the tree without .git, the GPU machine), else git's."""
    if env := os.environ.get("COMMIT"):
        return env
    try:
        out = subprocess.run(["git", "-C", str(Path(__file__).resolve().parent), "describe", "--always", "--dirty",
                              "--abbrev=7"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return out.stdout.strip() if out.returncode == 0 and out.stdout.strip() else "unknown"


def plan_order(requested: str, targets: Sequence[str], card_name: str, device_gb: float | None, weights: int,
               kv_per_token: int, longest: int) -> tuple[str, str]:
    """alternate or phases, and why. Both loaded at once hold the weights twice, the longest prompt's
    caches about four times (each target's live cache, ours' snapshot of it, raw's chunk temporaries),
    ours' default prefix-cache budget (a fifth of a GPU's memory) and ~16 GB of activations and
    freed buffers between them."""
    if requested != "auto":
        return requested, "asked for"
    if len(targets) < 2:
        return "phases", "one target"
    if card_name == "cpu" or device_gb is None:
        return "alternate", "no GPU: both in host memory"
    need = 2 * weights + 4 * kv_per_token * longest + 0.2 * device_gb * GB + 16 * GB
    verdict = "both fit" if need <= 0.95 * device_gb * GB else "both do not fit"
    return ("alternate" if need <= 0.95 * device_gb * GB else "phases",
            f"{verdict}: {need / GB:.1f} GB estimated at once (weights {weights / GB:.1f} GB twice) "
            f"of {device_gb:.0f} GB")


# ------------------------------------------------------------------------------ random texts


WORD_PARTS = ("ba", "ce", "di", "fo", "gu", "ka", "le", "mi", "no", "pu", "ra", "se", "ti", "vo", "zu", "sha", "tro",
              "pel", "mon", "dar", "kin", "vel", "sor", "ul", "en", "ox")


class TextBuilder:
    """Random words that tokenize to an exact number of tokens (the tokenizer's own count)."""

    def __init__(self, model: Path) -> None:
        from tokenizers import Tokenizer

        self.tok = Tokenizer.from_file(str(model / "tokenizer.json"))
        ones = [p for p in (" a", " i", " o", " e", " the", " an", " to") if self.count(p) == 1]
        if not ones:
            raise SystemExit("the tokenizer has no one-token filler word")
        self.one = ones[0]

    def count(self, text: str) -> int:
        return len(self.tok.encode(text, add_special_tokens=False).ids)

    def text(self, n: int, rng: random.Random, nonce: int) -> str:
        """`n` tokens of random words, the first of them naming `nonce` (distinct runs never share a start)."""
        letters, k = [], nonce + 1
        while k:
            k, d = divmod(k, 26)
            letters.append(chr(97 + d))
        pieces = [" " + "".join(letters)]
        total = self.count(pieces[0])
        while True:
            word = self._word(rng)
            c = self.count(word)
            if total + c > n - 4:
                break
            pieces.append(word)
            total += c
        text = "".join(pieces)
        for _ in range(64):  # pieces add up but a boundary might merge: fix against the whole count
            have = self.count(text)
            if have == n:
                return text
            if have < n:
                text += self.one * (n - have)
            else:
                text = text[: max(len(text) - 4 * (have - n), 0)]
        raise RuntimeError(f"could not build a text of exactly {n} tokens")

    @staticmethod
    def _word(rng: random.Random) -> str:
        word = "".join(rng.choice(WORD_PARTS) for _ in range(rng.randint(1, 3)))
        return " " + word + ("." if rng.random() < 0.08 else "")


# -------------------------------------------------------------------------------------- ours


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class OursServer:
    """`mlx-relay serve MODEL` in a process of its own (its log in `log`), or the server at `url`."""

    def __init__(self, model: Path, flags: list[str], log: Path, url: str | None, ready_timeout_s: float) -> None:
        self.model, self.flags, self.log_path, self.ready_timeout_s = model, flags, log, ready_timeout_s
        self.external = url is not None
        self.url = url or ""
        self.proc: subprocess.Popen[bytes] | None = None
        self.log: IO[bytes] | None = None

    def start(self) -> None:
        if self.external:
            self._wait_ready()
            return
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.log = open(self.log_path, "ab")  # closed in stop()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mlx_relay.cli", "serve", str(self.model), "--host", "127.0.0.1", "--port",
             str(port), "--served-model-name", SERVED_NAME, *self.flags],
            stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self._wait_ready()

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.ready_timeout_s
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"our server exited ({self.proc.returncode}) before ready: see {self.log_path}")
            with contextlib.suppress(httpx.HTTPError, ValueError):
                if httpx.get(self.url + "/health", timeout=5).json().get("status") == "ready":
                    return
            time.sleep(1.0)
        raise RuntimeError(f"our server was not ready in {self.ready_timeout_s:.0f} s")

    def alive(self) -> bool:
        return self.proc is None or self.proc.poll() is None

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.send_signal(signal.SIGTERM)
            end_process(self.proc, 90)
            self.proc = None
        if self.log is not None:
            self.log.close()
            self.log = None


@dataclass
class Measured:
    """One request's figures, as the client saw them and the server reported them."""

    ttft_s: float | None = None
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    error: str | None = None


class OursClient:
    """Streamed requests with max_tokens 1, timed to the first token event; `/metrics`' peak."""

    def __init__(self, url: str, model_name: str | None, timeout_s: float) -> None:
        self.http = httpx.Client(base_url=url, timeout=timeout_s)
        self.model = model_name or self.http.get("/v1/models").json()["data"][0]["id"]

    def close(self) -> None:
        self.http.close()

    def completion(self, ids: list[int]) -> Measured:
        return self._stream("/v1/completions", {"prompt": ids})

    def chat(self, user: str, system: str | None = None) -> Measured:
        messages = ([{"role": "system", "content": system}] if system is not None else [])
        return self._stream("/v1/chat/completions", {"messages": [*messages, {"role": "user", "content": user}]})

    def _stream(self, path: str, fields: dict[str, Any]) -> Measured:
        body = {"model": self.model, **fields, "max_tokens": 1, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}
        out = Measured()
        tic = time.perf_counter()
        try:
            with self.http.stream("POST", path, json=body) as r:
                if r.status_code != 200:
                    r.read()
                    return Measured(error=f"HTTP {r.status_code}: {r.text[:300]}")
                for line in r.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[6:])
                    if "error" in event:
                        out.error = str(event["error"].get("message", event["error"]))
                        continue
                    if out.ttft_s is None and any(_is_token_event(c) for c in event.get("choices", [])):
                        out.ttft_s = time.perf_counter() - tic
                    if usage := event.get("usage"):
                        out.prompt_tokens = usage.get("prompt_tokens")
                        out.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        except httpx.HTTPError as exc:
            out.error = f"{type(exc).__name__}: {exc}"
        if out.ttft_s is None and out.error is None:
            out.error = "the stream ended without a token"
        return out

    def peak_bytes(self) -> int | None:
        """The server's `mlx_relay:gpu_memory_peak_bytes` (since it started), None if it has none."""
        try:
            text = self.http.get("/metrics", timeout=60).text
        except httpx.HTTPError:
            return None
        pattern = "^" + re.escape(PEAK_METRIC) + r"(?:\{[^}]*\})? (\S+)$"
        values = [float(m.group(1)) for m in re.finditer(pattern, text, re.MULTILINE)]
        return int(max(values)) if values else None


def _is_token_event(choice: dict[str, Any]) -> bool:
    """A chunk that carries generated output (a completion's text, a chat delta's content, reasoning or
    tool call) or a finish; a chat stream's opening role chunk is not one."""
    if choice.get("finish_reason") or choice.get("text"):
        return True
    delta = choice.get("delta") or {}
    return bool(delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning")
                or delta.get("tool_calls"))


@dataclass
class ChatShape:
    """What the chat template adds around the contents, measured on the server (`usage`)."""

    user_overhead: int  # prompt tokens of a lone user message minus its content's
    system_overhead: int | None  # the system prompt's snapshot (cached tokens) minus its content's
    pair_overhead: int  # prompt tokens of system + user minus both contents'
    notes: list[str] = field(default_factory=list)


class Ours:
    """Our server as a target: start, warm, calibrate the chat shape, run cases."""

    def __init__(self, args: argparse.Namespace, log: Path, vocab: tuple[int, int], builder: TextBuilder | None,
                 extra_flags: list[str]) -> None:
        self.args, self.vocab, self.builder = args, vocab, builder
        self.server = OursServer(args.model, [*shlex.split(args.ours_flags), *extra_flags], log, args.url,
                                 args.ready_timeout)
        self.client: OursClient | None = None
        self.shape: ChatShape | None = None
        self.nonce = 0

    def start(self, warm_sizes: list[int], cached: bool) -> dict[str, Any]:
        """Start the server and send one untimed prompt of each of `warm_sizes` tokens (so no
        timed run meets a chunk length the device has not run: at --no-warmup a 2,048-token
        chunk after only 4,096-token ones ran its first time 3x slower on an H200)."""
        self.server.start()
        self.client = OursClient(self.server.url, None if self.server.external else SERVED_NAME, self.args.timeout)
        warms = [self.client.completion(prompt_ids(n, -1 - i, *self.vocab)) for i, n in enumerate(warm_sizes)]
        info: dict[str, Any] = {"url": self.server.url, "warm_ttft_s": [_round(w.ttft_s) for w in warms],
                                "warm_error": next((w.error for w in warms if w.error), None)}
        if self.builder is not None and (cached or self.args.ours_api == "chat"):
            self.shape = self.calibrate()
            info["chat_shape"] = {"user_overhead": self.shape.user_overhead,
                                  "system_overhead": self.shape.system_overhead,
                                  "pair_overhead": self.shape.pair_overhead, "notes": self.shape.notes}
        return info

    def stop(self) -> None:
        if self.client is not None:
            self.client.close()
            self.client = None
        self.server.stop()

    def _text(self, n: int, seed: int, part: str) -> str:
        """`n` tokens of words drawn from (seed, part), led by this client's next nonce."""
        assert self.builder is not None
        self.nonce += 1
        return self.builder.text(n, random.Random(f"{seed}:{part}"), self.nonce)

    def calibrate(self) -> ChatShape:
        """Two small chats (a system prompt with a short user message, then with a longer one) and a
        lone user message: the template's tokens around the contents, and where the system
        prompt's snapshot ends."""
        assert self.client is not None
        notes: list[str] = []
        system = self._text(CALIBRATION_SYSTEM, -1, "system")
        self._check(self.client.chat(OPENER, system), "calibration")
        pair = self._check(self.client.chat(self._text(CALIBRATION_USER, -1, "user"), system), "calibration")
        lone = self._check(self.client.chat(self._text(CALIBRATION_USER, -1, "lone")), "calibration")
        system_overhead = None
        if pair.cached_tokens:
            system_overhead = pair.cached_tokens - CALIBRATION_SYSTEM
        else:
            notes.append("the calibration's second chat had no cached tokens: the system prompt left no snapshot")
        return ChatShape(user_overhead=(lone.prompt_tokens or 0) - CALIBRATION_USER, system_overhead=system_overhead,
                         pair_overhead=(pair.prompt_tokens or 0) - CALIBRATION_SYSTEM - CALIBRATION_USER, notes=notes)

    @staticmethod
    def _check(m: Measured, what: str) -> Measured:
        if m.error is not None or m.prompt_tokens is None:
            raise RuntimeError(f"{what} request failed: {m.error or 'no usage reported'}")
        return m

    def run(self, case: Case, seed: int) -> dict[str, Any]:
        if not self.server.alive():  # it died on an earlier run (e.g. out of memory): start it again
            self.stop()
            self.start(min(1024, case.tokens), case.cached > 0)
        assert self.client is not None
        extra: dict[str, Any] = {}
        if case.cached:
            assert self.shape is not None
            system_n = case.cached - (self.shape.system_overhead or 0)
            user_n = case.uncached - (self.shape.pair_overhead - (self.shape.system_overhead or 0))
            system = self._text(system_n, seed, "system")
            first = self.client.chat(OPENER, system)  # untimed: leaves the system prompt's snapshot
            extra["prefix_ttft_s"] = _round(first.ttft_s)
            if first.error is not None:
                return {"error": f"prefix request: {first.error}", **extra}
            before = self.client.peak_bytes()
            m = self.client.chat(self._text(user_n, seed, "user"), system)
        elif self.args.ours_api == "chat":
            assert self.shape is not None
            user = self._text(case.tokens - self.shape.user_overhead, seed, "user")
            before = self.client.peak_bytes()
            m = self.client.chat(user)
        else:
            ids = prompt_ids(case.tokens, seed, *self.vocab)
            before = self.client.peak_bytes()
            m = self.client.completion(ids)
        after = self.client.peak_bytes()
        if m.error is not None:
            return {"error": m.error, **extra}
        assert m.ttft_s is not None
        tokens = m.prompt_tokens if m.prompt_tokens is not None else case.tokens
        cached = m.cached_tokens or 0
        return {"tokens": tokens, "cached_tokens": cached, "ttft_s": m.ttft_s, "tok_s": (tokens - cached) / m.ttft_s,
                "peak_gb": None if after is None else after / GB,
                "peak_exact": after is not None and before is not None and after > before, **extra}


# --------------------------------------------------------------------------------------- raw


class RawWorker:
    """This script with --raw-worker in a process of its own: mlx-vlm loaded once, one JSON line
    per run each way."""

    def __init__(self, args: argparse.Namespace, log: Path, vocab: tuple[int, int]) -> None:
        self.args, self.log_path, self.vocab = args, log, vocab
        self.proc: subprocess.Popen[str] | None = None
        self.log: IO[str] | None = None
        self.info: dict[str, Any] = {}

    def start(self, warm: list[Case]) -> dict[str, Any]:
        cmd = [sys.executable, str(Path(__file__).resolve()), "--raw-worker", str(self.args.model)]
        if self.args.memory_limit_gb is not None:
            cmd += ["--memory-limit-gb", str(self.args.memory_limit_gb)]
        if self.args.cache_limit_gb is not None:
            cmd += ["--cache-limit-gb", str(self.args.cache_limit_gb)]
        self.log = open(self.log_path, "a")  # closed in stop()
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log, text=True,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.info = self._read()
        if "error" in self.info:
            raise RuntimeError(f"the raw worker did not load the model: {self.info['error']}")
        self.info["warm"] = [self.ask(c, -2 - i) for i, c in enumerate(warm)]
        return self.info

    def _read(self) -> dict[str, Any]:
        assert self.proc is not None and self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            code = self.proc.wait()
            return {"error": f"the raw worker exited ({code}): see {self.log_path}"}
        answer: dict[str, Any] = json.loads(line)
        return answer

    def ask(self, case: Case, seed: int) -> dict[str, Any]:
        if self.proc is None or self.proc.poll() is not None:  # it died on an earlier run: load again
            self.stop()
            self.start([])
        assert self.proc is not None and self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"tokens": case.tokens, "cached": case.cached, "seed": seed,
                                          "low": self.vocab[0], "high": self.vocab[1]}) + "\n")
        self.proc.stdin.flush()
        return self._read()

    def run(self, case: Case, seed: int) -> dict[str, Any]:
        return self.ask(case, seed)

    def stop(self) -> None:
        if self.proc is not None:
            with contextlib.suppress(OSError):
                assert self.proc.stdin is not None
                self.proc.stdin.close()
            end_process(self.proc, 60)
            self.proc = None
        if self.log is not None:
            self.log.close()
            self.log = None


def end_process(proc: subprocess.Popen[Any], grace_s: float) -> None:
    """Wait `grace_s` for a process told to end, then kill it."""
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(30)


def raw_worker_main(model: Path, memory_limit_gb: float | None, cache_limit_gb: float | None) -> int:
    """The raw target's process: answers each request line ({"tokens", "cached", "seed", "low",
    "high"}) with one line of figures. Its protocol runs on the stdout it was given; everything the
    libraries print goes to stderr."""
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    def say(obj: dict[str, Any]) -> None:
        proto.write(json.dumps(obj) + "\n")

    try:
        import mlx.core as mx
        import mlx_vlm
        from mlx_vlm.generate.ar import generate_step
        from mlx_vlm.generate.common import DEFAULT_PREFILL_STEP_SIZE, generation_stream, wired_limit
        from mlx_vlm.models.cache import make_prompt_cache

        if memory_limit_gb is not None:
            mx.set_memory_limit(int(memory_limit_gb * 2**30))
        if cache_limit_gb is not None:
            mx.set_cache_limit(int(cache_limit_gb * 2**30))
        tic = time.perf_counter()
        model_obj, _processor = mlx_vlm.load(str(model))
        mx.synchronize()
        say({"load_s": round(time.perf_counter() - tic, 2), "weights_gb": round(mx.get_active_memory() / GB, 3),
             "prefill_step_size": DEFAULT_PREFILL_STEP_SIZE, "mlx_vlm": getattr(mlx_vlm, "__version__", None),
             "device": str(mx.default_device())})
    except Exception as exc:  # report it on the protocol, the parent records it
        say({"error": f"{type(exc).__name__}: {exc}"})
        return 1

    lm = model_obj.language_model

    def prefill(ids: list[int], cache: list[Any], **kwargs: Any) -> None:
        """mlx-vlm's generate_step over `ids` into `cache`: its chunked prefill, then the last
        position's logits and sampled token (max_tokens 0: the generator stops there)."""
        for _ in generate_step(mx.array([ids]), model_obj, None, None, max_tokens=0, temperature=0.0,
                               prompt_cache=cache, **kwargs):
            pass
        mx.synchronize()

    with wired_limit(model_obj, [generation_stream]):
        for line in sys.stdin:
            req = json.loads(line)
            tokens, cached = int(req["tokens"]), int(req["cached"])
            cache: list[Any] = []
            try:
                ids = prompt_ids(tokens, int(req["seed"]), int(req["low"]), int(req["high"]))
                cache = make_prompt_cache(lm)
                kwargs: dict[str, Any] = {}
                if cached:
                    prefill(ids[:cached], cache)  # untimed
                    get_rope_index = getattr(lm, "get_rope_index", None)
                    if callable(get_rope_index):  # the whole prompt's positions, sliced per chunk by the model
                        position_ids, rope_deltas = get_rope_index(mx.array([ids]))
                        mx.eval(position_ids, rope_deltas)
                        kwargs = {"position_ids": position_ids, "rope_deltas": rope_deltas}
                mx.synchronize()
                mx.reset_peak_memory()
                tic = time.perf_counter()
                prefill(ids[cached:], cache, **kwargs)
                ttft = time.perf_counter() - tic
                peak = mx.get_peak_memory()
                say({"tokens": tokens, "cached_tokens": cached, "ttft_s": ttft, "tok_s": (tokens - cached) / ttft,
                     "peak_gb": peak / GB})
            except Exception as exc:  # out of memory and the like: recorded, the next run goes on
                say({"error": f"{type(exc).__name__}: {exc}"[:500]})
            finally:
                cache.clear()  # this run's caches go before the next run's peak is counted
                mx.clear_cache()
    return 0


# ----------------------------------------------------------------------------------- summary


def _round(x: float | None, digits: int = 4) -> float | None:
    return None if x is None or math.isnan(x) else round(x, digits)


def _spread(xs: list[float]) -> dict[str, float | None]:
    if not xs:
        return {"median": None, "min": None, "max": None}
    return {"median": _round(statistics.median(xs)), "min": _round(min(xs)), "max": _round(max(xs))}


def summarize(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (target, tokens, cached_tokens) as asked: the median and min-max of tok_s and ttft_s, the
    largest peak, the failed runs; ours' entries carry the ratio of their median tok/s to raw's."""
    groups: dict[tuple[str, int, int], list[dict[str, Any]]] = {}
    for r in runs:
        groups.setdefault((r["target"], r["case_tokens"], r["case_cached"]), []).append(r)
    out = []
    for (target, tokens, cached), rs in groups.items():
        ok = [r for r in rs if r.get("error") is None]
        peaks = [r["peak_gb"] for r in ok if r.get("peak_gb") is not None]
        out.append({"target": target, "tokens": tokens, "cached_tokens": cached, "runs": len(rs),
                    "errors": len(rs) - len(ok), "tok_s": _spread([r["tok_s"] for r in ok]),
                    "ttft_s": _spread([r["ttft_s"] for r in ok]), "peak_gb": _round(max(peaks)) if peaks else None,
                    "reported_tokens": sorted({(r["tokens"], r["cached_tokens"]) for r in ok})})
    by_key = {(s["target"], s["tokens"], s["cached_tokens"]): s for s in out}
    for s in out:
        raw = by_key.get(("raw", s["tokens"], s["cached_tokens"]))
        if s["target"] == "ours" and raw is not None and s["tok_s"]["median"] and raw["tok_s"]["median"]:
            s["ours_over_raw_tok_s"] = round(s["tok_s"]["median"] / raw["tok_s"]["median"], 3)
    return out


def issue_targets(summary: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Issue 43's targets on one H100, for whichever sizes ran (meaningless off the GPU)."""
    s = {(x["target"], x["tokens"], x["cached_tokens"]): x for x in summary}
    out = []
    if (o := s.get(("ours", 32768, 0))) is not None:
        ratio = o.get("ours_over_raw_tok_s")
        out.append({"target": "32K: >= 8K tok/s, TTFT <= 4 s, >= 5x raw",
                    "met": bool(not o["errors"] and (o["tok_s"]["median"] or 0) >= 8000
                                and (o["ttft_s"]["median"] or math.inf) <= 4 and (ratio or 0) >= 5),
                    "tok_s": o["tok_s"]["median"], "ttft_s": o["ttft_s"]["median"], "ours_over_raw": ratio})
    if (o := s.get(("ours", 8192, 0))) is not None:
        out.append({"target": "8K: >= 8K tok/s", "met": bool(not o["errors"] and (o["tok_s"]["median"] or 0) >= 8000),
                    "tok_s": o["tok_s"]["median"]})
    if (o := s.get(("ours", 131072, 0))) is not None:
        out.append({"target": "128K: no out-of-memory, >= 4K tok/s",
                    "met": bool(not o["errors"] and (o["tok_s"]["median"] or 0) >= 4000),
                    "tok_s": o["tok_s"]["median"], "errors": o["errors"]})
    return out


def markdown(report: dict[str, Any]) -> str:
    def spread(d: dict[str, float | None], fmt: str) -> str:
        if d["median"] is None:
            return "-"
        return f"{d['median']:{fmt}} ({d['min']:{fmt}}-{d['max']:{fmt}})"

    lines = [f"Prefill side by side: {report['model']} on {report['card']} at {report['commit']} "
             f"(order {report['order']}, {report['repeats']} repeats)", "",
             "| tokens | cached | target | tok/s median (min-max) | TTFT s median (min-max) | peak GB | errors "
             "| ours/raw tok/s |", "|---|---|---|---|---|---|---|---|"]
    for s in report["summary"]:
        peak = "-" if s["peak_gb"] is None else f"{s['peak_gb']:.2f}"
        ratio = s.get("ours_over_raw_tok_s")
        lines.append(f"| {s['tokens']} | {s['cached_tokens']} | {s['target']} | {spread(s['tok_s'], '.0f')} | "
                     f"{spread(s['ttft_s'], '.3f')} | {peak} | {s['errors']}/{s['runs']} | "
                     f"{'-' if ratio is None else f'{ratio:.2f}x'} |")
    for t in report["targets"]:
        lines.append(f"- {t['target']}: {'met' if t['met'] else 'NOT met'} "
                     f"({', '.join(f'{k} {v}' for k, v in t.items() if k not in ('target', 'met'))})")
    for skip in report["skipped"]:
        lines.append(f"- skipped {skip['tokens']} ({skip['cached_tokens']} cached): {skip['why']}")
    for note in report["notes"]:
        lines.append(f"- note: {note}")
    return "\n".join(lines)


# -------------------------------------------------------------------------------------- main


def waves(cases: list[Case], repeats: int, targets: list[str], order: str) -> Iterator[tuple[str, int, Case, int]]:
    """(target, case index, case, repeat) in the order the runs go: per case, target after target in each
    repeat (alternate), or every run of one target before the next (phases)."""
    if order == "alternate":
        for i, case in enumerate(cases):
            for r in range(repeats):
                for t in targets:
                    yield t, i, case, r
    else:
        for t in targets:
            for i, case in enumerate(cases):
                for r in range(repeats):
                    yield t, i, case, r


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", type=Path, help="checkpoint directory (the raw target loads it; ours serves it)")
    p.add_argument("--url", default=None, help="an ours server already running (else one is started here)")
    p.add_argument("--sizes", default="2048,8192,32768,131072", help="uncached prompt tokens, comma-separated")
    p.add_argument("--cached", default="28672+4096", help="PREFIX+SUFFIX cases, comma-separated ('none': none)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--targets", default="ours,raw")
    p.add_argument("--order", choices=("auto", "alternate", "phases"), default="auto")
    p.add_argument("--ours-api", choices=("completions", "chat"), default="completions",
                   help="uncached sizes as token ids (/v1/completions) or random words in one user message")
    p.add_argument("--ours-flags", default="", help="extra `mlx-relay serve` flags (one string)")
    p.add_argument("--memory-limit-gb", type=float, default=None,
                   help="MLX memory limit of each target (ours: --memory-limit-gb; raw: mx.set_memory_limit)")
    p.add_argument("--cache-limit-gb", type=float, default=None, help="MLX buffer-cache limit of each target")
    p.add_argument("--warmup-tokens", type=int, default=4096, help="one untimed prompt per target before the runs")
    p.add_argument("--vocab", type=int, default=None, help="token ids below this (default: the tokenizer's regular)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds one request may take")
    p.add_argument("--ready-timeout", type=float, default=3600.0, help="seconds our server may take to get ready")
    p.add_argument("--out", type=Path, default=None, help="the JSON report (a .md beside it, the logs too)")
    p.add_argument("--raw-worker", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.raw_worker:
        return raw_worker_main(args.model, args.memory_limit_gb, args.cache_limit_gb)
    targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    if not targets or set(targets) - {"ours", "raw"}:
        raise SystemExit("--targets takes ours and/or raw")
    context = model_context(args.model)
    notes: list[str] = []
    skipped = []
    cases = []
    for c in parse_cases(args.sizes, args.cached):
        if c.tokens + 1 > context:
            skipped.append({"tokens": c.tokens, "cached_tokens": c.cached,
                            "why": f"{c.tokens} prompt tokens + 1 exceed the model's context of {context}"})
            print(f"skipping {c.label}: {c.tokens} prompt tokens + 1 exceed the model's context of {context}")
        else:
            cases.append(c)
    if not cases:
        raise SystemExit("no size fits the model's context")
    card_name, device_gb = card()
    order, why = plan_order(args.order, targets, card_name, device_gb, weights_bytes(args.model),
                            kv_bytes_per_token(args.model), max(c.tokens for c in cases))
    if order == "phases" and args.url is not None and "raw" in targets and "ours" in targets:
        notes.append("phases with --url: the server at the URL stayed up while raw ran")
    log_dir = args.out.parent if args.out is not None else Path(tempfile.mkdtemp(prefix="bench-prefill-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    stem = args.out.stem if args.out is not None else "prefill"
    high = args.vocab or regular_vocab(args.model)
    vocab = (max(high // 100, 1), high)
    warm_tokens = max(16, min(args.warmup_tokens, max(c.tokens for c in cases), context - 2))
    any_cached = any(c.cached for c in cases)
    builder = TextBuilder(args.model) if "ours" in targets and (any_cached or args.ours_api == "chat") else None
    caps = []
    if args.memory_limit_gb is not None:
        caps += ["--memory-limit-gb", str(args.memory_limit_gb)]
    if args.cache_limit_gb is not None:
        caps += ["--cache-limit-gb", str(args.cache_limit_gb)]
    ours = Ours(args, log_dir / f"{stem}-ours.log", vocab, builder, caps) if "ours" in targets else None
    raw = RawWorker(args, log_dir / f"{stem}-raw.log", vocab) if "raw" in targets else None
    raw_warm = [Case(warm_tokens)] + ([Case(warm_tokens, warm_tokens // 2)] if any_cached else [])
    started: dict[str, dict[str, Any]] = {}
    failed: dict[str, str] = {}
    print(f"order {order} ({why}); cases {', '.join(c.label for c in cases)}; logs in {log_dir}", flush=True)

    def up(target: str) -> bool:
        """The target started (once), or False with why in `failed`."""
        if target in started or target in failed:
            return target in started
        tic = time.perf_counter()
        try:
            if target == "ours":
                assert ours is not None
                # the largest warm prompt, and each smaller uncached case's size (its chunk lengths)
                sizes = sorted({warm_tokens, *(c.tokens for c in cases if not c.cached and c.tokens < warm_tokens)})
                started[target] = ours.start(sizes, any_cached)
            else:
                assert raw is not None
                started[target] = raw.start(raw_warm)
        except Exception as exc:  # recorded on each of its runs; the other target still runs
            failed[target] = f"{type(exc).__name__}: {exc}"
            print(f"{target} did not start: {failed[target]}", flush=True)
            down(target)
            return False
        started[target]["start_s"] = round(time.perf_counter() - tic, 1)
        print(f"{target} up: {json.dumps(started[target])}", flush=True)
        return True

    def down(target: str) -> None:
        if target == "ours" and ours is not None:
            ours.stop()
        if target == "raw" and raw is not None:
            raw.stop()

    runs: list[dict[str, Any]] = []

    def report() -> dict[str, Any]:
        summary = summarize(runs)
        peak_note = ("ours' peak_gb is the server's gpu_memory_peak_bytes since it started (no HTTP route resets "
                     "it); peak_exact: the run raised it, so the value is that run's own")
        return {"commit": commit(), "card": card_name, "device_gb": _round(device_gb, 1), "model": str(args.model),
                "order": order, "order_reason": why, "repeats": args.repeats, "targets_run": targets,
                "ours_api": args.ours_api, "ours_flags": args.ours_flags, "context": context,
                "raw_prefill_step_size": started.get("raw", {}).get("prefill_step_size"), "started": started,
                "failed_to_start": failed, "skipped": skipped, "runs": runs, "summary": summary,
                "targets": issue_targets(summary), "notes": [*notes, *([peak_note] if ours is not None else [])]}

    def save(rep: dict[str, Any]) -> None:  # after every run: a lease cut short keeps what ran
        if args.out is not None:
            args.out.write_text(json.dumps(rep, indent=2))

    try:
        if order == "alternate":
            for t in targets:
                up(t)
        current = None
        for target, i, case, repeat in waves(cases, args.repeats, targets, order):
            if order == "phases" and target != current:
                if current is not None:
                    down(current)
                    if card_name != "cpu" and not (current == "ours" and args.url is not None):
                        used = wait_device_below(weights_bytes(args.model) / 2 / GB, 120)
                        print(f"{current} down: {used} GB in use on the device", flush=True)
                current = target
            runner = ours if target == "ours" else raw
            assert runner is not None
            try:
                result = runner.run(case, run_seed(args.seed, i, repeat)) if up(target) else {
                    "error": f"{target} did not start: {failed[target]}"}
            except Exception as exc:  # a failed run is a result too
                result = {"error": f"{type(exc).__name__}: {exc}"}
            run = {"target": target, "tokens": result.get("tokens", case.tokens),
                   "cached_tokens": result.get("cached_tokens", case.cached), "tok_s": _round(result.get("tok_s"), 1),
                   "ttft_s": _round(result.get("ttft_s")), "peak_gb": _round(result.get("peak_gb"), 3),
                   "repeat": repeat, "case_tokens": case.tokens, "case_cached": case.cached,
                   **{k: v for k, v in result.items() if k in ("peak_exact", "prefix_ttft_s", "error")}}
            if run.get("error") is None and (run["tokens"], run["cached_tokens"]) != (case.tokens, case.cached):
                notes.append(f"{target} {case.label} repeat {repeat}: the server reported {run['tokens']} prompt "
                             f"tokens, {run['cached_tokens']} cached")
            runs.append(run)
            print(json.dumps(run), flush=True)
            save(report())
    finally:
        for t in targets:
            down(t)
    final = report()
    save(final)
    table = markdown(final)
    print(table)
    if args.out is not None:
        args.out.with_suffix(".md").write_text(table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
