"""A process that used the server exits cleanly (exit code 0), every time; a killed one leaves no
engine process behind.

MLX's CPU backend can abort at exit after a thread that ran MLX work has ended
(ml-explore/mlx#3126); the GPUThread therefore parks instead of exiting. This pins it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

SCRIPT = """
import sys, anyio
from mlx_relay import Relay

async def main():
    async with Relay.start(sys.argv[1], warmup=False) as relay:
        await relay.chat([{"role": "user", "content": "hi"}], max_tokens=3)

anyio.run(main)
"""


def test_process_exits_cleanly_after_serving(fp32_model: Path) -> None:
    for _ in range(4):
        proc = subprocess.run([sys.executable, "-c", SCRIPT, str(fp32_model)], capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert "terminate called" not in proc.stderr


ENGINE_PROCESS_SCRIPT = """
import os, signal, sys, anyio
from mlx_relay import Relay

async def main():
    async with Relay.start(sys.argv[1], warmup=False, engine_process="on") as relay:
        await relay.chat([{"role": "user", "content": "hi"}], max_tokens=3)
        print(relay.system.cell("gpu").actor.engine_pid, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)  # the server dies at once: its engine process must follow

anyio.run(main)
"""


def test_no_engine_process_outlives_a_killed_server(fp32_model: Path) -> None:
    """A server killed at once (no stop, no clean-up) leaves no engine process behind: the engine
    process sees the end of its pipe and exits. (A stopped server's: tests/test_engine_process.py.)"""
    from tests.test_engine_process import wait_gone

    proc = subprocess.run([sys.executable, "-c", ENGINE_PROCESS_SCRIPT, str(fp32_model)], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == -9, proc.stderr[-2000:]
    assert wait_gone(int(proc.stdout.split()[-1]), 10)
