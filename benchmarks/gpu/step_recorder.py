"""What a run of engine steps spends, per token: the device's kernels (CUPTI's records through the
machine's torch.profiler, where torch has a CUDA GPU) and the host's Python by function (cProfile).
Used by `kernel_profile.py` (a step's kernels) and `bench_speculation.py --profile` (issue 45.2: a
speculation lane's step against the plain step at batch 1, kernel launches and host time a token).

    rec = StepRecorder(); rec.start(); ...steps...; rec.stop()
    rec.summary(tokens, seconds)   # wall / busy / gaps ms a token, launches a token, top kernels and functions
"""

from __future__ import annotations

import cProfile
import json
import pstats
import tempfile
from collections import defaultdict
from pathlib import Path
from typing import Any


def profiler() -> Any | None:
    """torch.profiler recording CUDA activity, or None where there is no torch or no CUDA GPU."""
    try:
        import torch
        from torch.profiler import ProfilerActivity, profile
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    torch.cuda.init()  # the primary context MLX uses too
    return profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU])


def kernels(prof: Any) -> list[tuple[str, float]]:
    """(name, device microseconds) of every kernel the profiler recorded (its Chrome trace's
    `kernel` events: launches of any library, with or without a torch op around them)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        trace = json.loads(path.read_text())
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    return [(e["name"], float(e.get("dur", 0))) for e in events if e.get("cat") == "kernel"]


def short(name: str) -> str:
    return name if len(name) <= 90 else name[:87] + "..."


def by_kernel(prof: Any) -> dict[str, list[float]]:
    out: dict[str, list[float]] = defaultdict(list)
    for name, us in kernels(prof):
        out[name].append(us)
    return out


class StepRecorder:
    """Kernels (where a CUDA GPU is) and host functions over whatever runs between `start` and `stop`."""

    def __init__(self, top: int = 15) -> None:
        self.top = top
        self.device = profiler()
        self.host = cProfile.Profile()

    def start(self) -> None:
        if self.device is not None:
            self.device.__enter__()
        self.host.enable()

    def stop(self) -> None:
        self.host.disable()
        if self.device is not None:
            self.device.__exit__(None, None, None)

    def summary(self, tokens: int, seconds: float) -> dict[str, Any]:
        """Per token: wall ms, the kernels' busy ms and launches (None off a GPU), the top kernels by
        device time and the top host functions by their own time (ms a token)."""
        per = max(1, tokens)
        out: dict[str, Any] = {"tokens": tokens, "wall_ms": seconds * 1000 / per}
        if self.device is not None:
            k = by_kernel(self.device)
            busy = sum(sum(v) for v in k.values()) / 1000
            out.update(busy_ms=busy / per, launches=sum(len(v) for v in k.values()) / per,
                       kernels=[{"kernel": short(n), "launches": len(v) / per, "us": sum(v) / per}
                                for n, v in sorted(k.items(), key=lambda kv: -sum(kv[1]))[:self.top]])
        stats = pstats.Stats(self.host)
        rows = [(f"{Path(f).name}:{line}:{fn}", tt, ct, nc)
                for (f, line, fn), (_, nc, tt, ct, _) in stats.stats.items()]  # type: ignore[attr-defined]
        out["host"] = [{"function": n, "own_ms": tt * 1000 / per, "cum_ms": ct * 1000 / per, "calls": nc / per}
                       for n, tt, ct, nc in sorted(rows, key=lambda r: -r[1])[:self.top]]
        return out


def show(label: str, s: dict[str, Any]) -> None:
    """Print a summary as `bench_speculation.py --profile` does."""
    dev = (f", kernels busy {s['busy_ms']:.2f} ms, {s['launches']:.0f} launches, gaps "
           f"{s['wall_ms'] - s['busy_ms']:.2f} ms" if "busy_ms" in s else " (no GPU: host only)")
    print(f"\n== {label}: {s['tokens']} tokens, wall {s['wall_ms']:.2f} ms a token{dev}", flush=True)
    for row in s.get("kernels", []):
        print(f"  {row['us']:8.0f} us {row['launches']:6.1f}x  {row['kernel']}")
    for row in s["host"]:
        print(f"  host {row['own_ms']:7.3f} ms own {row['cum_ms']:7.3f} cum {row['calls']:6.1f}x  {row['function']}")
