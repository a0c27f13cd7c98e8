"""The engine in a process of its own (`--engine-process on`, issue 17.2), on one live server on
the float32 tiny VLM: its greedy tokens are the in-thread engine's, a disconnect frees the row,
the prefix cache (memory and disk tier) works across the pipe, a typed engine error arrives as
its class, and a killed engine process ends its streams with an error, is replaced by a fresh
one, and leaves no process behind (nor does the server when it stops). The wire format's error
mapping is checked for every error class without a server, and a dead GPU thread fails the
commands sent to it."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from prometheus_client.parser import text_string_to_metric_families

from mlx_relay import errors
from mlx_relay.actors.gpu_executor import GPUExecutor
from mlx_relay.engine.hosting.engine_process import EngineProcess
from mlx_relay.engine.hosting.gpu_thread import GPUThread, GPUThreadDied
from mlx_relay.engine.hosting.handle import EngineHandle
from mlx_relay.engine.hosting.wire import (
    ERROR_TYPES,
    EngineFailure,
    WireError,
    command_error,
    error_to_wire,
    event_error,
)
from mlx_relay.messages.gpu import Generate, SamplingParams
from mlx_relay.messages.specprefill import SparsePrefill
from mlx_relay.relay import Relay, default_config
from mlx_relay.testing import local_http
from mlx_relay.testing.live_server import LiveServer

SYSTEM = ("You are a careful coding agent. Follow the repository's conventions, keep changes small, "
          "run the tests before you answer, and explain what you changed and why. ") * 3
TOOLS = [{"type": "function", "function": {"name": "run_tests", "description": "Run the test suite",
                                           "parameters": {"type": "object", "properties": {}}}}]


def alive(pid: int) -> bool:
    """The process exists and is not a zombie waiting to be reaped."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    stat = Path(f"/proc/{pid}/stat")
    if stat.exists():
        try:
            return stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"
        except OSError:  # gone meanwhile
            return False
    return True


