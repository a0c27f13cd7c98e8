"""A pipeline rank killed with every stream in flight (`serve --pipeline`, docs/pipeline.md), at a GPU's scale.

    mlx.launch -n 2 --backend nccl -- -m mlx_relay.cli serve MODEL --pipeline --port 8101 &
    python benchmarks/pipeline_rank_kill.py http://127.0.0.1:8101 --victim-pid PID_OF_RANK_1 \
        --launcher-pid PID_OF_MLX_LAUNCH --streams 8 --out rank_kill.json

What `tests/test_pipeline.py::test_a_dead_rank_fails_the_server_instead_of_hanging_it` pins on the
CPU with one stream, here with `--streams` at once on a real model: once each stream has sent text,
the victim rank is SIGKILLed; every stream must end with an error event (then `[DONE]`), none may
hang; `/health` must turn 503 (`failed`) or refuse the connection (rank 0 gone); and the launcher
(rank 0's supervisor, `--launcher-pid`) must exit. The report gives the seconds from the kill to
each. Restarting is the caller's (`device_two_gpus.sh`'s `rankkill` job relaunches and times it).
Exit status 1 when one check fails.
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
from cluster_failover import Run  # the same streamed request, its lines kept (benchmarks/ is on the path)


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie, exited and not yet reaped by its parent, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def health(url: str) -> int | None:
    """/health's status code; None when the connection is refused (rank 0 gone)."""
    try:
        return httpx.get(url + "/health", timeout=5).status_code
    except httpx.TransportError:
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("url")
    parser.add_argument("--victim-pid", type=int, required=True, help="a rank other than 0")
    parser.add_argument("--launcher-pid", type=int, default=None, help="rank 0's supervisor (mlx.launch): must exit")
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=2000)
    parser.add_argument("--wait", type=float, default=120.0, help="seconds to wait for each outcome")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    model = httpx.get(args.url + "/v1/models", timeout=30).json()["data"][0]["id"]
    logs: list[list[str]] = [[] for _ in range(args.streams)]
    started = [threading.Event() for _ in range(args.streams)]
    client = Run(args.url, [], model)
    asks = [[{"role": "user", "content": f"Count from {k} upwards, one number a line."}] for k in range(args.streams)]
    threads = [threading.Thread(target=client.stream, args=(asks[k], args.max_tokens, logs[k], started[k]), daemon=True)
               for k in range(args.streams)]
    for t in threads:
        t.start()
    for e in started:
        e.wait(args.wait)
    killed = time.monotonic()
    os.kill(args.victim_pid, signal.SIGKILL)
    for t in threads:
        t.join(max(0.0, args.wait - (time.monotonic() - killed)))
    streams_s = time.monotonic() - killed
    hung = sum(t.is_alive() for t in threads)
    failed_s = None
    while time.monotonic() - killed < args.wait:
        if health(args.url) in (503, None):
            failed_s = time.monotonic() - killed
            break
        time.sleep(0.2)
    exited_s = None
    if args.launcher_pid is not None:
        while time.monotonic() - killed < args.wait:
            if not alive(args.launcher_pid):
                exited_s = time.monotonic() - killed
                break
            time.sleep(0.2)

    def ended_with_error(lines: list[str]) -> bool:
        data = [ln for ln in lines if ln.startswith("data: ")]
        events = [json.loads(ln[6:]) for ln in data if ln != "data: [DONE]"]
        return bool(events) and "error" in events[-1] and bool(data) and data[-1] == "data: [DONE]"

    report: dict[str, Any] = {
        "streams": args.streams, "hung": hung, "seconds_streams_ended": round(streams_s, 2),
        "ended_with_error_event": sum(ended_with_error(lines) for lines in logs),
        "text_before_kill": sum(any('"content"' in ln for ln in lines) for lines in logs),
        "seconds_to_failed_health": None if failed_s is None else round(failed_s, 2),
        "seconds_to_launcher_exit": None if exited_s is None else round(exited_s, 2),
        "ok": hung == 0 and failed_s is not None and (args.launcher_pid is None or exited_s is not None)
              and all(ended_with_error(lines) for lines in logs),
        "last_lines": [lines[-3:] for lines in logs],
    }
    print(json.dumps({k: v for k, v in report.items() if k != "last_lines"}))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    sys.exit(0 if report["ok"] else 1)


if __name__ == "__main__":
    main()
