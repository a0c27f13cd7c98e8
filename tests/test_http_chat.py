"""OpenAI chat over real HTTP (uvicorn on a loopback port) on the float32 tiny model."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from mlx_relay.chat.output import ContentDelta, ReplyDone, ToolCallArguments, ToolCallEnd, ToolCallStart
from mlx_relay.chat.reply_parser import ReplyParser
from mlx_relay.chat.types import FunctionDef, ToolDef
from mlx_relay.errors import GenerationFailed
from mlx_relay.http.formats.openai_chat.encoder import ChatStream
from mlx_relay.relay import default_config
from mlx_relay.testing import local_http
from mlx_relay.testing.live_server import LiveServer

PROMPTS = [
    "Hello there",
    "Write a function that adds two numbers",
    "What is MLX?",
    "def main():",
    "Explain continuous batching in one paragraph, please, with an example of two requests",
    "こんにちは、元気ですか",
    "import mlx.core as mx",
    "The quick brown fox jumps over the lazy dog",
]


def chat(url: str, content: str, **extra: object) -> httpx.Response:
    body = {"model": "tiny", "messages": [{"role": "user", "content": content}], "temperature": 0, **extra}
    return local_http.post(url + "/v1/chat/completions", json=body, timeout=120)


def stream_text(url: str, content: str, **extra: object) -> tuple[str, str | None, list[dict]]:
    """Returns (text, finish_reason, chunks) and checks the stream's framing."""
    body = {"model": "tiny", "messages": [{"role": "user", "content": content}], "temperature": 0,
            "stream": True, **extra}
    chunks: list[dict] = []
    done = False
    with local_http.stream("POST", url + "/v1/chat/completions", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if not line or line.startswith(":"):
                continue
            assert line.startswith("data: ")
            payload = line[len("data: "):]
            if payload == "[DONE]":
                done = True
                continue
            assert not done, "nothing may follow [DONE]"
            chunk = json.loads(payload)
            assert chunk["object"] == "chat.completion.chunk" and chunk["id"] and chunk["model"]
            chunks.append(chunk)
    assert done, "stream must end with data: [DONE]"
    finish = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert len(finish) == 1, "exactly one chunk carries the finish_reason"
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    return text, finish[0], chunks


def reference_tokens(model: Path, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Greedy tokens from the raw mlx-vlm loop, in a separate process."""
    out = subprocess.run(
        [sys.executable, "-m", "mlx_relay.testing.reference", str(model), str(max_tokens)],
        input=json.dumps(prompts), capture_output=True, text=True, check=True, timeout=300,
    )
    return json.loads(out.stdout)


def test_health_models_and_basic_chat(server: LiveServer) -> None:
    health = local_http.get(server.url + "/health").json()
    assert health["status"] == "ready" and health["backend"] in ("cpu", "metal", "cuda")
    assert (health["max_num_seqs"], health["max_queue"]) == (8, 32) and health["queued"] == 0
    models = local_http.get(server.url + "/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == "tiny"
    card = models["data"][0]
    assert card["context_length"] == card["max_model_len"] > 0
    assert card["capabilities"] == {"vision": True, "tools": True, "reasoning": True}
    assert local_http.get(server.url + "/v1/models/tiny").json() == card
    r = chat(server.url, "Hello there", max_tokens=8)
    assert r.status_code == 200
    body = r.json()
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["finish_reason"] in ("stop", "length")
    assert body["usage"]["completion_tokens"] <= 8
    assert body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"] + body["usage"]["completion_tokens"]
    assert body["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def test_concurrent_greedy_requests_equal_each_alone(server: LiveServer) -> None:
    max_tokens = 24
    alone = [chat(server.url, p, max_tokens=max_tokens).json()["choices"][0]["message"]["content"] for p in PROMPTS]
    results: dict[int, str] = {}
    started = threading.Event()
    running_seen: list[int] = []

    def run(i: int) -> None:
        text, _, _ = stream_text(server.url, PROMPTS[i], max_tokens=max_tokens)
        results[i] = text

    def first_seven() -> None:
        # 7 requests decode together ...
        threads = [threading.Thread(target=run, args=(i,)) for i in range(7)]
        for t in threads:
            t.start()
        started.set()
        for t in threads:
            t.join()

    outer = threading.Thread(target=first_seven)
    outer.start()
    started.wait()
    # ... and the 8th joins while they are in flight.
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        running = local_http.get(server.url + "/health").json()["running"]
        if running >= 2:
            running_seen.append(running)
            break
        time.sleep(0.005)
    run(7)
    outer.join()
    assert running_seen, "the requests never ran concurrently"
    assert [results[i] for i in range(8)] == alone


def test_stream_and_non_stream_agree(server: LiveServer) -> None:
    for prompt in PROMPTS[:3]:
        full = chat(server.url, prompt, max_tokens=16).json()
        text, finish, chunks = stream_text(server.url, prompt, max_tokens=16,
                                           stream_options={"include_usage": True})
        assert text == full["choices"][0]["message"]["content"]
        assert finish == full["choices"][0]["finish_reason"]
        assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
        usage_chunks = [c for c in chunks if c.get("usage")]
        assert len(usage_chunks) == 1 and usage_chunks[0]["choices"] == []
        # the drafts per source (the head's too) are the engine's choice, round by round (by what
        # each source earned and what a round costs): the tokens are what must agree
        streamed, whole = ({k: v for k, v in u.items() if k not in ("speculation", "mtp")}
                           for u in (usage_chunks[0]["usage"], full["usage"]))
        assert streamed == whole


def test_mtp_usage_extension_and_opt_out(server: LiveServer) -> None:
    """Text requests decode with MTP (the fixture has an mtp.* head): usage.mtp reports drafts and
    acceptance; `"mtp": false` opts out and gives the same greedy text."""
    on = chat(server.url, PROMPTS[0], max_tokens=12).json()
    mtp = on["usage"]["mtp"]
    assert mtp["draft_tokens"] > 0 and 0 <= mtp["accepted_tokens"] <= mtp["draft_tokens"]
    assert mtp["acceptance_rate"] == round(mtp["accepted_tokens"] / mtp["draft_tokens"], 4)
    off = chat(server.url, PROMPTS[0], max_tokens=12, mtp=False).json()
    assert "mtp" not in off["usage"]
    assert off["choices"][0]["message"]["content"] == on["choices"][0]["message"]["content"]
    bad = local_http.post(server.url + "/v1/chat/completions", timeout=60,
                     json={"messages": [{"role": "user", "content": "x"}], "mtp": "no"})
    assert bad.status_code == 422 and bad.json()["error"]["param"] == "mtp"


def test_stop_strings_and_seeded_sampling(server: LiveServer) -> None:
    base = chat(server.url, PROMPTS[1], max_tokens=24).json()["choices"][0]["message"]["content"]
    stop = base[5:8]
    r = chat(server.url, PROMPTS[1], max_tokens=24, stop=[stop]).json()
    assert r["choices"][0]["finish_reason"] == "stop"
    assert r["choices"][0]["message"]["content"] == base[: base.index(stop)]
    text, finish, _ = stream_text(server.url, PROMPTS[1], max_tokens=24, stop=stop)
    assert (text, finish) == (base[: base.index(stop)], "stop")
    sampled = [
        chat(server.url, PROMPTS[2], max_tokens=16, temperature=0.9, top_p=0.95, top_k=50, min_p=0.01, seed=s)
        .json()["choices"][0]["message"]["content"]
        for s in (7, 7, 8)
    ]
    assert sampled[0] == sampled[1], "the same seed must give the same sample"
    assert sampled[0] != sampled[2]


def test_matches_the_raw_library_loop(server: LiveServer, fp32_model: Path) -> None:
    """Token for token, our batched engine equals mlx-vlm's plain single-sequence loop."""
    from mlx_relay.actors.normalizer import load_tokenizer

    tok = load_tokenizer(fp32_model)
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
        for p in PROMPTS[:4]
    ]
    ids = [tok.encode(p, add_special_tokens=False) for p in prompts]
    expected = reference_tokens(fp32_model, ids, 20)
    for prompt, ref in zip(PROMPTS[:4], expected, strict=True):
        r = chat(server.url, prompt, max_tokens=20).json()
        assert r["choices"][0]["message"]["content"] == tok.decode(ref, skip_special_tokens=True)


def test_agent_message_sequences_render(server: LiveServer) -> None:
    sequences = [
        [{"role": "system", "content": "a"}, {"role": "system", "content": "b"},
         {"role": "user", "content": "c"}, {"role": "user", "content": "d"}],
        [{"role": "developer", "content": "be terse"}, {"role": "user", "content": "hi"}],
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
         {"role": "system", "content": "reminder: be brief"}, {"role": "user", "content": "again"}],
        [{"role": "system", "content": "tools"}, {"role": "user", "content": "list files"},
         {"role": "assistant", "content": None,
          "tool_calls": [{"id": "c1", "type": "function",
                          "function": {"name": "ls", "arguments": "{\"path\": \".\"}"}}]},
         {"role": "tool", "tool_call_id": "c1", "content": "a.py"},
         {"role": "system", "content": "mid-conversation system"},
         {"role": "user", "content": [{"type": "text", "text": "thanks"}]}],
    ]
    for messages in sequences:
        r = local_http.post(server.url + "/v1/chat/completions",
                       json={"model": "tiny", "messages": messages, "max_tokens": 4}, timeout=60)
        assert r.status_code == 200, r.text


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        (b"{not json", 400, None),
        (b'{"model": "tiny", "messages": "hi"}', 422, "messages"),
        (b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": "ten"}', 422, "max_tokens"),
        (b'{"model": "tiny", "messages": [{"role": "wizard", "content": "hi"}]}', 422, "messages[0].role"),
        (b'{"model": "nope", "messages": [{"role": "user", "content": "hi"}]}', 404, "model"),
        (b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": -5}', 400, "max_tokens"),
        (b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}', 400, "max_tokens"),
        (b'{"model": "tiny", "messages": []}', 400, "messages"),
        (b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "temperature": -1}', 400, "temperature"),
        (b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "top_p": 0}', 400, "top_p"),
        (b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "n": 99}', 400, "n"),
        (b'[1, 2, 3]', 422, None),
    ],
)
def test_bad_inputs_get_4xx_in_openai_shape(server: LiveServer, body: bytes, status: int, param: str | None) -> None:
    r = local_http.post(server.url + "/v1/chat/completions", content=body,
                   headers={"content-type": "application/json"}, timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["message"] and err["type"]
    if param is not None:
        assert err["param"] == param


def test_prompt_longer_than_context_is_400(server: LiveServer) -> None:
    long = "word " * 6000  # > 4096 tokens
    r = chat(server.url, long, max_tokens=4)
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "context_length_exceeded"
    assert chat(server.url, "still serving", max_tokens=2).status_code == 200


def test_a_call_cut_by_max_tokens_does_not_stream() -> None:
    parser = ReplyParser(tools=[ToolDef(FunctionDef("read_file"))])
    assert [*parser.feed("<tool_call>\n<function=read_file>\n<parameter=p>\n1"), *parser.finish("length")] == []


def test_a_failed_stream_claims_no_finish_reason() -> None:
    """A choice the failure cut gets no finish chunk ("length" would say it ran out of tokens):
    the error frame says what happened, then [DONE]; a choice that finished keeps its own."""
    stream = ChatStream(2, "chatcmpl-1", "tiny", include_usage=True, want_logprobs=False)
    frames = [*stream.start(), *stream.event(0, ContentDelta("a")), *stream.event(0, ReplyDone("stop", 3, 1)),
              *stream.event(1, ContentDelta("b")), *stream.failed(GenerationFailed("the engine failed"))]
    assert frames[-1] == b"data: [DONE]\n\n"
    assert json.loads(frames[-2][len(b"data: "):])["error"]["code"] == "generation_failed"
    chunks = [json.loads(f[len(b"data: "):]) for f in frames[:-2]]
    finishes = [(c["choices"][0]["index"], c["choices"][0]["finish_reason"]) for c in chunks
                if c["choices"][0]["finish_reason"]]
    assert finishes == [(0, "stop")]


def test_malformed_calls_stream_as_calls_with_object_arguments() -> None:
    """A call the model wrote wrong (undeclared, its block unreadable) streams as a call whose
    arguments concatenate to a JSON object, never "" and never an error; one cut by max_tokens was
    never announced and does not stream at all (issue 44.8)."""
    tools = [ToolDef(FunctionDef("read_file", parameters={"type": "object", "properties": {"p": {"type": "number"}}}))]
    for text, reason in [("<tool_call>\n<function=nope>\n</function>\n</tool_call>", "stop"),
                         ("<tool_call>\n<function=read_file>\n<parameter=p>\nNaN\n</parameter>\n</function>\n"
                          "</tool_call>", "stop")]:
        parser = ReplyParser(tools=tools)
        events = [*parser.feed(text), *parser.finish(reason)]
        assert [type(e) for e in events] == [ToolCallStart, ToolCallArguments, ToolCallEnd], text
        stream = ChatStream(1, "chatcmpl-1", "tiny", include_usage=False, want_logprobs=False)
        frames = [f for e in [*events, ReplyDone("tool_calls", 3, 1)] for f in stream.event(0, e)]
        deltas = [json.loads(f[len(b"data: "):])["choices"][0]["delta"] for f in frames]
        arguments = "".join(c["function"]["arguments"] for d in deltas for c in d.get("tool_calls") or [])
        assert isinstance(json.loads(arguments), dict), arguments


def test_unknown_route_and_method(server: LiveServer) -> None:
    assert local_http.get(server.url + "/v1/nothing").status_code == 404
    r = local_http.get(server.url + "/v1/chat/completions")
    assert r.status_code == 405 and "error" in r.json()


def test_openai_sdk(server: LiveServer) -> None:
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    done = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hello there"}],
                                          max_tokens=12, temperature=0)
    assert done.choices[0].message.role == "assistant"
    assert done.usage is not None and done.usage.completion_tokens <= 12
    pieces = []
    finish = None
    for chunk in client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hello there"}],
                                                max_tokens=12, temperature=0, stream=True):
        if chunk.choices:
            pieces.append(chunk.choices[0].delta.content or "")
            finish = chunk.choices[0].finish_reason or finish
    assert "".join(pieces) == done.choices[0].message.content
    assert finish == done.choices[0].finish_reason
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="other", messages=[{"role": "user", "content": "x"}])
    assert [m.id for m in client.models.list()] == ["tiny"]


