"""Every tool round restores the previous request (issue 43, point 1).

An agent's tool loop sends, round after round, the previous request's whole prompt, the reply
(a tool call) and the tool's result. The prefix cache snapshots the prompt's end, and the whole
turn where the template renders the reply as it was generated, so each request restores at least
the previous request's whole prompt: `cached_tokens` >= the previous prompt's tokens, round by
round. Checked through the HTTP routes of the three wire formats agents use (OpenAI chat
`tool_calls`/`tool` messages, Responses `function_call`/`function_call_output` items, Anthropic
`tool_use`/`tool_result` blocks) on three chat templates: Qwen3.5's (the fixture's), Qwen3's (the
Qwen3 family fixture) and one that drops the reasoning of every past reply. The OpenAI and
Responses agents force the call and send back exactly what the server answered, so the whole turn
is restored too (the prompt and the reply); the Anthropic agent has Claude Code's shape (thinking
on, `tool_choice` auto, the reply's blocks sent back with the agent's own `tool_use`). A client
that drops the reasoning of a thinking model restores all but the open thinking block's newline
(the next prompt renders an empty block there: a token the previous prompt does not end with).
Under all of it, the renderer's boundary is, token for token, what the next round's prompt
repeats. The loops the agents recorded (`tests/agent_requests/`) are `tests/test_agent_requests.py`'s,
a 120-round loop through the store alone `tests/test_prefix_index.py`'s.

A long loop on a small byte budget holds one round's snapshots, not fifty: the rounds it moved
past are superseded (freed ahead of any eviction), the system prompt and the reply's header (what
a next user turn restores) stay, nothing is evicted, and every round is still restored.

The model is a random-weight tiny model: replies are capped at a few tokens, and nothing here
depends on what it writes beyond a forced call's shape. Counts only, never time.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal, Protocol

import pytest

from mlx_relay.relay import Relay, default_config
from mlx_relay.testing import local_http
from mlx_relay.testing.family_fixtures import family_fixture_path
from mlx_relay.testing.fixtures import FixtureSpec, fixture_path
from mlx_relay.testing.live_server import LiveServer

Json = dict[str, Any]
Wire = Literal["chat", "responses", "messages"]
Template = Literal["qwen3_5", "qwen3", "drops-reasoning"]

MODEL = "tiny"
TIMEOUT = 60
SYSTEM = "You are a coding agent. Read files before you change them, and run the tests after. " * 4
# no arguments: a forced call is short, and its arguments are `{}` on every template
TOOL: Json = {"name": "read_file", "description": "Read a file of the repository",
              "parameters": {"type": "object", "properties": {}, "additionalProperties": False}}
REPLY_TOKENS = 48  # room for the forced call (Qwen3's JSON call, 22 tokens, is the longest)
ROUNDS = 20
# the plain lane (the MTP lane's prompt end and whole turn: tests/test_prefix_engine.py, and the
# agent's turns of tests/test_prefix_cache.py)
SPECULATION = "none"
LONG_ROUNDS = 50


def drops_reasoning(out: Path) -> Path:
    """The Qwen3 family fixture with a template that renders every past reply without its
    reasoning (as DeepSeek-R1's and QwQ's do), its generation prompt the bare reply header."""
    src = family_fixture_path("qwen3")
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.name != "chat_template.jinja":
            (out / f.name).symlink_to(f)
    text = (src / "chat_template.jinja").read_text()
    kept = "{%- if loop.index0 > state.last_query and (loop.last or reasoning) %}"
    assert kept in text
    (out / "chat_template.jinja").write_text(text.replace(kept, "{%- if false %}"))
    return out


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[Template, LiveServer]]:
    """A server per template (no warm-up: the loops compile what they run)."""
    models: dict[Template, Path] = {
        "qwen3_5": fixture_path(FixtureSpec(variant="fp32", seed=0)),
        "qwen3": family_fixture_path("qwen3"),
        "drops-reasoning": drops_reasoning(tmp_path_factory.mktemp("drops") / "model"),
    }
    live: dict[Template, LiveServer] = {}
    try:
        for name, path in models.items():
            config = default_config(path, served_model_name=MODEL, max_num_seqs=2, warmup=False,
                                    prefix_min_snapshot_tokens=8, speculation=SPECULATION)
            live[name] = LiveServer(config).__enter__()
        yield live
    finally:
        for server in live.values():
            server.__exit__(None, None, None)


Case = tuple[Template, Json, bool]
#: (template, template kwargs, whether the client sends the reasoning back)
RENDER_CASES: list[Case] = [
    ("qwen3_5", {}, False),  # thinking off: an empty block in the prompt and in every past reply
    ("qwen3_5", {"enable_thinking": True}, True),
    ("qwen3_5", {"enable_thinking": True}, False),
    ("qwen3", {}, True),
    ("qwen3", {}, False),
    ("qwen3", {"enable_thinking": False}, False),  # its empty block is dropped from past replies
    ("drops-reasoning", {}, True),
]


@pytest.mark.parametrize(("template", "kwargs", "sends_reasoning"), RENDER_CASES,
                         ids=[f"{t}-{'-'.join(map(str, k.values())) or 'default'}-{'keeps' if r else 'drops'}"
                              for t, k, r in RENDER_CASES])
def test_the_next_rounds_prompt_starts_with_the_boundary_the_renderer_found(
        tmp_path: Path, template: Template, kwargs: Json, sends_reasoning: bool) -> None:
    """The renderer's `round_start` is, token for token, how much of a prompt the loop's next
    prompt repeats (its common prefix with it), round after round, on each template, thinking on
    or off, whether the client sends the reasoning back or not. One exception, by design: with a
    thinking block open and no reply yet to tell whether the client sends reasoning back, the
    first round assumes it does."""
    import msgspec

    from mlx_relay.actors.normalizer import load_tokenizer
    from mlx_relay.chat.prompt_render import PromptRenderer, common_prefix
    from mlx_relay.chat.reply_parser import tool_format_for_template
    from mlx_relay.chat.types import ChatMessage, ToolDef
    from mlx_relay.messages.prompt import Render

    path = {"qwen3_5": lambda: fixture_path(FixtureSpec(variant="fp32", seed=0)),
            "qwen3": lambda: family_fixture_path("qwen3"),
            "drops-reasoning": lambda: drops_reasoning(tmp_path / "model")}[template]()
    tokenizer = load_tokenizer(path)
    renderer = PromptRenderer(tokenizer, tool_format_for_template(tokenizer.chat_template))
    tools = msgspec.convert([{"type": "function", "function": TOOL}], list[ToolDef])
    messages: list[Json] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Fix the test."}]
    rendered = []
    for i in range(4):
        rendered.append(renderer.render(Render(msgspec.convert(messages, list[ChatMessage]), tools=tools,
                                               template_kwargs=kwargs)))
        reply: Json = {"role": "assistant", "content": "", "tool_calls": [
            {"id": f"c{i}", "type": "function", "function": {"name": TOOL["name"], "arguments": "{}"}}]}
        if sends_reasoning:
            reply["reasoning_content"] = f"The file to read next is number {i}."
        messages += [reply, {"role": "tool", "tool_call_id": f"c{i}", "content": f"line {i}: ok"}]
    guessed = bool(kwargs.get("enable_thinking")) and template == "qwen3_5" and not sends_reasoning
    for k, (this, after) in enumerate(itertools.pairwise(rendered)):
        repeated = common_prefix(this.token_ids, after.token_ids)
        if k == 0 and guessed:
            assert this.boundaries.round_start == len(this.token_ids) == repeated + 1
        else:
            b = this.boundaries
            assert b.round_start == repeated, (k, b.round_start, repeated, len(this.token_ids))
        assert this.boundaries.reply_start <= this.boundaries.round_start


class Usage:
    def __init__(self, prompt: int, cached: int, completion: int) -> None:
        self.prompt, self.cached, self.completion = prompt, cached, completion

    def __repr__(self) -> str:
        return f"(prompt {self.prompt}, cached {self.cached}, reply {self.completion})"


class Agent(Protocol):
    path: str

    def body(self) -> Json: ...

    def answered(self, reply: Json, result: str) -> Usage: ...


class ChatAgent:
    """OpenAI chat: `tool_calls` on the assistant message, a `tool` message with the result. Forced:
    the call is the server's, sent back as it came; else the agent writes the call itself."""

    path = "/v1/chat/completions"

    def __init__(self, task: str, *, forced: bool = True, kwargs: Json | None = None,
                 send_reasoning: bool = True) -> None:
        self.messages: list[Json] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task}]
        self.forced, self.kwargs, self.send_reasoning = forced, kwargs or {}, send_reasoning

    def body(self) -> Json:
        body: Json = {"model": MODEL, "messages": self.messages, "temperature": 0,
                      "max_tokens": REPLY_TOKENS if self.forced else 4,
                      "tools": [{"type": "function", "function": TOOL}], **self.kwargs}
        if self.forced:
            body["tool_choice"] = {"type": "function", "function": {"name": TOOL["name"]}}
        return body

    def answered(self, reply: Json, result: str) -> Usage:
        message = reply["choices"][0]["message"]
        if self.forced:
            (call,) = message["tool_calls"]
        else:
            call = {"id": f"call_{len(self.messages)}", "type": "function",
                    "function": {"name": TOOL["name"], "arguments": "{}"}}
        sent: Json = {"role": "assistant", "content": message.get("content"), "tool_calls": [call]}
        if self.send_reasoning and message.get("reasoning_content"):
            sent["reasoning_content"] = message["reasoning_content"]
        self.messages += [sent, {"role": "tool", "tool_call_id": call["id"], "content": result}]
        usage = reply["usage"]
        return Usage(usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"],
                     usage["completion_tokens"])


