"""A replica killed mid-load behind the router (`mlx-relay cluster`, docs/cluster.md), at a GPU's scale.

    mlx-relay cluster MODEL --replicas 2 --replica-devices 0,1 --port 8200 &
    python benchmarks/cluster_failover.py http://127.0.0.1:8200 --replica http://127.0.0.1:8201 \
        --replica http://127.0.0.1:8202 --victim-pid PID_OF_REPLICA_2 --sessions 12 --out failover.json

What `tests/test_cluster.py` pins on the CPU, with a real model and every session streaming:
1. first turns of `--sessions` agent sessions (each its own ~1.5k-token system prompt), one at a
   time, through the router; which replica ran each is read from the replicas' own `/metrics`
   (`mlx_relay:prompt_tokens_total` grows on that one);
2. second turns, one at a time: the replica and the cached share of the first turn's prompt;
3. every session's third turn at once, streamed (`--stream-tokens`); once each stream has sent
   text, the victim replica is SIGKILLed: its streams must end with an error event and `[DONE]`,
   the survivor's must finish normally;
4. every session's next request, one at a time: the victim's sessions resend their third turn
   (a client's retry), which must run on the survivor (re-prefilled), and one more turn there must
   be cached again; the survivor's sessions stay cached.
The report (stdout and `--out` JSON) counts each outcome; exit status 1 when one fails.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from typing import Any

import httpx


def system_prompt(session: int) -> str:
    rules = " ".join(f"Rule {k} of agent {session}: keep module {k} small, typed and tested." for k in range(110))
    return f"Agent {session}. You are a careful coding agent in a large repository. {rules}"


def prompt_tokens(url: str) -> float | None:
    try:
        text = httpx.get(url + "/metrics", timeout=10).text
    except httpx.TransportError:
        return None  # the killed replica
    return sum(float(ln.split()[-1]) for ln in text.splitlines() if ln.startswith("mlx_relay:prompt_tokens_total"))


class Run:
    def __init__(self, router: str, replicas: list[str], model: str) -> None:
        self.router, self.replicas, self.model = router, replicas, model

    def turn(self, messages: list[dict[str, Any]], max_tokens: int = 8) -> tuple[dict[str, Any], str | None]:
        """One request through the router, alone: its reply and the replica that ran it."""
        before = {u: prompt_tokens(u) for u in self.replicas}
        r = httpx.post(self.router + "/v1/chat/completions", timeout=600, json={
            "model": self.model, "messages": messages, "max_tokens": max_tokens, "temperature": 0})
        r.raise_for_status()
        grew = [u for u, n in before.items() if n is not None and (prompt_tokens(u) or 0) > n]
        return r.json(), grew[0] if len(grew) == 1 else None

    def stream(self, messages: list[dict[str, Any]], max_tokens: int, lines: list[str], started: threading.Event
               ) -> None:
        body = {"model": self.model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
                "stream": True}
        try:
            with httpx.stream("POST", self.router + "/v1/chat/completions", json=body, timeout=600) as r:
                lines.append(f"status {r.status_code}")
                for line in r.iter_lines():
                    if line:
                        lines.append(line)
                        if '"content"' in line:
                            started.set()
        except httpx.HTTPError as exc:
            lines.append(f"transport error {type(exc).__name__}")
        started.set()


def cached_share(reply: dict[str, Any], of: int) -> float:
    return reply["usage"]["prompt_tokens_details"]["cached_tokens"] / max(1, of)


def after(messages: list[dict[str, Any]], reply: dict[str, Any], user: str) -> list[dict[str, Any]]:
    return [*messages, {"role": "assistant", "content": reply["choices"][0]["message"]["content"]},
            {"role": "user", "content": user}]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("router")
    parser.add_argument("--replica", action="append", required=True, help="each replica's URL (the victim last)")
    parser.add_argument("--victim-pid", type=int, required=True, help="the pid of the last --replica's process")
    parser.add_argument("--sessions", type=int, default=12)
    parser.add_argument("--stream-tokens", type=int, default=256)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    model = httpx.get(args.router + "/v1/models", timeout=30).json()["data"][0]["id"]
    run, victim = Run(args.router, args.replica, model), args.replica[-1]
    report: dict[str, Any] = {"sessions": args.sessions}
    sessions: list[dict[str, Any]] = []
    for i in range(args.sessions):  # 1. first turns
        msgs = [{"role": "system", "content": system_prompt(i)},
                {"role": "user", "content": f"Task {i}: add a parser."}]
        reply, ran = run.turn(msgs)
        sessions.append({"msgs": msgs, "first": reply, "replica": ran})
    report["first_turns_per_replica"] = {u: sum(s["replica"] == u for s in sessions) for u in args.replica}
    second = []
    for s in sessions:  # 2. second turns: where, and cached
        msgs = after(s["msgs"], s["first"], "Now add its tests.")
        reply, ran = run.turn(msgs)
        second.append({"same_replica": ran == s["replica"],
                       "cached_share": cached_share(reply, s["first"]["usage"]["prompt_tokens"])})
        s["msgs"] = after(msgs, reply, "Make it faster and explain every change in detail.")
    report["second_turns"] = {"same_replica": sum(t["same_replica"] for t in second),
                              "cached_at_least_90pct": sum(t["cached_share"] >= 0.9 for t in second),
                              "cached_share_min": min(t["cached_share"] for t in second)}
    # 3. every session's third turn at once, streamed; then the victim is killed
    streams = [([], threading.Event()) for _ in sessions]
    threads = [threading.Thread(target=run.stream, args=(s["msgs"], args.stream_tokens, lines, started))
               for s, (lines, started) in zip(sessions, streams, strict=True)]
    for t in threads:
        t.start()
    for _, started in streams:
        started.wait(300)
    time.sleep(0.5)
    os.kill(args.victim_pid, signal.SIGKILL)
    killed_at = time.monotonic()
    for t in threads:
        t.join(300)
    report["hung_streams"] = sum(t.is_alive() for t in threads)
    outcome: dict[str, int] = {"victim_error_then_done": 0, "victim_other": 0, "survivor_finished": 0,
                               "survivor_other": 0}
    for s, (lines, _) in zip(sessions, streams, strict=True):
        data = [ln for ln in lines if ln.startswith("data: ")]
        errored = len(data) >= 2 and data[-1] == "data: [DONE]" and '"error"' in data[-2]
        finished = len(data) >= 2 and data[-1] == "data: [DONE]" and any('"finish_reason":"' in d for d in data)
        side = "victim" if s["replica"] == victim else "survivor"
        key = f"{side}_error_then_done" if side == "victim" and errored else (
            "survivor_finished" if side == "survivor" and finished and not errored else f"{side}_other")
        outcome[key] += 1
        s["stream_tail"] = lines[-3:]
    report["streams_at_kill"] = outcome
    # 4. every session goes on
    resumed = {"victim_on_survivor": 0, "victim_reprefilled": 0, "victim_cached_again": 0,
               "survivor_cached": 0, "failed": 0}
    for s in sessions:
        try:
            reply, ran = run.turn(s["msgs"])
            if s["replica"] == victim:
                resumed["victim_on_survivor"] += ran is not None and ran != victim
                resumed["victim_reprefilled"] += cached_share(reply, reply["usage"]["prompt_tokens"]) < 0.5
                again, _ = run.turn(after(s["msgs"], reply, "And document it."))
                resumed["victim_cached_again"] += cached_share(again, reply["usage"]["prompt_tokens"]) >= 0.9
            else:
                resumed["survivor_cached"] += cached_share(reply, reply["usage"]["prompt_tokens"]) >= 0.5
        except httpx.HTTPError as exc:
            resumed["failed"] += 1
            s["resume_error"] = repr(exc)
    report["after_kill"] = resumed
    report["seconds_after_kill"] = round(time.monotonic() - killed_at, 1)
    report["tails"] = [s["stream_tail"] for s in sessions]
    victims = sum(s["replica"] == victim for s in sessions)
    ok = (report["hung_streams"] == 0 and outcome["victim_other"] == 0 and outcome["survivor_other"] == 0
          and victims > 0 and resumed["failed"] == 0 and resumed["victim_on_survivor"] == victims
          and resumed["victim_cached_again"] == victims)
    report["ok"] = ok
    print(json.dumps({k: v for k, v in report.items() if k != "tails"}, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
