"""The two more families over HTTP (issue 31.4), each a real server on its tiny float32 fixture
(`mlx_relay/testing/family_fixtures.py`): Qwen3 (mlx-lm; its template's Hermes-style JSON tool calls
and thinking blocks) and Gemma 3 (mlx-vlm; its template renders no tools, so the server writes them
into the prompt in the same JSON convention: `chat/tool_prompt.py`).

On each: a required tool call, its round trip (the call and its result rendered back through the
family's template), a named tool call streamed in spec-shaped deltas ending with its terminal
event, JSON-schema output, concurrent requests equal to each alone (continuous batching), a second
turn restored from the prefix cache with the same tokens as without it, and the metrics. Images on
Gemma 3 (its numpy processor, `media/gemma3.py`; the KV lane prefilling the model's own embeddings),
streamed to their terminal event and restored from the prefix cache when repeated; a 400 saying
why for images on a model without a served vision tower, and for video on Gemma 3.
"""

from __future__ import annotations

import base64
import io
import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import jsonschema
import numpy as np
import pytest
from PIL import Image

from mlx_relay.relay import default_config
from mlx_relay.testing import local_http
from mlx_relay.testing.family_fixtures import Family, family_fixture_path
from mlx_relay.testing.live_server import LiveServer

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6}, "count": {"type": "integer"}},
          "required": ["name", "count"], "additionalProperties": False}
TOOLS = [
    {"type": "function", "function": {
        "name": "read_file", "description": "Read a file",
        "parameters": {"type": "object", "properties": {"path": {"type": "string", "maxLength": 12},
                                                        "limit": {"type": "integer", "minimum": 0, "maximum": 999}},
                       "required": ["path", "limit"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "list_dir", "description": "List a directory",
        "parameters": {"type": "object", "properties": {"path": {"type": "string", "maxLength": 12}},
                       "required": ["path"], "additionalProperties": False}}},
]
SYSTEM = {"role": "system", "content": "You are a careful coding agent. Read before you write."}
USER = [SYSTEM, {"role": "user", "content": "Read the file src/main.py please"}]


@pytest.fixture(scope="module", params=["qwen3", "gemma3"])
def served(request: pytest.FixtureRequest) -> Iterator[tuple[Family, LiveServer]]:
    family: Family = request.param
    config = default_config(family_fixture_path(family), served_model_name="tiny", max_num_seqs=4, warmup=False)
    with LiveServer(config) as live:
        yield family, live


def chat(live: LiveServer, **body: Any) -> dict[str, Any]:
    r = local_http.post(live.url + "/v1/chat/completions", json={"model": "tiny", "temperature": 0, **body},
                        timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_capabilities_and_a_tool_round_trip(served: tuple[Family, LiveServer]) -> None:
    family, live = served
    (card,) = local_http.get(live.url + "/v1/models", timeout=10).json()["data"]
    assert card["capabilities"] == {"vision": family == "gemma3", "tools": True, "reasoning": family == "qwen3"}
    first = chat(live, messages=USER, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, max_tokens=200)
    choice = first["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    (call,) = choice["message"]["tool_calls"]
    assert call["id"].startswith("call_") and "<tool_call>" not in (choice["message"]["content"] or "")
    schema = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == call["function"]["name"])
    jsonschema.validate(json.loads(call["function"]["arguments"]), schema)
    history = [*USER, choice["message"], {"role": "tool", "tool_call_id": call["id"], "content": "print('hi')"}]
    second = chat(live, messages=history, tools=TOOLS, max_tokens=8)
    assert second["choices"][0]["finish_reason"] in ("stop", "length")
    assert second["usage"]["prompt_tokens"] > first["usage"]["prompt_tokens"]  # the call and its result are in


def test_a_named_call_streams_and_ends_with_its_terminal_event(served: tuple[Family, LiveServer]) -> None:
    _family, live = served
    body = {"model": "tiny", "messages": USER, "tools": TOOLS, "max_tokens": 200, "temperature": 0, "stream": True,
            "tool_choice": {"type": "function", "function": {"name": "list_dir"}}}
    arguments, names, finishes = "", [], []
    for chunk in stream_chunks(live, body):
        for c in chunk["choices"]:
            assert "<tool_call>" not in (c["delta"].get("content") or "")
            for tc in c["delta"].get("tool_calls") or []:
                names += [tc["function"]["name"]] if tc["function"].get("name") else []
                arguments += tc["function"].get("arguments", "")
            if c["finish_reason"]:
                finishes.append(c["finish_reason"])
    assert finishes == ["tool_calls"] and names == ["list_dir"]
    assert isinstance(json.loads(arguments)["path"], str)


def test_json_schema_output_is_valid(served: tuple[Family, LiveServer]) -> None:
    _family, live = served
    done = chat(live, messages=USER, max_tokens=200,
                response_format={"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA}})
    assert done["choices"][0]["finish_reason"] == "stop"
    jsonschema.validate(json.loads(done["choices"][0]["message"]["content"]), SCHEMA)


def test_batching_and_the_prefix_cache_give_each_requests_own_tokens(served: tuple[Family, LiveServer]) -> None:
    _family, live = served
    system = {"role": "system", "content": "Read before you write; keep every change small. " * 40}  # > 256 tokens
    asks = [[system, {"role": "user", "content": f"Task {i}: rename the variable " * (i + 1)}] for i in range(3)]
    alone = [chat(live, messages=m, max_tokens=10) for m in asks]
    with ThreadPoolExecutor(3) as pool:
        together = list(pool.map(lambda m: chat(live, messages=m, max_tokens=10), asks))
    texts = [r["choices"][0]["message"]["content"] for r in alone]
    assert [r["choices"][0]["message"]["content"] for r in together] == texts
    assert all(r["usage"]["completion_tokens"] == 10 for r in alone)
    # the same system prompt again (snapshotted by the first request): restored from the cache, the same tokens
    assert all(r["usage"]["prompt_tokens_details"]["cached_tokens"] > 0 for r in together)
    metrics = local_http.get(live.url + "/metrics", timeout=10).text
    assert 'mlx_relay:request_success_total{finished_reason="length",model_name="tiny"}' in metrics


def png_data_url(seed: int, size: tuple[int, int] = (40, 30)) -> str:
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def image_chat(seed: int, text: str) -> list[dict[str, Any]]:
    system = {"role": "system", "content": "Look at the picture closely, then answer briefly. " * 30}  # > 256 tokens
    return [system, {"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": png_data_url(seed)}}, {"type": "text", "text": text}]}]


def stream_chunks(live: LiveServer, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The chunks of a streamed chat completion (status 200); the stream must end with [DONE]."""
    chunks, lines = [], []
    with local_http.stream("POST", live.url + "/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read().decode()
        for line in r.iter_lines():
            if line.startswith("data: "):
                lines.append(line)
                if line != "data: [DONE]":
                    chunks.append(json.loads(line[6:]))
    assert lines[-1] == "data: [DONE]"
    return chunks


def stream_chat(live: LiveServer, **body: Any) -> tuple[str, list[str], dict[str, Any]]:
    """The streamed reply's text, its finish reasons and its usage; it must end with [DONE]."""
    body = {"model": "tiny", "temperature": 0, "stream": True, "stream_options": {"include_usage": True}, **body}
    text, finishes, usage = "", [], {}
    for chunk in stream_chunks(live, body):
        usage = chunk.get("usage") or usage
        for c in chunk["choices"]:
            text += c["delta"].get("content") or ""
            finishes += [c["finish_reason"]] if c["finish_reason"] else []
    return text, finishes, usage


def test_images_serve_on_gemma3_and_get_a_400_that_says_why_elsewhere(served: tuple[Family, LiveServer]) -> None:
    """Gemma 3: an image chat streams to its terminal event; asked again, the prompt up to the image
    is restored from the prefix cache (the media snapshot, keyed by the image's content) and the
    reply is the same; another image is not restored past the text before it. Video is refused.
    Qwen3 (a text model): images get a 400 that says why."""
    family, live = served
    if family != "gemma3":
        r = local_http.post(live.url + "/v1/chat/completions", timeout=60,
                       json={"model": "tiny", "messages": image_chat(1, "what is this?"), "max_tokens": 4})
        assert r.status_code == 400, r.text
        assert "vision" in r.json()["error"]["message"]
        return
    first, finishes, usage = stream_chat(live, messages=image_chat(1, "What is this?"), max_tokens=8)
    assert finishes == ["length"] and usage["completion_tokens"] == 8 and first
    again = chat(live, messages=image_chat(1, "What is this?"), max_tokens=8)
    assert again["choices"][0]["message"]["content"] == first
    cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached > 256  # past the image's tokens: everything up to the end of the image
    other = chat(live, messages=image_chat(2, "What is this?"), max_tokens=8)
    assert other["usage"]["prompt_tokens_details"]["cached_tokens"] < cached  # another image: not its snapshot
    assert other["choices"][0]["message"]["content"] != first
    video = [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}},
                                          {"type": "text", "text": "what happens?"}]}]
    r = local_http.post(live.url + "/v1/chat/completions", timeout=60,
                   json={"model": "tiny", "messages": video, "max_tokens": 4})
    assert r.status_code == 400, r.text
    assert "video is not served" in r.json()["error"]["message"]


