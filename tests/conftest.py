"""Shared fixtures: the tiny real models (built once, cached) and live servers on them."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from mlx_relay.engine.hosting.gpu_thread import GPUThread
from mlx_relay.relay import Relay, default_config
from mlx_relay.testing.fixtures import FixtureSpec, fixture_path
from mlx_relay.testing.live_server import LiveServer

#: (model dir, prompts, max tokens) -> the library's greedy tokens for each prompt
References = Callable[[Path, list[list[int]], int], list[list[int]]]


@pytest.fixture(scope="session")
def references() -> References:
    """`testing.reference.greedy_reference`, each answer kept for the worker's session: the
    parametrized exactness tests ask for the same reference decoding case after case (the same model,
    prompts and length; ~29 s of a suite's run, counted at `a982d3d`), and it never changes."""
    from mlx_relay.testing.reference import greedy_reference

    kept: dict[tuple[str, tuple[tuple[int, ...], ...], int], list[list[int]]] = {}

    def greedy(path: Path, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        key = (str(path), tuple(tuple(p) for p in prompts), max_tokens)
        if key not in kept:
            kept[key] = greedy_reference(path, prompts, max_tokens)
        return [list(tokens) for tokens in kept[key]]

    return greedy


@pytest.fixture(scope="session")
def tiny_coder() -> Path:
    """The repository's small trained checkpoint of Python source (`models/relay-tiny-coder`, not in the package)."""
    return Path(__file__).resolve().parents[1] / "models" / "relay-tiny-coder"


@pytest.fixture(scope="session")
def fp32_model() -> Path:
    return fixture_path(FixtureSpec(variant="fp32", seed=0))


@pytest.fixture(scope="session")
def bf16_model() -> Path:
    return fixture_path(FixtureSpec(variant="bf16", seed=0))


@pytest.fixture(scope="module")
def gpu() -> Iterator[Callable[[Callable[[], Any]], Any]]:
    """Runs a callable on a dedicated GPUThread (MLX work in tests stays off the test thread too)."""
    thread = GPUThread("test-gpu", on_fatal=lambda exc: None)
    thread.start()
    yield lambda fn: thread.submit(fn).result(timeout=300)
    thread.stop(30)


@pytest.fixture(scope="session")
def server(fp32_model: Path) -> Iterator[LiveServer]:
    """The shared server: fp32 fixture, 8 sequences at once, a queue of 32, the MTP head's drafts
    unless a request asks for context drafts, verified every round (`context_policy` "always": a
    round's source and whether the head runs are otherwise chosen by measured time and by what the
    head earned on the rows before, which on a shared server depends on the tests before;
    tests/test_context_drafts.py covers the choice at the engine). No warm-up: the tests
    compile the kernels they run, not every shape a warm-up covers (each a C++ build on the CPU
    backend); test_mtp_policy's Relay and test_cli's server warm up."""
    config = default_config(fp32_model, served_model_name="tiny", max_num_seqs=8, max_queue=32, mtp_max_batch=8,
                            mtp_policy="always", speculation="mtp", context_policy="always", warmup=False)
    with LiveServer(config) as live:
        yield live


@pytest.fixture(scope="session")
async def relay(fp32_model: Path) -> AsyncIterator[Relay]:
    """The same actors in-process, without HTTP (no warm-up either, as the shared server).

    The Relay's task groups must be entered and left by one task; pytest-asyncio runs fixture
    set-up and tear-down in different tasks, so a dedicated task owns the Relay."""
    ready, stop = asyncio.Event(), asyncio.Event()
    holder: list[Relay] = []

    async def own() -> None:
        async with Relay.start(fp32_model, max_num_seqs=8, mtp_max_batch=8, mtp_policy="always",
                               context_policy="always", warmup=False) as r:
            holder.append(r)
            ready.set()
            await stop.wait()

    task = asyncio.ensure_future(own())
    done, _ = await asyncio.wait([task, asyncio.ensure_future(ready.wait())], return_when=asyncio.FIRST_COMPLETED)
    if task in done:
        task.result()  # raises the start-up error
    yield holder[0]
    stop.set()
    await task


#: The slowest test files first (their tests' seconds, `pytest --durations=0` at `7a1a1bb` on a 2-core machine: 86,
#: 58 (and ~9 since), 26, 25, 32, 22, 22, 28, 21, 19, 19, 18, 17, 17, 21, 16, 16, 15, 14, 13, 12, 12; the exactness
#: files' shares less the reference decoding they now share, `references`): `make test`'s `--dist loadfile` hands
#: the two workers whole files in collection order, so the long ones start first and the last files each worker
#: runs are short ones (longest first: the two workers end closer together).
SLOWEST_FIRST = ("test_model_pool.py", "test_pipeline.py", "test_reliability_fuzz.py", "test_chat_features.py",
                 "test_draft_model.py", "test_tool_loop_cache.py", "test_fixtures.py", "test_context_drafts.py",
                 "test_robustness.py", "test_cluster.py", "test_layering.py", "test_agent_requests.py",
                 "test_mtp_grammar.py", "test_relay_tiny_agent.py", "test_mtp.py", "test_shutdown.py",
                 "test_qwen_vocab.py", "test_train_small_mtp.py", "test_drain.py", "test_bench_e2e.py",
                 "test_memory_budget.py", "test_prefix_cache.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each file's own order kept