class ResponsesAgent:
    """Responses: the output items (the `function_call` forced) sent back as input, then a
    `function_call_output`."""

    path = "/v1/responses"

    def __init__(self, task: str) -> None:
        self.items: list[Json] = [{"role": "user", "content": [{"type": "input_text", "text": task}]}]

    def body(self) -> Json:
        return {"model": MODEL, "instructions": SYSTEM, "input": self.items, "max_output_tokens": REPLY_TOKENS,
                "temperature": 0, "store": False, "tools": [{"type": "function", **TOOL}],
                "tool_choice": {"type": "function", "name": TOOL["name"]}}

    def answered(self, reply: Json, result: str) -> Usage:
        output = reply["output"]
        (call,) = [item for item in output if item["type"] == "function_call"]
        self.items += [*output, {"type": "function_call_output", "call_id": call["call_id"], "output": result}]
        usage = reply["usage"]
        return Usage(usage["input_tokens"], usage["input_tokens_details"]["cached_tokens"], usage["output_tokens"])


class MessagesAgent:
    """Anthropic Messages, as Claude Code sends them: thinking on, `tool_choice` auto; the reply's
    blocks (its thinking included) sent back with the agent's `tool_use`, then the `tool_result`
    (Anthropic forbids forcing a tool with thinking on, and forcing turns the template's thinking
    off)."""

    path = "/v1/messages"

    def __init__(self, task: str) -> None:
        self.messages: list[Json] = [{"role": "user", "content": [{"type": "text", "text": task}]}]

    def body(self) -> Json:
        return {"model": MODEL, "system": [{"type": "text", "text": SYSTEM}], "messages": self.messages,
                "max_tokens": 4, "temperature": 0, "thinking": {"type": "adaptive"},
                "tools": [{"name": TOOL["name"], "description": TOOL["description"],
                           "input_schema": TOOL["parameters"]}]}

    def answered(self, reply: Json, result: str) -> Usage:
        use = {"type": "tool_use", "id": f"toolu_{len(self.messages)}", "name": TOOL["name"], "input": {}}
        self.messages += [{"role": "assistant", "content": [*reply["content"], use]},
                          {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use["id"],
                                                        "content": result}]}]
        usage = reply["usage"]
        return Usage(usage["input_tokens"] + usage["cache_read_input_tokens"], usage["cache_read_input_tokens"],
                     usage["output_tokens"])


