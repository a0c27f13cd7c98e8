"""`mlx-relay cluster`: 2 replicas of the fp32 fixture behind SMG's cache-aware router, on loopback,
started by the real command (a subprocess), driven through the router as an agent would.

One cluster for the file's main story, in the order a run meets things: (a) a session's second turn
lands on the replica holding its prefix, (b) several sessions spread over both replicas, (c) a
replica killed (SIGKILL) with two requests running on it: the stream ends with an error event, the
non-streamed one is run again by SMG on the survivor (a 200), every session continues on the
survivor (re-prefilled there), then SIGTERM stops the router and drains the survivor, leaving no
process behind. Last, a cluster of 1 replica whose supervisor is SIGKILLed: its children follow it.
Which replica served a request is read from each replica's own `/metrics`
(`mlx_relay:prompt_tokens_total` grows on the one that ran it).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from mlx_relay.testing import local_http
from mlx_relay.testing.live_server import free_port_range

MODEL = "tiny"


class Cluster:
    def __init__(self, proc: subprocess.Popen[str], port: int, replicas: int, lines: list[str],
                 log: Path | None = None) -> None:
        self.proc = proc
        self.log = log  # the cluster's stderr (SMG's and the replicas' logs), where kept
        self.url = f"http://127.0.0.1:{port}"
        self.replicas = [f"http://127.0.0.1:{port + i}" for i in range(1, replicas + 1)]
        self.lines = lines
        self.pids = {url: _field(lines, f"url={url} ready", "pid") for url in self.replicas}
        self.router_pid = _field(lines, "router pid=", "pid")

    def kill_all(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        for pid in (*self.pids.values(), self.router_pid):
            _kill_quietly(pid)


def _field(lines: list[str], marker: str, key: str) -> int:
    line = next(ln for ln in lines if marker in ln)
    return int(line.split(f"{key}=")[1].split()[0])


def _start_cluster(model: Path, replicas: int, *flags: str, log: Path | None = None) -> Cluster:
    """`mlx-relay cluster` as a subprocess, once it says it is ready (its later lines keep coming);
    its stderr into `log` where given."""
    port = free_port_range(replicas + 2)  # router, replicas, the router's metrics
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    argv = [sys.executable, "-m", "mlx_relay.cli", "cluster", str(model), "--replicas", str(replicas),
            "--port", str(port), "--ready-timeout", "120",
            "--served-model-name", MODEL, "--no-warmup", "--drain-timeout", "3", "--log-level", "warning", *flags]
    err = log.open("w") if log is not None else subprocess.DEVNULL
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=err, text=True, env=env)
    lines: list[str] = []
    assert proc.stdout is not None
    for line in proc.stdout:  # the supervisor's own lines, until ready (or it exits)
        lines.append(line.strip())
        if "cluster ready" in line:
            break
    assert any("cluster ready" in ln for ln in lines), [ln for ln in lines if "mlx-relay" in ln][-6:]
    threading.Thread(target=lambda: lines.extend(ln.strip() for ln in proc.stdout or ()), daemon=True).start()
    return Cluster(proc, port, replicas, lines, log)


@pytest.fixture(scope="module")
def cluster(fp32_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    log = tmp_path_factory.mktemp("cluster") / "stderr.log"
    live = _start_cluster(fp32_model, 2, "--replica-devices", "1,0", log=log)
    try:
        yield live
    finally:
        live.kill_all()


def _kill_quietly(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _prompt_tokens(url: str) -> float:
    text = local_http.get(url + "/metrics", timeout=10).text
    return sum(float(ln.split()[-1]) for ln in text.splitlines() if ln.startswith("mlx_relay:prompt_tokens_total"))


def _system(session: int) -> str:
    """A few hundred tokens of an agent's system prompt, distinct per session from its first word."""
    rules = " ".join(f"Rule {k}: keep module {k} small, typed and tested." for k in range(24))
    return f"Session {session} agent. You are a careful coding agent. {rules}"


