"""No prompt runs the device out of memory (issue 43.4): the engine counts what the rows' caches may
hold (`memory/kv_budget.py`), a row joins only when its caches fit beside the running rows'
(decode batches pad every row to the longest), a prompt that cannot fit even alone is refused
before anything runs (a 400 in the route's shape naming the limit), and the prefill's attention
blocks are bounded from what the device leaves.

Counted in bytes, rows and events, never in time; on the CPU with MLX's memory limit
(`--memory-limit-gb`) set below what a long prompt needs: the engine in a process of its own, so
that the limit is that process's (as a GPU server runs it)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest

from mlx_relay.engine.lane_set import DEFAULT_STEP_ELSEWHERE
from mlx_relay.engine.memory.kv_budget import LAYERS_IN_FLIGHT, KVBudget, plan, working_set_bytes
from mlx_relay.messages.gpu import Generate, SamplingParams
from mlx_relay.testing import local_http
from mlx_relay.testing.engine_driver import Driver
from mlx_relay.testing.reference import greedy_reference

MIB = 1 << 20


def test_a_batch_counts_every_row_at_the_longest() -> None:
    budget = KVBudget(limit=1000 * MIB, weights=200 * MIB, prefix_cache=100 * MIB, working_set=100 * MIB,
                      per_token=1024, per_row=MIB)
    assert budget.available == 600 * MIB
    assert budget.batch_bytes(3, 1000) == 4 * (MIB + 1000 * 1024)  # three rows run as a batch of four
    assert budget.memory_tokens == (600 * MIB - MIB) // 1024
    assert budget.fits([budget.memory_tokens])  # alone, at the most it holds
    assert not budget.fits([budget.memory_tokens, 10])  # a short row beside it pads to its length
    assert budget.fits([1000] * 64)
    assert budget.fits([])


def test_the_plan_bounds_the_attention_block_from_what_is_left() -> None:
    config = {"text_config": {"model_type": "qwen3_5_moe_text", "hidden_size": 2048, "num_hidden_layers": 40,
                              "full_attention_interval": 4, "num_attention_heads": 16, "num_key_value_heads": 2,
                              "head_dim": 256, "linear_num_key_heads": 16, "linear_num_value_heads": 32,
                              "linear_key_head_dim": 128, "linear_value_head_dim": 128, "num_experts": 256,
                              "moe_intermediate_size": 512, "dtype": "bfloat16"}}
    gib = 1 << 30
    h100, options = plan(config, limit=76 * gib, weights=39 * gib, prefix_cache=15 * gib, chunk_tokens=2048,
                         experts="dequantize", mtp_head=True)
    assert options.attention_bytes == (76 - 39 - 15) * gib // 8
    assert h100.per_token == 11 * 2 * 2 * 256 * 2  # ten attention layers and the head's, keys and values
    assert h100.working_set == working_set_bytes(chunk_tokens=2048, hidden=2048,
                                                 attention_bytes=options.attention_bytes,
                                                 expert_bytes=256 * 512 * 2048 * 2, itemsize=2)
    assert h100.memory_tokens > 262_144  # one row of the whole context fits on an 80 GB card
    assert h100.fits([4096] * 64) and not h100.fits([4096] * 63 + [131_072])  # not 64 rows padded to 128K
    small, small_options = plan(config, limit=45 * gib, weights=39 * gib, prefix_cache=5 * gib, chunk_tokens=2048,
                                experts="dequantize", mtp_head=True)
    assert small_options.attention_bytes == 256 * MIB and small.available == 0 and small.memory_tokens == 0


@pytest.fixture(scope="module")
def loaded(gpu: Callable, fp32_model: Path) -> Any:
    from mlx_relay.engine.models.loader import load_model

    return gpu(lambda: load_model(fp32_model))


def _limit_for(loaded: Any, probe: KVBudget, chunk_tokens: int, tokens: int) -> int:
    """The least memory limit under which an engine like `probe`'s (its weights, its prefix cache)
    holds a lone row of `tokens` tokens: found with the engine's own arithmetic (`plan`)."""
    from mlx_relay.engine.models.checkpoint import read_config

    config = read_config(Path(loaded.info.model_path))

    def budget(limit: int) -> KVBudget:
        b, _ = plan(config, limit=limit, weights=probe.weights, prefix_cache=probe.prefix_cache,
                    chunk_tokens=chunk_tokens, experts="library", mtp_head=probe.per_token > plan(
                        config, limit=limit, weights=0, prefix_cache=0, chunk_tokens=1, experts="library",
                        mtp_head=False)[0].per_token)
        return b

    low, high = probe.weights, probe.weights + probe.prefix_cache + (64 << 30)
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if budget(mid).memory_tokens < tokens else (low, mid)
    assert budget(high).per_token == probe.per_token
    return high