def run_loop(server: LiveServer, agent: Agent, rounds: int) -> list[Usage]:
    usages = []
    for i in range(rounds):
        r = local_http.post(server.url + agent.path, json=agent.body(), timeout=TIMEOUT)
        assert r.status_code == 200, r.text[:500]
        usages.append(agent.answered(r.json(), f"line {i}: ok"))
    return usages


def agent_for(wire: Wire, task: str) -> Agent:
    if wire == "chat":
        return ChatAgent(task)
    if wire == "responses":
        return ResponsesAgent(task)
    return MessagesAgent(task)


@pytest.mark.parametrize("wire", ["chat", "responses", "messages"])
@pytest.mark.parametrize("template", ["qwen3_5", "qwen3", "drops-reasoning"])
def test_every_tool_round_restores_the_previous_request(servers: dict[Template, LiveServer], template: Template,
                                                        wire: Wire) -> None:
    server = servers[template]
    before = local_http.get(server.url + "/v1/cache/stats", timeout=TIMEOUT).json()["prefix_cache"]
    usages = run_loop(server, agent_for(wire, f"Fix the failing test ({template}, {wire})."), ROUNDS)
    after = local_http.get(server.url + "/v1/cache/stats", timeout=TIMEOUT).json()["prefix_cache"]
    for prev, this in itertools.pairwise(usages):
        assert this.cached >= prev.prompt, usages  # the previous request's whole prompt
        if wire != "messages":  # the call sent back as generated: the whole turn, all but its end-of-turn token
            assert this.cached >= prev.prompt + prev.completion - 1, usages
    # the loop's earlier rounds were freed as it went (its first round's header and the system
    # prompt stay; the last round's snapshots are held)
    turn = after["by_kind"]["turn"]
    assert turn["superseded"] - before["by_kind"]["turn"]["superseded"] >= ROUNDS - 2
    assert after["evictions"] == before["evictions"] == 0
    metrics = local_http.get(server.url + "/metrics", timeout=TIMEOUT).text
    assert f'mlx_relay:prefix_cache_superseded_total{{model_name="{MODEL}"}} {float(after["superseded"])}' in metrics