def wait_gone(pid: int, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not alive(pid)


def engine(server: LiveServer) -> EngineHandle | None:
    async def handle(relay: Relay) -> EngineHandle | None:
        actor = relay.system.cell("gpu").actor
        assert isinstance(actor, GPUExecutor)
        return actor.engine

    return server.call(handle)


def engine_pid(server: LiveServer) -> int | None:
    handle = engine(server)
    return handle.pid if handle is not None else None


@pytest.fixture(scope="module")
def proc_server(fp32_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """The shared server's configuration (`conftest.server`) with the engine in its own process,
    and the prefix cache's disk tier on."""
    config = default_config(fp32_model, served_model_name="tiny", max_num_seqs=8, max_queue=32, mtp_max_batch=8,
                            mtp_policy="always", engine_process="on", prefix_min_snapshot_tokens=8,
                            prefix_cache_dir=str(tmp_path_factory.mktemp("engine-process-cache")))
    with LiveServer(config) as live:
        yield live
        last = engine(live)
    # the server stopped: its engine process (a fresh one, after the kill test) exited with status 0
    assert isinstance(last, EngineProcess) and last.process is not None and last.process.returncode == 0
    assert last.pid is not None and not alive(last.pid)


def chat(server: LiveServer, messages: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    r = local_http.post(server.url + "/v1/chat/completions", timeout=120,
                   json={"model": "tiny", "messages": messages, "max_tokens": 8, "temperature": 0, **extra})
    assert r.status_code == 200, r.text
    return r.json()


def test_greedy_tokens_equal_the_in_thread_engines(proc_server: LiveServer, server: LiveServer) -> None:
    pid = engine_pid(proc_server)
    assert pid is not None and pid != os.getpid() and alive(pid)
    assert engine_pid(server) is None  # the shared server (CPU, "auto"): the engine on a thread

    async def greedy(relay: Relay) -> list[int]:
        reply = await relay.chat([{"role": "user", "content": "Write a haiku about pipes."}], max_tokens=24,
                                 temperature=0)
        return reply.token_ids

    tokens = proc_server.call(greedy)
    assert len(tokens) == 24 and tokens == server.call(greedy)
    # a Ctrl-C or a service manager's SIGTERM reaches the process group: the server drains on them,
    # and its engine process, which ignores them, still serves it
    os.kill(pid, signal.SIGINT)
    os.kill(pid, signal.SIGTERM)
    assert proc_server.call(greedy) == tokens and engine_pid(proc_server) == pid


def test_a_cancelled_stream_frees_its_row(proc_server: LiveServer) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "go"}], "max_tokens": 4000,
            "temperature": 0.7, "seed": 3, "stream": True}
    with local_http.stream("POST", proc_server.url + "/v1/chat/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and json.loads(line[6:])["choices"][0]["delta"].get("content"):
                break  # tokens are flowing: hang up
    deadline = time.monotonic() + 10
    while local_http.get(proc_server.url + "/health").json()["running"] and time.monotonic() < deadline:
        time.sleep(0.02)
    assert local_http.get(proc_server.url + "/health").json()["running"] == 0

    async def engine_running(relay: Relay) -> int:
        return (await relay.engine_stats()).running

    deadline = time.monotonic() + 10
    while proc_server.call(engine_running) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert proc_server.call(engine_running) == 0  # the row left the engine, in the other process
    assert chat(proc_server, [{"role": "user", "content": "hi"}], max_tokens=2)["usage"]["completion_tokens"] >= 1


def test_the_prefix_cache_and_its_disk_tier_work_across_the_pipe(proc_server: LiveServer) -> None:
    turn1 = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Run the tests"}]
    first = chat(proc_server, turn1, tools=TOOLS)
    assert first["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    turn2 = [*turn1, {"role": "assistant", "content": first["choices"][0]["message"]["content"] or "ok"},
             {"role": "user", "content": "Now fix it"}]
    second = chat(proc_server, turn2, tools=TOOLS)
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # a snapshot held by the engine process

    async def persist(relay: Relay) -> int:
        return (await relay.persist_prefix_cache()).pending

    assert proc_server.call(persist) == 0
    stats = local_http.get(proc_server.url + "/v1/cache/stats").json()
    disk = stats["prefix_cache"]["disk"]
    assert disk["writes"] >= 1 and disk["write_errors"] == 0  # files the engine process wrote itself
    assert len(os.listdir(disk["directory"])) == disk["entries"] >= 1
    assert stats["snapshots"]["held"] >= 1 and stats["snapshots"]["bytes"] > 0  # EngineStats, across the pipe
    # out of memory, back from disk: the engine process checks and loads the file
    assert local_http.post(proc_server.url + "/v1/cache/flush").status_code == 200
    again = chat(proc_server, turn2, tools=TOOLS)
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    assert again["choices"][0]["message"] == second["choices"][0]["message"]
    disk = local_http.get(proc_server.url + "/v1/cache/stats").json()["prefix_cache"]["disk"]
    assert disk["loads"] >= 1 and disk["hits"] >= 1 and sum(disk["rejected"].values()) == 0
    # the engine's counters, asked across the pipe: MLX's memory in the engine process
    metrics = local_http.get(proc_server.url + "/metrics").text
    samples = {s.name: s.value for f in text_string_to_metric_families(metrics)
               for s in f.samples}
    assert samples["mlx_relay:gpu_memory_peak_bytes"] > 0 and samples["mlx_relay:prefix_cache_snapshots"] >= 1


def test_an_engine_error_arrives_as_its_class(proc_server: LiveServer) -> None:
    async def rejected(relay: Relay) -> BaseException | None:
        assert relay.gpu is not None
        # a selection that is not ascending ranges: the engine refuses the row when it joins
        bad = Generate("bad-selection", [1, 2, 3, 4, 5, 6], SamplingParams(max_tokens=4),
                       sparse=SparsePrefill([(3, 6), (0, 2)]))
        async with relay.gpu.stream(bad) as stream:
            try:
                async for _ in stream:
                    pass
            except Exception as exc:
                return exc
        return None

    exc = proc_server.call(rejected)
    assert type(exc) is errors.GenerationFailed and exc.message == "could not start the generation"
    assert chat(proc_server, [{"role": "user", "content": "hi"}], max_tokens=2)["usage"]["completion_tokens"] >= 1


def test_a_killed_engine_process_ends_its_streams_and_is_replaced(proc_server: LiveServer) -> None:
    handle = engine(proc_server)
    assert isinstance(handle, EngineProcess) and handle.pid is not None
    old = handle.pid
    body = {"model": "tiny", "messages": [{"role": "user", "content": "go"}], "max_tokens": 4000,
            "temperature": 0.7, "seed": 5, "stream": True}
    frames: list[str] = []
    with local_http.stream("POST", proc_server.url + "/v1/chat/completions", json=body, timeout=60) as r:
        killed = False
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            frames.append(line[6:])
            if not killed and line != "data: [DONE]" and json.loads(line[6:]).get("choices", [{}])[0].get(
                    "delta", {}).get("content"):
                os.kill(old, signal.SIGKILL)
                killed = True
    assert killed and frames[-1] == "[DONE]"
    error = json.loads(frames[-2])["error"]
    assert error["type"] == "server_error"  # the stream ended with an error, not a finish
    assert wait_gone(old, 10) and handle.process is not None and handle.process.returncode == -signal.SIGKILL
    # the supervisor restarted the GPUExecutor, which started a fresh engine process
    assert chat(proc_server, [{"role": "user", "content": "hi"}], max_tokens=2)["usage"]["completion_tokens"] >= 1
    new = engine_pid(proc_server)
    assert new is not None and new != old and alive(new)
    deadline = time.monotonic() + 10
    while local_http.get(proc_server.url + "/health").status_code != 200 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert local_http.get(proc_server.url + "/health").json()["status"] == "ready"


@pytest.mark.parametrize("which", ["proc_server", "server"])
def test_the_engines_peak_memory_count_starts_over(which: str, request: pytest.FixtureRequest) -> None:
    """A command added to the engine protocol (`ResetPeakMemory`) reaches the engine in its process
    and on its thread alike, and answers across the pipe."""
    live: LiveServer = request.getfixturevalue(which)

    async def reset(relay: Relay) -> tuple[int, int, int, int]:
        before = (await relay.engine_stats()).peak_memory_bytes
        peak = await relay.reset_peak_memory()
        after = (await relay.engine_stats()).peak_memory_bytes
        await relay.chat([{"role": "user", "content": "count"}], max_tokens=4, temperature=0)
        return before, peak, after, (await relay.engine_stats()).peak_memory_bytes

    before, peak, after, later = live.call(reset)
    assert 0 < before <= peak and after <= peak and later >= after and later > 0


@pytest.mark.parametrize("exc", [
    errors.InvalidRequest("bad", param="messages"),
    errors.ContextLengthExceeded("long", param="messages"),
    errors.Overloaded("busy", retry_after_s=3),
    errors.ServerShuttingDown("draining", retry_after_s=7),
    errors.ModelNotFound("no such model", model="gpt-x", param="model"),
    errors.GenerationFailed("the batched decode step failed"),
    errors.ModelLoadError("cannot load"),
    errors.UnsupportedModel("qwen3_next: layer 0 keeps a recurrent state"),
])
def test_errors_cross_the_wire_as_their_class_and_fields(exc: Exception) -> None:
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(error_to_wire(exc)), type=WireError)
    for rebuilt in (event_error(wire), command_error(wire)):
        assert type(rebuilt) is type(exc) and str(rebuilt) == str(exc)
        for name in ("message", "param", "code", "retry_after_s", "model", "status", "type"):
            assert getattr(rebuilt, name, None) == getattr(exc, name, None), name
    assert {c.__name__ for c in ERROR_TYPES} >= {"GenerationFailed", "ModelLoadError", "NotReady"}