# -- a deliberately small server: one slot, no queue, an API key --------------------------------

@pytest.fixture(scope="module")
def one_slot(fp32_model: Path):
    config = default_config(fp32_model, served_model_name="tiny", max_num_seqs=1, max_queue=0,
                            api_keys=("sekret", "second"), model_aliases=("claude-sonnet-4-5",))
    with LiveServer(config) as live:
        yield live


AUTH = {"Authorization": "Bearer sekret"}


def test_api_key(one_slot: LiveServer) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert local_http.get(one_slot.url + "/health").status_code == 200  # open
    r = local_http.post(one_slot.url + "/v1/chat/completions", json=body)
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert local_http.post(one_slot.url + "/v1/chat/completions", json=body,
                      headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert local_http.post(one_slot.url + "/v1/chat/completions", json=body, headers=AUTH).status_code == 200
    assert local_http.post(one_slot.url + "/v1/chat/completions", json=body,
                      headers={"x-api-key": "sekret"}).status_code == 200
    # either header may carry a valid key (Claude Code sends x-api-key, some proxies add a Bearer)
    assert local_http.post(one_slot.url + "/v1/chat/completions", json=body,
                      headers={"x-api-key": "second", "Authorization": "Bearer stale"}).status_code == 200
    for path in ("/v1/models", "/v1/completions", "/v1/responses", "/v1/messages/count_tokens", "/v1/cache/stats",
                 "/metrics"):
        r = httpx.request("GET" if "models" in path or "stats" in path or "metrics" in path else "POST",
                          one_slot.url + path, json={})
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error", path
    metrics = local_http.get(one_slot.url + "/metrics", headers={"x-api-key": "second"})
    assert metrics.status_code == 200
    assert any(f.name == "mlx_relay:num_requests_running" for f in text_string_to_metric_families(metrics.text))


def test_anthropic_clients_get_anthropic_shaped_401_and_model_aliases(one_slot: LiveServer) -> None:
    body = {"model": "claude-sonnet-4-5", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
    r = local_http.post(one_slot.url + "/v1/messages", json=body, headers={"x-api-key": "nope"})
    assert r.status_code == 401
    assert r.json() == {"type": "error", "error": {"type": "authentication_error",
                                                   "message": "missing or invalid API key"}}
    r = local_http.post(one_slot.url + "/v1/messages", json=body, headers={"x-api-key": "sekret"}, timeout=60)
    assert r.status_code == 200 and r.json()["model"] in ("tiny", "claude-sonnet-4-5")


def _hold_stream(url: str, opened: threading.Event, release: threading.Event) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "go on"}], "max_tokens": 4000,
            "stream": True, "temperature": 0.7, "seed": 1}
    with local_http.stream("POST", url + "/v1/chat/completions", json=body, headers=AUTH, timeout=120) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        next(lines)
        opened.set()
        release.wait(60)
    # leaving the block closes the connection mid-stream: a client disconnect


