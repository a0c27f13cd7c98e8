"""Supervision on the real actors: a crashed actor is restarted with its state rebuilt and the
server says it is degraded meanwhile; an actor that cannot be restarted fails the relay, which
`/health` reports and which makes `mlx-relay serve` exit non-zero (`Relay.failed`)."""

from __future__ import annotations

import shutil
from pathlib import Path

import anyio
import pytest

from mlx_relay.errors import NotReady
from mlx_relay.relay import Relay


async def test_a_crashed_actor_restarts_and_an_unrecoverable_one_fails_the_relay(fp32_model: Path,
                                                                                 tmp_path: Path) -> None:
    model = tmp_path / "model"
    shutil.copytree(fp32_model, model)
    async with Relay.start(model, warmup=False, max_num_seqs=2) as relay:
        normalizer = relay.system.cell("normalizer")
        normalizer.ref.crash("injected")
        await anyio.sleep(0.01)
        health = relay.health()
        assert health.status == "degraded" and health.down == {"normalizer": "restarting"} and not health.ready
        reply = await relay.chat([{"role": "user", "content": "hi"}], max_tokens=2)  # waits for the fresh actor
        assert reply.completion_tokens >= 1 and normalizer.restarts == 1
        assert relay.health().status == "ready"

        shutil.rmtree(model)  # the GPU executor cannot load the model again
        assert relay.gpu is not None
        relay.gpu.crash("injected")
        with anyio.fail_after(60):
            await relay.failed.wait()
        health = relay.health()
        assert health.status == "failed" and health.down == {"gpu": "failed"}
        with pytest.raises(NotReady):
            await relay.chat([{"role": "user", "content": "hi"}], max_tokens=2)
