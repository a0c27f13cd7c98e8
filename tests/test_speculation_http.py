"""The `speculation` request extension and the usage's drafts per source, on every wire format.

Over real HTTP on the float32 tiny model (the shared server): each format takes
`{"method", "max_draft_tokens"}` and refuses a bad value with a 400 in its own error shape, and
its usage (non-streamed and streamed) reports the drafts per source. How many drafts a request
gets and how many are accepted is the engine's business (it picks round by round, by what each
source earned), so those checks hold for any count. The usage builders themselves get exact
counts from `ReplyDone` values, and the service its checks and the copy into `SamplingParams`.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import msgspec
import pytest

from mlx_relay.chat.output import Drafts, ReplyDone, ReplyStarted, SourceDrafts
from mlx_relay.chat.reply import ReplyCollector
from mlx_relay.errors import DraftModelUnavailable, InvalidRequest
from mlx_relay.http.formats.anthropic.encoder import StreamBlocks
from mlx_relay.http.formats.anthropic.types import MessageDelta
from mlx_relay.http.formats.anthropic.types import usage_of as anthropic_usage
from mlx_relay.http.formats.openai_chat.encoder import ChatStream
from mlx_relay.http.formats.openai_chat.types import total_usage, usage_of
from mlx_relay.http.formats.openai_completions.types import completion_usage
from mlx_relay.http.formats.responses.encoder import ResponseAssembler
from mlx_relay.http.formats.responses.types import ResponseObject, TextConfig, TextFormat
from mlx_relay.http.formats.speculation import speculation_of
from mlx_relay.messages.gpu import Finished, ModelInfo
from mlx_relay.service import Actors, ChatRequest, ChatService, ReplyTally, SamplingDefaults, _parsed
from mlx_relay.testing import local_http
from mlx_relay.testing.live_server import LiveServer

USER = [{"role": "user", "content": "Repeat after me: " + "alpha beta gamma delta epsilon zeta eta theta " * 24}]
FORMATS = ["chat", "completions", "responses", "messages"]


def body_of(fmt: str, extra: dict[str, Any], *, stream: bool = False, max_tokens: int = 16) -> tuple[str, dict]:
    """(path, body) of a small greedy request in format `fmt`."""
    common: dict[str, Any] = {"model": "tiny", "temperature": 0, **extra}
    if stream:
        common["stream"] = True
    if fmt == "chat":
        if stream:
            common["stream_options"] = {"include_usage": True}
        return "/v1/chat/completions", {"messages": USER, "max_tokens": max_tokens, **common}
    if fmt == "completions":
        if stream:
            common["stream_options"] = {"include_usage": True}
        return "/v1/completions", {"prompt": USER[0]["content"], "max_tokens": max_tokens, **common}
    if fmt == "responses":
        return "/v1/responses", {"input": USER[0]["content"], "max_output_tokens": max_tokens, **common}
    return "/v1/messages", {"messages": USER, "max_tokens": max_tokens, **common}


def stream_usage(fmt: str, frames: list[dict[str, Any]]) -> dict[str, Any]:
    """The final usage a format's stream carries."""
    if fmt in ("chat", "completions"):
        return [f for f in frames if f.get("usage")][-1]["usage"]
    if fmt == "responses":
        end = next(f for f in frames if f["type"] in ("response.completed", "response.incomplete"))
        return end["response"]["usage"]
    return next(f for f in frames if f["type"] == "message_delta")["usage"]