def test_queue_full_is_429_and_disconnect_frees_the_slot(one_slot: LiveServer) -> None:
    opened, release = threading.Event(), threading.Event()
    holder = threading.Thread(target=_hold_stream, args=(one_slot.url, opened, release))
    holder.start()
    assert opened.wait(60)
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    r = local_http.post(one_slot.url + "/v1/chat/completions", json=body, headers=AUTH)
    assert r.status_code == 429
    assert int(r.headers["Retry-After"]) >= 1
    assert r.json()["error"]["type"] == "rate_limit_error"
    release.set()
    holder.join()
    # The disconnect cancelled the generation and freed the only slot: the next request runs.
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        r = local_http.post(one_slot.url + "/v1/chat/completions", json=body, headers=AUTH)
        if r.status_code == 200:
            break
        time.sleep(0.05)
    assert r.status_code == 200, r.text
    health = local_http.get(one_slot.url + "/health").json()
    assert health["running"] == 0 and health["queued"] == 0
    # the scrape says so too: a rejection for overload, an aborted generation (the disconnect)
    samples = {(s.name, s.labels.get("reason") or s.labels.get("finished_reason")): s.value for f in
               text_string_to_metric_families(local_http.get(one_slot.url + "/metrics", headers=AUTH).text)
               for s in f.samples}
    assert samples[("mlx_relay:admission_rejections_total", "overloaded")] >= 1
    assert samples[("mlx_relay:request_success_total", "abort")] >= 1