def test_a_client_that_drops_reasoning_restores_all_but_the_open_thinking_blocks_newline(
        servers: dict[Template, LiveServer]) -> None:
    """Thinking on (the prompt ends inside `<think>\\n`) and a client that sends no reasoning back:
    the next prompt renders the past reply's empty thinking block, whose `\\n\\n` is not the
    prompt's last token. The first round guesses the client keeps it (no reply yet to tell), so
    the second restores the first's reply header; from then on the snapshot sits one token before
    the prompt's end, and each round restores exactly that."""
    agent = ChatAgent("Fix the failing test (thinking).", forced=False, kwargs={
        "chat_template_kwargs": {"enable_thinking": True}}, send_reasoning=False)
    usages = run_loop(servers["qwen3_5"], agent, 5)
    assert usages[1].cached == usages[0].prompt - 2, usages  # `<think>`, `\n`
    assert [u.cached for u in usages[2:]] == [u.prompt - 1 for u in usages[1:-1]], usages


async def test_a_long_loop_holds_one_rounds_snapshots() -> None:
    """A 50-round loop whose snapshots, about 1 MiB each, would take 100 MiB, on a 16 MiB budget (the
    fixture of a 32K context: the loop takes 2K tokens): nothing is evicted, the rounds it moved
    past are superseded as it goes, the system prompt and the first round's reply header (what a
    next user turn restores) stay, and every round restores the one before it."""
    model = fixture_path(FixtureSpec(variant="fp32", seed=0, max_position_embeddings=32768))
    tools = [{"type": "function", "function": TOOL}]
    messages: list[Json] = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Read every file."}]
    prompts, cached, peak = [], [], 0
    async with Relay.start(model, prefix_cache=True, prefix_cache_bytes=16 << 20, prefix_min_snapshot_tokens=8,
                           max_num_seqs=2, warmup=False, speculation=SPECULATION) as relay:
        for i in range(LONG_ROUNDS):
            r = await relay.chat(messages, tools=tools, max_tokens=1, temperature=0)
            prompts.append(r.prompt_tokens)
            cached.append(r.cached_tokens)
            call = {"id": f"c{i}", "type": "function", "function": {"name": TOOL["name"], "arguments": "{}"}}
            messages += [{"role": "assistant", "content": r.content, "tool_calls": [call]},
                         {"role": "tool", "tool_call_id": call["id"], "content": f"{i}"}]
            if i % 10 == 9:
                peak = max(peak, (await relay.prefix_cache_stats())["prefix_cache"]["bytes"])
        stats = await relay.prefix_cache_stats()
    pc, kinds = stats["prefix_cache"], stats["prefix_cache"]["by_kind"]
    assert all(c >= p for c, p in zip(cached[1:], prompts, strict=False)), list(zip(prompts, cached, strict=False))
    assert pc["evictions"] == 0 and 0 < peak <= pc["budget_bytes"] // 2
    # each round snapshots its prompt's end, the first its reply's header too (a reply of one token,
    # max_tokens 1, ends in the step that drew it, before the state holds it: no whole-turn snapshot,
    # the next round restores the prompt's end); all but the header and the last round's are superseded
    turn = kinds["turn"]
    assert turn["inserts"] == 1 + LONG_ROUNDS and turn["superseded"] == turn["inserts"] - 2
    assert (kinds["system"]["entries"], turn["entries"]) == (1, 2)
    assert pc["bytes"] == stats["snapshots"]["bytes"] and stats["snapshots"]["held"] == pc["entries"] == 3