def _chat(url: str, messages: list[dict[str, Any]], max_tokens: int = 4) -> dict[str, Any]:
    r = local_http.post(url + "/v1/chat/completions", json={"model": MODEL, "messages": messages,
                                                       "max_tokens": max_tokens}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def _turn(cluster: Cluster, messages: list[dict[str, Any]]) -> tuple[dict[str, Any], str]:
    """One request through the router; its reply and the replica that ran it."""
    before = {u: n for u in cluster.replicas if (n := _reachable_prompt_tokens(u)) is not None}
    reply = _chat(cluster.url, messages)
    grew = [u for u, n in before.items() if _prompt_tokens(u) > n]
    assert len(grew) == 1, grew
    return reply, grew[0]


def _reachable_prompt_tokens(url: str) -> float | None:
    try:
        return _prompt_tokens(url)
    except httpx.TransportError:
        return None  # the killed replica


def _next_turn(messages: list[dict[str, Any]], reply: dict[str, Any], user: str) -> list[dict[str, Any]]:
    return [*messages, {"role": "assistant", "content": reply["choices"][0]["message"]["content"]},
            {"role": "user", "content": user}]


def test_worker_loads_as_smg_reads_them(cluster: Cluster) -> None:
    """`/v1/loads` in SMG's schema (what it polls for load), and a bad section is a 400."""
    r = local_http.get(cluster.replicas[0] + "/v1/loads", params={"include": "core,disagg,queues,memory"})
    assert r.status_code == 200
    body = r.json()
    assert body["dp_rank_count"] == 1 and len(body["loads"]) == 1
    load = body["loads"][0]
    assert load["num_running_reqs"] == 0 and load["num_waiting_reqs"] == 0
    assert load["max_running_requests"] == 16 and load["token_usage"] == 0.0
    bad = local_http.get(cluster.replicas[0] + "/v1/loads", params={"include": "core,gpus"})
    assert bad.status_code == 400
    assert bad.json()["error"]["type"] == "invalid_request_error" and bad.json()["error"]["param"] == "include"
    # --replica-devices: each replica its own GPU (CUDA_VISIBLE_DEVICES; harmless on the CPU)
    for url, device in zip(cluster.replicas, ("1", "0"), strict=True):
        environ = Path(f"/proc/{cluster.pids[url]}/environ").read_bytes().split(b"\0")
        assert f"CUDA_VISIBLE_DEVICES={device}".encode() in environ
    workers = local_http.get(cluster.url + "/workers").json()["workers"]  # SMG's view: both registered, healthy
    assert sorted(w["url"] for w in workers) == cluster.replicas
    assert all(w["is_healthy"] and w["status"] == "ready" for w in workers)


def _both_healthy(cluster: Cluster, polls: int = 150) -> None:
    """Until SMG lists every replica healthy. One run of the whole suite (2 workers on a 2-core
    machine) found all 6 first turns on one replica, which the cache-aware policy does only while the
    other is not a candidate (else the smallest tree takes a session that matches none); a health
    check timed out under that load is the suspected cause, not shown: this takes it out of the test."""
    workers: list[dict[str, Any]] = []
    for _ in range(polls):  # 0.2 s apart
        workers = local_http.get(cluster.url + "/workers").json()["workers"]
        if sorted(w["url"] for w in workers if w["is_healthy"]) == cluster.replicas:
            return
        time.sleep(0.2)
    raise AssertionError(f"SMG does not list both replicas healthy: {workers}")


def _router_said(cluster: Cluster, last: int = 40) -> list[str]:
    """The last warnings and errors of the cluster's output (SMG logs at warn to the stdout it shares
    with the supervisor) and stderr (the replicas'), colour codes dropped."""
    logged = cluster.log.read_text(errors="replace").splitlines() if cluster.log and cluster.log.exists() else []
    plain = (re.sub(r"\x1b\[[0-9;]*m", "", ln) for ln in [*cluster.lines, *logged])
    return [ln for ln in plain if "WARN" in ln or "ERROR" in ln][-last:]


def test_affinity_spread_and_a_replica_killed(cluster: Cluster) -> None:
    _both_healthy(cluster)
    # (b) first turns of 6 sessions, 3 at a time (as agents arrive): SMG spreads them
    firsts = [[{"role": "system", "content": _system(i)}, {"role": "user", "content": f"Task {i}: add a parser."}]
              for i in range(6)]
    before = {u: _prompt_tokens(u) for u in cluster.replicas}
    with ThreadPoolExecutor(3) as pool:
        replies = list(pool.map(lambda m: _chat(cluster.url, m), firsts))
    served = {u: _prompt_tokens(u) - before[u] for u in cluster.replicas}
    # both replicas took sessions (a run of the whole suite once found every first turn on one: what
    # SMG said of its workers then is in the message)
    assert all(n > 0 for n in served.values()), (served, _router_said(cluster))

    # (a) each session's second turn: on the replica holding its prefix, cached >= 90% of turn 1
    sessions: dict[int, tuple[list[dict[str, Any]], str, int]] = {}
    for i, (msgs, first) in enumerate(zip(firsts, replies, strict=True)):
        msgs2 = _next_turn(msgs, first, "Now add its tests.")
        reply, replica = _turn(cluster, msgs2)
        cached = reply["usage"]["prompt_tokens_details"]["cached_tokens"]
        assert first["usage"]["prompt_tokens"] > 300
        assert cached >= 0.9 * first["usage"]["prompt_tokens"], (i, cached, first["usage"])
        sessions[i] = (_next_turn(msgs2, reply, "Make it faster."), replica, reply["usage"]["prompt_tokens"])
    assert {replica for _, replica, _ in sessions.values()} == set(cluster.replicas)
    # the second turn stays where the first ran: its own replica's index held the prefix
    victim = cluster.replicas[1]
    moved = [i for i, (_, replica, _) in sessions.items() if replica == victim]

    # (c) two requests in flight on the victim, then SIGKILL: a stream (a session of its own) and a
    # non-streamed one (a new session whose system prompt extends the stream's, so SMG's tree sends it
    # to the victim, while its rerun gives the survivor no snapshot the victim's sessions could use)
    stream_msgs = sessions[moved[0]][0]
    events: list[str] = []
    first_token = threading.Event()

    def stream() -> None:
        body = {"model": MODEL, "messages": stream_msgs, "max_tokens": 3000, "stream": True}
        with local_http.stream("POST", cluster.url + "/v1/chat/completions", json=body, timeout=60) as r:
            events.append(f"status {r.status_code}")
            for line in r.iter_lines():
                if line:
                    events.append(line)
                    if '"content"' in line:
                        first_token.set()

    unary_msgs = [{"role": "system", "content": stream_msgs[0]["content"] + " Keep a changelog."},
                  {"role": "user", "content": "Task 6: add a CLI."}]
    unary: list[httpx.Response] = []

    def non_streamed() -> None:
        body = {"model": MODEL, "messages": unary_msgs, "max_tokens": 200}
        unary.append(local_http.post(cluster.url + "/v1/chat/completions", json=body, timeout=60))

    before_victim = _prompt_tokens(victim)
    t = threading.Thread(target=stream)
    t.start()
    assert first_token.wait(30)
    assert _prompt_tokens(victim) > before_victim  # it runs on the victim
    u = threading.Thread(target=non_streamed)
    u.start()
    assert _wait_for(lambda: _running(victim) == 2 or not u.is_alive())
    assert u.is_alive() and _running(victim) == 2  # the non-streamed one runs on the victim too, unfinished
    os.kill(cluster.pids[victim], signal.SIGKILL)
    t.join(30)
    assert not t.is_alive()  # no hang
    # what SMG does: the 200 stream gets an error event, then [DONE] (no finish_reason chunk)
    assert events[0] == "status 200" and events[-1] == "data: [DONE]", events[-3:]
    error = json.loads(events[-2].removeprefix("data: "))
    assert error["error"]["type"] == "stream_error", error
    assert not any('"finish_reason":"length"' in e for e in events)

    # every session completes afterwards: the victim's on the survivor (re-prefilled, then cached)
    survivor = cluster.replicas[0]
    for msgs, replica, previous_prompt in sessions.values():
        reply, ran_on = _turn(cluster, msgs)
        assert ran_on == survivor
        usage = reply["usage"]
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        if replica == victim:
            assert cached < 0.5 * usage["prompt_tokens"]  # re-prefilled: the survivor never saw it
            again, ran_on = _turn(cluster, _next_turn(msgs, reply, "And document it."))
            assert ran_on == survivor
            assert again["usage"]["prompt_tokens_details"]["cached_tokens"] >= 0.9 * usage["prompt_tokens"]
        else:
            assert cached >= 0.9 * previous_prompt  # untouched by the kill
    # the non-streamed request in flight on the victim: SMG saw the connection fail and sent it again
    # to the survivor, which ran it whole (a chat completion is buffered by SMG, so it stays retryable)
    u.join(60)
    assert not u.is_alive()
    assert unary[0].status_code == 200, unary[0].text
    done = unary[0].json()
    assert done["choices"][0]["finish_reason"] in ("length", "stop") and done["usage"]["completion_tokens"] > 0
    assert _wait_for_line(cluster, "replica 2 (pid")  # the supervisor saw it go and kept the cluster up
    assert cluster.proc.poll() is None


def _running(url: str) -> float:
    text = local_http.get(url + "/metrics", timeout=10).text
    return sum(float(ln.split()[-1]) for ln in text.splitlines() if ln.startswith("mlx_relay:num_requests_running"))


def _wait_for(condition: Callable[[], bool], timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return False


def _wait_for_line(cluster: Cluster, text: str, timeout_s: float = 5.0) -> bool:
    return _wait_for(lambda: any(text in ln for ln in cluster.lines), timeout_s)


def test_sigterm_stops_everything(cluster: Cluster) -> None:
    """SIGTERM: the router stops, the survivor drains, the supervisor exits 0, no process left."""
    cluster.proc.send_signal(signal.SIGTERM)
    assert cluster.proc.wait(60) == 0
    for pid in (*cluster.pids.values(), cluster.router_pid):
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert _wait_for_line(cluster, "cluster stopped")


def _gone(pid: int) -> bool:
    """Exited (a zombie waiting for a reaper counts: it runs nothing). `ps` says so on Linux and macOS."""
    ps = subprocess.run(["ps", "-o", "stat=", "-p", str(pid)], capture_output=True, text=True)
    return ps.returncode != 0 or ps.stdout.strip().startswith("Z")


def test_supervisor_killed_takes_its_children(fp32_model: Path) -> None:
    """A SIGKILL of the `cluster` process itself (it can do nothing about it): its children's stdin
    pipes reach their end, so the replica drains and exits and SMG stops; no process is left. A
    cluster of its own (1 replica): the file's cluster was stopped by SIGTERM above."""
    small = _start_cluster(fp32_model, 1)
    try:
        children = (*small.pids.values(), small.router_pid)
        assert not any(_gone(pid) for pid in children)
        small.proc.kill()
        small.proc.wait(10)
        assert _wait_for(lambda: all(_gone(pid) for pid in children), 20), [(p, _gone(p)) for p in children]
    finally:
        small.kill_all()


def test_replica_devices_one_per_replica(capsys: pytest.CaptureFixture[str]) -> None:
    """`--replica-devices` names one device per local replica, or the command exits 2 saying so."""
    from mlx_relay.cli import main
    from mlx_relay.cluster.config import ClusterConfig, RouterConfig

    config = ClusterConfig(model=None, router=RouterConfig(), replicas=2, replica_devices=("0", "1"))
    assert config.replica_env(2) == {"CUDA_VISIBLE_DEVICES": "1"}
    assert ClusterConfig(model=None, router=RouterConfig()).replica_env(1) == {}
    assert main(["cluster", "m", "--replicas", "2", "--replica-devices", "0"]) == 2
    assert "names 1 devices for 2 local replicas" in capsys.readouterr().err
    assert main(["cluster", "m", "--replicas", "2", "--replica-devices", "0,"]) == 2
    assert "not a device list" in capsys.readouterr().err


def test_each_replica_s_log_lines_carry_its_name() -> None:
    """The replicas share the cluster's stderr: each runs with `--log-name replica-N` (unless the
    serve args name one), so a request line says which replica ran it."""
    from mlx_relay.cluster.config import ClusterConfig, RouterConfig
    from mlx_relay.cluster.supervisor import build_replicas

    argvs = [r.argv for r in build_replicas(ClusterConfig(model="m", router=RouterConfig(), replicas=2))]
    assert [a[a.index("--log-name") + 1] for a in argvs] == ["replica-1", "replica-2"]
    named = ClusterConfig(model="m", router=RouterConfig(), replicas=2, serve_args=("--log-name", "mine"))
    assert all(r.argv.count("--log-name") == 1 for r in build_replicas(named))