def test_a_vlm_whose_media_no_processor_serves_is_named_in_its_400(tmp_path: Any) -> None:
    """No MLX: a VLM type without a media processor of ours (`media/served.py`) answers text; its
    images get a 400 naming the type and the types whose media are served."""
    from mlx_relay.media.served import load_media_processor, unserved_vision

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llava", "vision_config": {}}))
    assert unserved_vision(tmp_path) is None  # an empty vision_config: no tower
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llava", "vision_config": {"hidden_size": 8}}))
    message = unserved_vision(tmp_path)
    assert message is not None and "'llava'" in message and "gemma3" in message and "not served" in message
    assert load_media_processor(tmp_path) is None
    assert unserved_vision(family_fixture_path("gemma3")) is None


def test_seeded_sampling_repeats_and_logprobs_match_the_tokens(served: tuple[Family, LiveServer]) -> None:
    _family, live = served
    ask = {"messages": USER, "max_tokens": 8, "temperature": 0.9, "top_p": 0.9, "seed": 7}
    a, b = chat(live, **ask), chat(live, **ask)
    assert a["choices"][0]["message"]["content"] == b["choices"][0]["message"]["content"]
    lp = chat(live, messages=USER, max_tokens=6, logprobs=True, top_logprobs=2)
    content = lp["choices"][0]["logprobs"]["content"]
    assert len(content) == lp["usage"]["completion_tokens"] == 6
    assert all(len(t["top_logprobs"]) == 2 and t["logprob"] <= 0 for t in content)
    assert content[0]["logprob"] == max(t["logprob"] for t in content[0]["top_logprobs"])  # greedy: the top one