@pytest.mark.parametrize("template", ["qwen3_5", "qwen3"])
def test_a_new_session_of_an_agent_restores_its_instructions(servers: dict[Template, LiveServer],
                                                             template: Template) -> None:
    """An agent that sends its own instructions and then its session's environment as two system
    messages (Claude Code: its prompt, then the working directory, the date, its MCP tools): the
    prompt's boundaries hold the end of each (`Boundaries.system`), the prefix cache snapshots
    both, and a new session whose environment differs restores the instructions, not nothing."""
    from transformers import AutoTokenizer

    from mlx_relay.chat.prompt_render import PromptRenderer
    from mlx_relay.chat.types import ChatMessage
    from mlx_relay.messages.prompt import Render

    server = servers[template]

    def body(session: str) -> Json:
        return {"model": MODEL, "max_tokens": 4, "temperature": 0, "messages": [
            {"role": "system", "content": "Review every change twice before you write it. " * 8},
            {"role": "system", "content": f"Environment: session {session}, working directory /work/{session}."},
            {"role": "user", "content": "Hello."}]}

    path = fixture_path(FixtureSpec(variant="fp32", seed=0)) if template == "qwen3_5" else family_fixture_path("qwen3")
    renderer = PromptRenderer(AutoTokenizer.from_pretrained(str(path)), None)
    rendered = renderer.render(Render([ChatMessage(m["role"], m["content"]) for m in body("a")["messages"]]))
    instructions, whole = rendered.boundaries.system
    assert 8 < instructions < whole < len(rendered.token_ids)
    cached = []
    for session in ("a", "b"):
        r = local_http.post(server.url + "/v1/chat/completions", json=body(session), timeout=TIMEOUT)
        assert r.status_code == 200, r.text
        cached.append(r.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
    assert cached[0] < instructions and instructions <= cached[1] < whole, (cached, instructions, whole)