def test_health_is_503_until_ready(fp32_model: Path) -> None:
    config = default_config(fp32_model, served_model_name="tiny")
    seen: list[tuple[int, str]] = []
    early: list[httpx.Response] = []
    with LiveServer(config, wait_ready=False) as live:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            r = local_http.get(live.url + "/health")
            seen.append((r.status_code, r.json()["status"]))
            if r.status_code == 200:
                break
            assert r.headers["Retry-After"]
            # what a router needs comes in every state: the queue depth and the running count
            assert r.json()["running"] == 0 and r.json()["queued"] == 0 and r.json()["max_num_seqs"] == 16
            if not early:
                early.append(local_http.post(live.url + "/v1/chat/completions",
                                        json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}))
                # /metrics answers while the model loads: the state and what Admission counts
                states = {s.labels["state"]: s.value for f in text_string_to_metric_families(
                          local_http.get(live.url + "/metrics").text) if f.name == "mlx_relay:server_state"
                          for s in f.samples}
                assert [k for k, v in states.items() if v == 1] in (["loading"], ["warming"], ["ready"])
            time.sleep(0.01)
    assert seen[0][0] == 503 and seen[0][1] in ("loading", "warming")
    assert seen[-1] == (200, "ready")
    # a request before the model is ready is refused with 503 + Retry-After, never queued into a crash
    assert early and early[0].status_code == 503 and early[0].headers["Retry-After"]
    assert early[0].json()["error"]["code"] == "not_ready"


def test_non_streaming_disconnect_frees_the_slot(one_slot: LiveServer) -> None:
    """A client that gives up on a non-streaming request cancels its generation too."""
    import socket

    body = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "go"}], "max_tokens": 4000,
                       "temperature": 0.7, "seed": 3}).encode()
    host, port = "127.0.0.1", int(one_slot.url.rsplit(":", 1)[1])
    with socket.create_connection((host, port)) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sekret\r\n"
                     b"Content-Type: application/json\r\nContent-Length: " + str(len(body)).encode() +
                     b"\r\n\r\n" + body)
        deadline = time.monotonic() + 30
        while local_http.get(one_slot.url + "/health").json()["running"] == 0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert local_http.get(one_slot.url + "/health").json()["running"] == 1
    # the socket is closed: the server notices, cancels the generation and frees the slot
    deadline = time.monotonic() + 10
    while local_http.get(one_slot.url + "/health").json()["running"] and time.monotonic() < deadline:
        time.sleep(0.02)
    assert local_http.get(one_slot.url + "/health").json()["running"] == 0
    r = local_http.post(one_slot.url + "/v1/chat/completions", headers=AUTH,
                   json={"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    assert r.status_code == 200
