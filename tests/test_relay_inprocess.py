"""The in-process API: the same actors without HTTP, on the float32 tiny model."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import anyio
import anyio.lowlevel
import pytest

from mlx_relay.chat.output import ContentDelta, ReasoningDelta, ReplyDone, ReplyStarted
from mlx_relay.chat.types import ChatMessage
from mlx_relay.errors import ContextLengthExceeded, InvalidRequest, ModelLoadError, Overloaded
from mlx_relay.messages.gpu import Finished, Generate, SamplingParams, TokenDelta
from mlx_relay.messages.prompt import Render
from mlx_relay.relay import Relay

PROMPTS = [
    "Hello there",
    "Write a function that adds two numbers",
    "What is MLX?",
    "def main():",
    "Explain continuous batching in one paragraph, please",
    "こんにちは",
    "import mlx.core as mx",
    "The quick brown fox",
]


def user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


async def prompt_ids(relay: Relay, text: str) -> list[int]:
    assert relay.service is not None
    rendered = await relay.service.actors.normalizer.request(Render([ChatMessage(role="user", content=text)]))
    return rendered.token_ids


async def test_concurrent_requests_return_exactly_the_raw_loop_tokens(relay: Relay, fp32_model: Path) -> None:
    max_tokens = 24
    ids = [await prompt_ids(relay, p) for p in PROMPTS]
    ref = await anyio.run_process(
        [sys.executable, "-m", "mlx_relay.testing.reference", str(fp32_model), str(max_tokens)],
        input=json.dumps(ids).encode(),
    )
    expected = json.loads(ref.stdout)

    got: dict[int, list[int]] = {}
    first_seven_decoding = anyio.Event()
    tokens_seen = [0]

    async def one(i: int) -> None:
        result = await relay.chat(user(PROMPTS[i]), max_tokens=max_tokens, temperature=0)
        got[i] = result.token_ids

    async def watched(i: int) -> None:
        async for _ in relay.stream_chat(user(PROMPTS[i]), max_tokens=max_tokens, temperature=0):
            tokens_seen[0] += 1
            if tokens_seen[0] >= 3:
                first_seven_decoding.set()
        got[i] = (await relay.chat(user(PROMPTS[i]), max_tokens=max_tokens, temperature=0)).token_ids

    async with anyio.create_task_group() as tg:
        tg.start_soon(watched, 0)
        for i in range(1, 7):
            tg.start_soon(one, i)
        await first_seven_decoding.wait()
        tg.start_soon(one, 7)  # inserted while the others decode
    assert [got[i] for i in range(8)] == expected


async def test_stream_chat_equals_chat(relay: Relay) -> None:
    for p in PROMPTS[:3]:
        full = await relay.chat(user(p), max_tokens=16, temperature=0)
        events = [ev async for ev in relay.stream_chat(user(p), max_tokens=16, temperature=0)]
        assert isinstance(events[0], ReplyStarted) and isinstance(events[-1], ReplyDone)
        assert "".join(ev.text for ev in events if isinstance(ev, ContentDelta)) == full.content
        assert "".join(ev.text for ev in events if isinstance(ev, ReasoningDelta)) == full.reasoning
        assert events[-1].completion_tokens == full.completion_tokens == len(full.token_ids) <= 16
        assert full.finish_reason == events[-1].finish_reason


async def test_cancelled_stream_frees_its_slot(relay: Relay) -> None:
    async def consume_a_little() -> None:
        async for _ in relay.stream_chat(user("go on forever"), max_tokens=3000, temperature=0.8, seed=2):
            await anyio.lowlevel.checkpoint()

    with anyio.move_on_after(0.3):
        await consume_a_little()
    with anyio.fail_after(10):
        while (await relay.stats()).running:
            await anyio.sleep(0.01)
    result = await relay.chat(user("next"), max_tokens=4, temperature=0)
    assert result.completion_tokens >= 1


async def test_one_bad_request_does_not_take_the_batch_down(relay: Relay) -> None:
    assert relay.service is not None
    gpu = relay.service.gpu
    good_prompts = PROMPTS[:3]
    alone = [(await relay.chat(user(p), max_tokens=16, temperature=0)).token_ids for p in good_prompts]

    outcomes: dict[str, object] = {}

    async def bad(name: str, tokens: list[int]) -> None:
        try:
            async with gpu.stream(Generate(name, tokens, SamplingParams(max_tokens=4))) as events:
                async for _ in events:
                    pass
            outcomes[name] = "ok"
        except InvalidRequest as exc:
            outcomes[name] = exc

    async def good(i: int) -> None:
        outcomes[f"good{i}"] = (await relay.chat(user(good_prompts[i]), max_tokens=16, temperature=0)).token_ids

    async with anyio.create_task_group() as tg:
        for i in range(3):
            tg.start_soon(good, i)
        tg.start_soon(bad, "empty", [])
        tg.start_soon(bad, "out-of-vocab", [1, 2, 10**9])
    assert isinstance(outcomes["empty"], InvalidRequest)
    assert isinstance(outcomes["out-of-vocab"], InvalidRequest)
    assert [outcomes[f"good{i}"] for i in range(3)] == alone


async def test_typed_errors_in_process(relay: Relay) -> None:
    with pytest.raises(ContextLengthExceeded):
        await relay.chat(user("word " * 6000), max_tokens=4)
    with pytest.raises(InvalidRequest):
        await relay.chat(user("hi"), max_tokens=0)
    with pytest.raises(InvalidRequest):
        await relay.chat(user("hi"), top_p=0.0)
    with pytest.raises(InvalidRequest):  # a system message carrying an image
        await relay.chat([{"role": "system", "content": [{"type": "image_url", "image_url": "data:,"}]},
                          {"role": "user", "content": "hi"}])
    # still serving
    assert (await relay.chat(user("hi"), max_tokens=2)).completion_tokens >= 1


async def test_admission_queue_bound(fp32_model: Path) -> None:
    async with Relay.start(fp32_model, max_num_seqs=1, max_queue=1, warmup=False) as small:
        assert small.service is not None
        started = anyio.Event()

        async def long_one() -> None:
            async for _ in small.stream_chat(user("long"), max_tokens=2000, temperature=0.9, seed=1):
                started.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(long_one)
            await started.wait()
            tg.start_soon(small.chat, user("queued"))  # waits in the queue (1 allowed)
            with anyio.fail_after(10):
                while (await small.stats()).queued < 1:
                    await anyio.sleep(0.01)
            with pytest.raises(Overloaded) as info:
                await small.chat(user("refused"))
            assert info.value.retry_after_s >= 1
            tg.cancel_scope.cancel()


async def test_finished_event_reports_usage(relay: Relay) -> None:
    assert relay.service is not None
    ids = await prompt_ids(relay, "usage")
    async with relay.service.gpu.stream(Generate("u", ids, SamplingParams(max_tokens=5))) as events:
        items = [ev async for ev in events]
    assert isinstance(items[-1], Finished)
    assert items[-1].prompt_tokens == len(ids)
    assert items[-1].completion_tokens == sum(len(e.token_ids) for e in items if isinstance(e, TokenDelta))


async def test_start_on_something_that_is_not_a_model(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"no config\.json"):
        async with Relay.start(tmp_path, warmup=False):
            pass