def test_a_row_waits_until_its_caches_fit_beside_the_running_ones(gpu: Callable, loaded: Any) -> None:
    """Two rows whose caches fit one at a time: the second joins when the first has ended, and
    both decode as they do alone."""
    prompts = [[(7 * i + 3) % 990 + 5 for i in range(1000)], [(11 * i + 5) % 990 + 5 for i in range(1000)]]
    max_tokens = 12
    row = 1000 + max_tokens

    def run() -> tuple[Any, ...]:
        d = Driver(loaded, prefill_step_size=64)
        measured = d.engine.kv_budget
        assert measured is not None
        # the engine's own budget with room for one row and half another, not for a batch of two
        # (the limit set from what this engine measured, not from a second engine's measure: what
        # MLX holds in this test process moves with the other tests)
        held = measured.weights + measured.prefix_cache + measured.working_set
        budget = msgspec.structs.replace(measured, limit=held + measured.batch_bytes(1, row) * 3 // 2)
        assert budget.fits([row]) and not budget.fits([row, row])
        d.engine.scheduler.budget = budget
        sids = [d.add(Generate(request_id=f"r{i}", prompt_tokens=p, sampling=SamplingParams(max_tokens=max_tokens)))
                for i, p in enumerate(prompts)]
        first_done_at = second_started_at = None
        while d.engine.has_work:
            d.step()
            if first_done_at is None and sids[0] in d.finished:
                first_done_at = d.steps
            if second_started_at is None and d.tokens[sids[1]]:
                second_started_at = d.steps
        return (d.engine.scheduler.memory_waits, first_done_at, second_started_at,
                [d.tokens[s] for s in sids], greedy_reference(Path(loaded.info.model_path), prompts, max_tokens))

    waits, first_done_at, second_started_at, tokens, reference = gpu(run)
    assert waits > 0
    assert first_done_at is not None and second_started_at is not None and second_started_at > first_done_at
    assert tokens == reference


def _post(url: str, path: str, body: dict[str, Any]) -> httpx.Response:
    return local_http.post(url + path, json=body, timeout=120)


def _text_of(url: str, low: int, high: int) -> str:
    """A user message whose prompt has more than `low` tokens and fewer than `high`, as the server
    counts them (a line through two counts: the template's own tokens, then the text's)."""

    def count(n: int) -> int:
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi " * n}]}
        return int(_post(url, "/v1/messages/count_tokens", body).json()["input_tokens"])

    c100, c300 = count(100), count(300)
    per = (c300 - c100) / 200
    n = int(100 + ((low + high) / 2 - c100) / per)
    assert low < count(n) < high
    return "hi " * n


def test_a_prompt_past_the_memory_is_refused_before_it_runs(gpu: Callable, loaded: Any, fp32_model: Path) -> None:
    """MLX's memory limit set so that one request's caches hold about 1,000 tokens of the
    fixture's 4K context: a longer prompt gets the route's context error naming the limit
    (OpenAI's shape on /v1/chat/completions, Anthropic's on /v1/messages), a request that fits
    beside it runs, and the server goes on serving."""
    from mlx_relay.engine.models.checkpoint import read_config
    from mlx_relay.relay import default_config
    from mlx_relay.testing.live_server import LiveServer

    # what the engine's process holds (the weights, and the prefix cache's budget) is read off a
    # first start under a limit far above it (this test process's MLX holds other tests' arrays):
    # its memory_tokens, less its caches' and working set's bytes
    probe = gpu(lambda: Driver(loaded, memory_limit_bytes=1 << 40).engine.kv_budget)
    chunk = DEFAULT_STEP_ELSEWHERE  # the CPU's prefill step
    config = default_config(fp32_model, served_model_name="tiny", engine_process="on", warmup=False,
                            memory_limit_bytes=1 << 40)
    with LiveServer(config) as first:
        assert first.relay is not None and first.relay.info is not None
        roomy = first.relay.info.memory_tokens
    working = plan(read_config(fp32_model), limit=1 << 40, weights=0, prefix_cache=0, chunk_tokens=chunk,
                   experts="library", mtp_head=False)[0].working_set
    held = (1 << 40) - working - probe.per_row - roomy * probe.per_token
    engine = msgspec.structs.replace(probe, weights=held, prefix_cache=0)
    config = msgspec.structs.replace(config, engine=msgspec.structs.replace(
        config.engine, memory_limit_bytes=_limit_for(loaded, engine, chunk, 1000)))
    with LiveServer(config) as live:
        relay = live.relay
        assert relay is not None and relay.info is not None
        memory = relay.info.memory_tokens
        assert 500 < memory < relay.info.context_length
        words = _text_of(live.url, memory, relay.info.context_length)  # past the memory, within the context
        too_long = _post(live.url, "/v1/chat/completions", {"model": "tiny", "max_tokens": 4,
                                                            "messages": [{"role": "user", "content": words}]})
        assert too_long.status_code == 400
        error = too_long.json()["error"]
        assert error["code"] == "context_length_exceeded"
        assert f"at most {memory} tokens" in error["message"] and "memory limit" in error["message"]
        anthropic = _post(live.url, "/v1/messages", {"model": "tiny", "max_tokens": 4,
                                                     "messages": [{"role": "user", "content": words}]})
        assert anthropic.status_code == 400
        assert anthropic.json()["error"]["type"] == "invalid_request_error"
        assert "prompt is too long" in anthropic.json()["error"]["message"]
        fits = _post(live.url, "/v1/chat/completions",
                     {"model": "tiny", "max_tokens": 8, "messages": [{"role": "user", "content": "hello there"}]})
        assert fits.status_code == 200 and fits.json()["usage"]["completion_tokens"] > 0
        clamped = _post(live.url, "/v1/chat/completions",
                        {"model": "tiny", "max_tokens": 100_000, "messages": [{"role": "user", "content": "hi"}]})
        assert clamped.status_code == 200  # max_tokens past the memory is cut there (the clamp policy)


def test_the_experts_path_is_configured_and_only_dequantizing_holds_float_experts() -> None:
    from mlx_relay.engine.models.prefill_options import PrefillOptions, prefill_experts

    assert prefill_experts("auto", "cpu") == prefill_experts("kernel", "cpu") == "library"
    assert prefill_experts("auto", "cuda") == prefill_experts("narrow", "cuda") == "narrow"
    assert prefill_experts("kernel", "cuda") == "kernel"
    assert prefill_experts("dequantize", "cuda") == "dequantize"
    kernel = PrefillOptions().with_experts("kernel")
    assert kernel.grouped_experts and kernel.quantized_kernel and not kernel.narrow_kernel
    narrow = PrefillOptions().with_experts("narrow")
    assert narrow.grouped_experts and narrow.quantized_kernel and narrow.narrow_kernel
    assert not PrefillOptions().with_experts("library").grouped_experts
    config = {"text_config": {"model_type": "qwen3_5_moe_text", "hidden_size": 2048, "num_hidden_layers": 40,
                              "num_experts": 256, "moe_intermediate_size": 512, "dtype": "bfloat16"},
              "quantization": {"bits": 8, "group_size": 64}}
    four_bit = {**config, "quantization": {"bits": 4, "group_size": 64}}
    assert plan(four_bit, limit=76 << 30, weights=39 << 30, prefix_cache=0, chunk_tokens=2048, experts="kernel",
                mtp_head=False)[0].working_set == plan(four_bit, limit=76 << 30, weights=39 << 30, prefix_cache=0,
                                                        chunk_tokens=2048, experts="dequantize",
                                                        mtp_head=False)[0].working_set
    sets = {e: plan(config, limit=76 << 30, weights=39 << 30, prefix_cache=0, chunk_tokens=2048, experts=e,
                    mtp_head=False)[0].working_set for e in ("dequantize", "kernel", "narrow", "library")}
    assert sets["narrow"] == sets["kernel"]  # both read the 8-bit experts in place
    assert sets["dequantize"] - sets["kernel"] == LAYERS_IN_FLIGHT * 3 * 256 * 512 * 2048 * 2
    assert sets["kernel"] == sets["library"]