def usage(server: LiveServer, fmt: str, extra: dict[str, Any], *, stream: bool = False) -> dict[str, Any]:
    path, body = body_of(fmt, extra, stream=stream)
    if not stream:
        r = local_http.post(server.url + path, json=body, timeout=120)
        assert r.status_code == 200, r.text
        return r.json()["usage"]
    frames = []
    with local_http.stream("POST", server.url + path, json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                frames.append(json.loads(line[len("data: "):]))
    return stream_usage(fmt, frames)


def check_sources(use: dict[str, Any], method: str) -> None:
    """The usage's `speculation`: only the sources that drafted, each drafted >= accepted >= 0 and
    its acceptance their ratio; no source the method rules out; OpenAI's `mtp` key agrees."""
    spec = use.get("speculation")
    if spec is not None:
        assert spec and set(spec) <= {"mtp", "context"}, spec
        for counts in spec.values():
            assert set(counts) == {"drafted", "accepted", "acceptance"}
            assert counts["drafted"] > 0 and 0 <= counts["accepted"] <= counts["drafted"]
            assert counts["acceptance"] == round(counts["accepted"] / counts["drafted"], 4)
    sources = set(spec or {})
    if method == "none":
        assert not sources
    elif method == "context":
        assert "mtp" not in sources
    elif method == "mtp":
        assert "context" not in sources
    if "prompt_tokens_details" in use:  # OpenAI's usage: the `mtp` key stays as it was, the same counts
        mtp = use.get("mtp")
        assert (mtp is None) == ("mtp" not in sources)
        if mtp is not None:
            assert (mtp["draft_tokens"], mtp["accepted_tokens"]) == (spec["mtp"]["drafted"], spec["mtp"]["accepted"])


# -- over HTTP -------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("stream", [False, True], ids=["body", "stream"])
def test_each_format_takes_speculation_and_reports_the_drafts_per_source(server: LiveServer, fmt: str,
                                                                         stream: bool) -> None:
    for method in ("context", "mtp", "none"):
        check_sources(usage(server, fmt, {"speculation": {"method": method, "max_draft_tokens": 4}}, stream=stream),
                      method)
    check_sources(usage(server, fmt, {"speculation": {"max_draft_tokens": 0}}, stream=stream), "auto")
    check_sources(usage(server, fmt, {}, stream=stream), "auto")  # no extension: the server's default


def test_mtp_false_still_opts_out_of_the_head_beside_speculation(server: LiveServer) -> None:
    use = usage(server, "chat", {"mtp": False, "speculation": {"method": "auto"}})
    check_sources(use, "context")  # the head is off: context drafts at most
    assert "mtp" not in use


BAD = [
    ("fast", "speculation"),
    (["context"], "speculation"),
    ({"method": "fast"}, "speculation.method"),
    ({"method": 3}, "speculation.method"),
    ({"max_draft_tokens": 17}, "speculation.max_draft_tokens"),
    ({"max_draft_tokens": -1}, "speculation.max_draft_tokens"),
    ({"max_draft_tokens": "many"}, "speculation.max_draft_tokens"),
    ({"max_draft_tokens": 2.5}, "speculation.max_draft_tokens"),
    ({"max_draft_tokens": True}, "speculation.max_draft_tokens"),
]


@pytest.mark.parametrize("fmt", FORMATS)
def test_bad_speculation_is_a_400_in_the_formats_error_shape(server: LiveServer, fmt: str) -> None:
    for value, param in [*BAD, ({"method": "draft"}, "speculation.method")]:
        path, body = body_of(fmt, {"speculation": value}, max_tokens=2)
        r = local_http.post(server.url + path, json=body, timeout=60)
        assert r.status_code == 400, (value, r.status_code, r.text)
        err = r.json()
        if fmt == "messages":  # Anthropic's shape
            assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error", err
            assert "speculation" in err["error"]["message"], err
        else:
            assert err["error"]["type"] == "invalid_request_error" and err["error"]["param"] == param, (value, err)
        if value == {"method": "draft"}:
            text = err["error"]["message"]
            assert "draft model" in text and "--draft-model" in text, text
            if fmt != "messages":
                assert err["error"]["code"] == "draft_model_unavailable"


def test_lax_numbers_as_the_body_reads_them(server: LiveServer) -> None:
    for count in (2.0, "2"):
        check_sources(usage(server, "chat", {"speculation": {"method": "context", "max_draft_tokens": count}}),
                      "context")


# -- the parts on their own ------------------------------------------------------------------------

BOTH = ReplyDone("length", 20, 16, drafts=Drafts(mtp=SourceDrafts(10, 7), context=SourceDrafts(4, 1)))
CONTEXT = ReplyDone("stop", 20, 5, drafts=Drafts(context=SourceDrafts(3, 3)))
DRAFT = ReplyDone("stop", 20, 5, drafts=Drafts(draft=SourceDrafts(6, 5)))
NONE = ReplyDone("stop", 20, 5)
BOTH_SOURCES = {"mtp": {"drafted": 10, "accepted": 7, "acceptance": 0.7},
                "context": {"drafted": 4, "accepted": 1, "acceptance": 0.25}}


def builtins(value: object) -> Any:
    return msgspec.json.decode(msgspec.json.encode(value))


def test_openai_usage_reports_each_source_beside_the_mtp_key() -> None:
    use = builtins(usage_of(BOTH))
    assert use["speculation"] == BOTH_SOURCES
    assert use["mtp"] == {"draft_tokens": 10, "accepted_tokens": 7, "acceptance_rate": 0.7}
    use = builtins(usage_of(CONTEXT))
    assert use["speculation"] == {"context": {"drafted": 3, "accepted": 3, "acceptance": 1.0}} and "mtp" not in use
    assert "speculation" not in builtins(usage_of(NONE))
    assert builtins(usage_of(DRAFT))["speculation"] == {"draft": {"drafted": 6, "accepted": 5, "acceptance": 0.8333}}
    # n choices: the drafts of every choice
    summed = builtins(total_usage([BOTH, CONTEXT]))["speculation"]
    assert summed["context"] == {"drafted": 7, "accepted": 4, "acceptance": round(4 / 7, 4)}
    assert summed["mtp"] == BOTH_SOURCES["mtp"]
    # legacy completions: every prompt's choices
    assert builtins(completion_usage({0: BOTH, 1: CONTEXT}, 1))["speculation"] == summed
    assert "speculation" not in builtins(completion_usage({0: NONE, 1: NONE}, 2))


def test_streamed_usage_chunk_reports_each_source() -> None:
    stream = ChatStream(1, "chatcmpl-x", "tiny", include_usage=True, want_logprobs=False)
    stream.event(0, BOTH)
    usage_frame = stream.end()[0].decode()
    assert json.loads(usage_frame[len("data: "):])["usage"]["speculation"] == BOTH_SOURCES


def test_anthropic_usage_and_message_delta_report_each_source() -> None:
    assert builtins(anthropic_usage(BOTH))["speculation"] == BOTH_SOURCES
    assert "speculation" not in builtins(anthropic_usage(NONE))
    blocks = StreamBlocks("msg_x", "tiny")
    events = [*blocks.feed(ReplyStarted(20)), *blocks.feed(BOTH)]
    delta = next(e for e in events if isinstance(e, MessageDelta))
    assert builtins(delta.usage)["speculation"] == BOTH_SOURCES
    assert "speculation" not in builtins(events[0])["message"]["usage"]  # message_start: nothing drafted yet


def test_responses_usage_reports_each_source() -> None:
    def finished(done: ReplyDone) -> dict[str, Any]:
        response = ResponseObject(id="resp_x", created_at=0, status="in_progress", model="tiny", output=[],
                                  parallel_tool_calls=True, tool_choice="auto", tools=[],
                                  text=TextConfig(TextFormat("text")), store=True)
        assembler = ResponseAssembler(response)
        assembler.feed(done)
        return builtins(assembler.response)["usage"]

    assert finished(CONTEXT)["speculation"] == {"context": {"drafted": 3, "accepted": 3, "acceptance": 1.0}}
    assert "speculation" not in finished(NONE)


def test_the_in_process_reply_carries_each_source() -> None:
    fold = ReplyCollector()
    fold.feed(BOTH)
    reply = fold.reply()
    assert reply.drafts == BOTH.drafts and (reply.mtp_drafted, reply.usage.mtp_accepted) == (10, 7)


async def test_the_service_carries_the_engines_counts_into_reply_done() -> None:
    async def events() -> AsyncIterator[Finished]:
        yield Finished("stop", 12, 6, drafts=Drafts(SourceDrafts(5, 2), SourceDrafts(8, 6), SourceDrafts(3, 1)))

    out = [ev async for ev in _parsed(ReplyStarted(12), events(), None, ReplyTally())]
    done = out[-1]
    assert isinstance(done, ReplyDone)
    assert done.drafts == Drafts(SourceDrafts(5, 2), SourceDrafts(8, 6), SourceDrafts(3, 1))


def _service() -> ChatService:
    info = ModelInfo("tiny", "qwen3_5", "cpu", 4096, 1000, [0], False, True, 0.0)
    actors = Actors(None, None, None, None)  # type: ignore[arg-type]  # sampling_for asks no actor
    return ChatService(actors, info, SamplingDefaults(), default_max_tokens=64)


def test_sampling_params_get_the_requests_speculation() -> None:
    service = _service()
    params = service.sampling_for(ChatRequest(messages=[], speculation="context", max_draft_tokens=3), 10)
    assert (params.speculation, params.max_draft_tokens) == ("context", 3)
    params = service.sampling_for(ChatRequest(messages=[], mtp=False), 10)
    assert (params.speculation, params.max_draft_tokens, params.mtp) == (None, None, False)  # the server's default
    with pytest.raises(DraftModelUnavailable) as draft:
        service.sampling_for(ChatRequest(messages=[], speculation="draft"), 10)
    assert draft.value.status == 400 and draft.value.param == "speculation.method"
    for req, param in [(ChatRequest(messages=[], speculation="fast"), "speculation.method"),
                       (ChatRequest(messages=[], max_draft_tokens=17), "speculation.max_draft_tokens")]:
        with pytest.raises(InvalidRequest) as bad:
            service.sampling_for(req, 10)
        assert bad.value.param == param and not isinstance(bad.value, DraftModelUnavailable)


def test_speculation_of_reads_the_wire_value() -> None:
    assert speculation_of(None) == speculation_of({})
    assert speculation_of({"method": "mtp", "max_draft_tokens": 4.0, "other": 1}).max_draft_tokens == 4
    assert speculation_of({"max_draft_tokens": "4"}).max_draft_tokens == 4
    for value, param in BAD:
        if param == "speculation.method" and isinstance(value, dict) and isinstance(value.get("method"), str):
            continue  # a string method is checked with the rest of the request (`validate_request`)
        if param == "speculation.max_draft_tokens" and isinstance(value, dict) \
                and isinstance(value.get("max_draft_tokens"), int) and not isinstance(value["max_draft_tokens"], bool):
            continue  # the range too
        with pytest.raises(InvalidRequest) as bad:
            speculation_of(value)
        assert bad.value.param == param, value
