"""Shared fixtures: the tiny real models (built once, cached) and live servers on them."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from mlx_relay.relay import Relay, default_config
from mlx_relay.testing.fixtures import FixtureSpec, fixture_path
from mlx_relay.testing.live_server import LiveServer


@pytest.fixture(scope="session")
def fp32_model() -> Path:
    return fixture_path(FixtureSpec(variant="fp32", seed=0))


@pytest.fixture(scope="session")
def bf16_model() -> Path:
    return fixture_path(FixtureSpec(variant="bf16", seed=0))


@pytest.fixture(scope="session")
def server(fp32_model: Path) -> Iterator[LiveServer]:
    """The shared server: fp32 fixture, 8 sequences at once, a queue of 32."""
    config = default_config(fp32_model, served_model_name="tiny", max_num_seqs=8, max_queue=32)
    with LiveServer(config) as live:
        yield live


@pytest.fixture(scope="session")
async def relay(fp32_model: Path) -> AsyncIterator[Relay]:
    """The same actors in-process, without HTTP."""
    async with Relay.start(fp32_model, max_num_seqs=8) as r:
        yield r
