"""Where and with what a run ran: machine facts, library versions, the commit, the date (for the
report: every figure names the commit it measured)."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path

import msgspec

LIBRARIES: tuple[str, ...] = ("mlx-relay", "mlx", "mlx-lm", "mlx-vlm", "httpx", "numpy")


class MachineInfo(msgspec.Struct, frozen=True):
    system: str
    release: str
    machine: str
    processor: str
    cpu_count: int | None
    memory_gb: float | None
    python: str


class Environment(msgspec.Struct, frozen=True):
    date: str  # ISO 8601, UTC
    machine: MachineInfo
    versions: dict[str, str | None]  # None: not installed
    commit: str | None = None  # mlx-relay's git commit ("-dirty": with uncommitted changes); None: not a checkout


def source_commit() -> str | None:
    """The checkout's commit, as `git describe` would name it for a figure."""
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        out = subprocess.run(["git", "-C", here, "describe", "--always", "--dirty", "--abbrev=7"],
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def memory_gb() -> float | None:
    try:
        return round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1)
    except (ValueError, OSError, AttributeError):
        return None


def cpu_model() -> str:
    """The CPU's name (`platform.processor()` is empty on Linux, so /proc/cpuinfo there)."""
    name = platform.processor()
    if name:
        return name
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def machine_info() -> MachineInfo:
    uname = platform.uname()
    return MachineInfo(system=uname.system, release=uname.release, machine=uname.machine,
                       processor=cpu_model(), cpu_count=os.cpu_count(),
                       memory_gb=memory_gb(), python=sys.version.split()[0])


def process_rss_mb(pid: int) -> float:
    """Resident memory of process `pid` and all its descendants (e.g. a server and its template
    sandbox), in MB, from /proc (Linux); 0 where /proc has no such process."""
    total = 0
    for p in [pid, *_descendants(pid)]:
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except OSError:
            continue
    return round(total / 1024, 1)


def _descendants(pid: int) -> list[int]:
    try:
        kids = [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []
    return kids + [g for k in kids for g in _descendants(k)]


def library_versions(names: tuple[str, ...] = LIBRARIES) -> dict[str, str | None]:
    versions: dict[str, str | None] = {}
    for name in names:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def environment() -> Environment:
    return Environment(date=datetime.now(UTC).isoformat(timespec="seconds"), machine=machine_info(),
                       versions=library_versions(), commit=source_commit())