def test_an_error_of_no_known_class_is_generation_failed_in_a_stream_and_named_for_a_command() -> None:
    wire = error_to_wire(ValueError("odd"))
    assert type(event_error(wire)) is errors.GenerationFailed and str(event_error(wire)) == "odd"
    failure = command_error(wire)
    assert isinstance(failure, EngineFailure) and failure.kind == "ValueError" and str(failure) == "ValueError: odd"


def test_a_dead_gpu_thread_fails_every_command_instead_of_leaving_it_waiting() -> None:
    """What the GPUExecutor's stop relies on after its engine died (thread or process alike)."""
    import threading

    died = threading.Event()

    class Broken:
        has_work = True

        def step(self) -> None:
            raise RuntimeError("a native panic")

    thread = GPUThread("test-dying", on_fatal=lambda exc: died.set())
    thread.stepper = Broken()
    thread.start()
    assert died.wait(10)
    with pytest.raises(GPUThreadDied):
        thread.submit(lambda: 1).result(timeout=10)


def test_an_abandoned_gpu_thread_fails_its_running_and_queued_commands() -> None:
    """A pipeline rank died under a collective: rank 0's GPU thread never returns from it, and
    `abandon` fails what waits on it at once (LocalEngine, pipeline_watch.py)."""
    import threading

    stuck, release = threading.Event(), threading.Event()
    thread = GPUThread("test-stuck", on_fatal=lambda exc: None)
    thread.start()
    running = thread.submit(lambda: (stuck.set(), release.wait(30)))
    queued = thread.submit(lambda: 1)
    assert stuck.wait(10)
    thread.abandon(RuntimeError("rank 1 is gone"))
    for future in (running, queued, thread.submit(lambda: 2)):
        with pytest.raises(GPUThreadDied):
            future.result(timeout=10)
    release.set()  # the call returns after all: the loop ends, nothing runs the rest
    assert thread.stop(10)
