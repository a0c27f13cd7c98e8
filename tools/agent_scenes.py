"""Agent scenes: the coding agents' own requests as training examples for ``relay-tiny-agent``
(issue 30, point 1).

Offline tooling beside the server (no actor, no MLX). A *scene* is a request one of the five agents
really sent (recorded by ``make agents`` or a scripted stub, whole: ``tests/agent_requests/<agent>/``
and ``benchmarks/agents/scenes/``), converted to the neutral ``ChatRequest`` by the server's own
wire-format code (``mlx_relay/http/formats/*/request.py``) and rendered by the server's own prompt
renderer, so the prompt is token for token what the server feeds the model when that agent calls.
Each scene names what the assistant should write next:

* ``call``: the agent's turn asks for a stock (the MCP tool ``get_stock(path)`` of
  ``benchmarks/agents/mcp_stock.py``): the assistant calls the agent's stock tool (the name under
  which that agent declares it: ``mcp__stock__get_stock``, ``stock_get_stock``, ...), or, for Claude
  Code, whose MCP tools are deferred (Anthropic's tool search), first ``ToolSearch`` with
  ``select:<name>``;
* ``answer``: the tool's result came back: the assistant answers in one sentence and stops;
* ``side``: an agent's side request (OpenCode's title, Qwen Code's memory agent): a short answer.

Variation (``Example`` per seed): the path and the tool's value are drawn, the user's sentence is
one of several phrasings (the harness's own, ``Please get the stock with path 423.``, among them,
with other numbers), and a synthetic follow-up (the call and its result appended as neutral
messages, when no recording of that turn exists) wraps the result as the agents do (plain, an
MCP ``{"result": ...}`` object, a list of text parts).

For training, each example is split where the varying part begins (the user's stock sentence):
``prefix`` (the agent's system prompt, tools and earlier turns, the same for every example of the
scene) and ``suffix`` (the rest of the prompt and the assistant turns, with the loss mask on the
latter); ``tools/train_agent_scenes.py`` runs the prefix without gradients and trains on the suffix.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import msgspec
import numpy as np

from mlx_relay.chat.normalize import normalize_messages, to_template_messages
from mlx_relay.chat.prompt_render import PromptRenderer
from mlx_relay.chat.types import ChatMessage, FunctionCall, ToolCall
from mlx_relay.http.body import decode_body
from mlx_relay.http.formats.anthropic.request import to_chat_request as anthropic_request
from mlx_relay.http.formats.anthropic.types import MessagesRequest
from mlx_relay.http.formats.openai_chat.request import to_chat_request as chat_request
from mlx_relay.http.formats.openai_chat.types import ChatCompletionRequest
from mlx_relay.http.formats.responses.request import items_to_messages, parse_items, translate
from mlx_relay.http.formats.responses.tools import parse_tools
from mlx_relay.http.formats.responses.types import ResponsesRequest
from mlx_relay.messages.prompt import Render
from mlx_relay.service import ChatRequest

Target = Literal["call", "answer", "side"]
ROOT = Path(__file__).resolve().parent.parent
HARNESS_PROMPT = "Please get the stock with path 423."  # benchmarks/agents/agents.py: PROMPT
HARNESS_VALUE = "123456"  # benchmarks/agents/mcp_stock.py's value
PHRASINGS = (
    "Please get the stock with path {n}.",
    "Please get the stock with path {n}.",
    "Get the stock with path {n}.",
    "Please get the stock for path {n}.",
    "What is the stock with path {n}?",
    "Look up the stock with path {n}.",
)
SIDE_ANSWERS = {
    "title": "Stock lookup for path {n}",
    "memory": "Nothing to save.",
}


@dataclass(frozen=True)
class Scene:
    agent: str
    file: str  # relative to the repository root
    target: Target
    side: str = ""  # for side scenes: a SIDE_ANSWERS key
    # how the stock tool is reached in this request: "" (declared: called by name), "ToolSearch"
    # (Claude Code: deferred, loaded by ToolSearch), "tool_search" / "tool_call" (Qwen Code's default
    # setup: reviewed by tool_search, then called through tool_call with its name and arguments)
    via: str = ""
    recorded_follow_up: bool = False  # the request already holds the call and its result
    weight: float = 1.0  # how often training draws it (relative)


SCENES: tuple[Scene, ...] = (
    # the one turn whose tool is not the stock tool itself: drawn more often (the model otherwise
    # calls the deferred tool by name, which the tool grammar does not allow there)
    Scene("claude-code", "tests/agent_requests/claude-code-toolsearch/001.json", "call", via="ToolSearch", weight=5.0),
    Scene("claude-code", "tests/agent_requests/claude-code-toolsearch/002.json", "call"),
    Scene("claude-code", "tests/agent_requests/claude-code-toolsearch/003.json", "answer", recorded_follow_up=True),
    Scene("codex", "benchmarks/agents/scenes/codex-001.json", "call"),
    Scene("codex", "benchmarks/agents/scenes/codex-001.json", "answer"),
    Scene("opencode", "tests/agent_requests/opencode/002.json", "call"),
    Scene("opencode", "tests/agent_requests/opencode/002.json", "answer"),
    Scene("opencode", "tests/agent_requests/opencode/001.json", "side", side="title"),
    Scene("cline", "tests/agent_requests/cline/001.json", "call"),
    Scene("cline", "tests/agent_requests/cline/001.json", "answer"),
    Scene("qwen-code-slim", "tests/agent_requests/qwen-code-slim/001.json", "call"),
    Scene("qwen-code-slim", "tests/agent_requests/qwen-code-slim/001.json", "answer"),
    Scene("qwen-code-slim", "tests/agent_requests/qwen-code-slim/002.json", "side", side="memory"),
    Scene("qwen-code", "tests/agent_requests/qwen-code-toolsearch/001.json", "call", via="tool_search", weight=3.0),
    Scene("qwen-code", "tests/agent_requests/qwen-code-toolsearch/002.json", "call", via="tool_call", weight=3.0),
    Scene("qwen-code", "tests/agent_requests/qwen-code-toolsearch/003.json", "answer", recorded_follow_up=True,
          weight=2.0),
)


def body_of(path: Path) -> tuple[str, dict[str, Any]]:
    """(request path, JSON body) of a recorded request (either recording format)."""
    rec = json.loads(path.read_text())
    body = rec["body"] if isinstance(rec["body"], dict) else json.loads(rec["body"])
    return rec["path"], body


def to_request(route: str, body: dict[str, Any]) -> ChatRequest:
    """The server's own conversion of a wire body into the neutral request."""
    raw = json.dumps(body).encode()
    if "/responses" in route:
        rbody = decode_body(raw, ResponsesRequest, 10_000)
        tools, names = parse_tools(rbody.tools)
        req, _ = translate(rbody, "m", items_to_messages(parse_items(rbody.input), names), tools, names)
        return req
    if "/messages" in route:
        return anthropic_request(decode_body(raw, MessagesRequest, 10_000))
    return chat_request(decode_body(raw, ChatCompletionRequest, 10_000))


def template_kwargs(req: ChatRequest) -> dict[str, Any]:
    """What the service passes the template (``ChatService._render_msg``)."""
    kwargs = dict(req.template_kwargs)
    if req.enable_thinking is not None:
        kwargs["enable_thinking"] = req.enable_thinking
    return kwargs


def stock_tool(req: ChatRequest) -> str | None:
    for t in req.tools or []:
        if t.function.name.endswith("get_stock"):
            return t.function.name
    return None


@dataclass
class Example:
    scene: Scene
    messages: list[ChatMessage]
    tools: Any
    kwargs: dict[str, Any]
    train_from: int  # assistant turns at or after this message index carry the loss
    anchor: str  # the text where the varying part begins (the user's stock sentence)
    call: dict[str, Any] | None = None  # the call the first target turn makes
    answer: str | None = None


@dataclass
class Encoded:
    ids: np.ndarray  # int32: the whole conversation
    mask: np.ndarray  # bool: loss on this token
    split: int  # prefix length: ids[:split] never vary within the scene (no gradient there)
    prompt_len: int = 0  # the first target turn's prompt (what the server would prefill)


@dataclass
class SceneMaker:
    tokenizer: Any
    scenes: tuple[Scene, ...] = SCENES
    root: Path = ROOT
    renderer: PromptRenderer = field(init=False)
    _loaded: dict[str, tuple[str, dict[str, Any]]] = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        self.renderer = PromptRenderer(self.tokenizer, "qwen3_coder")
        self.im_end = self.tokenizer.convert_tokens_to_ids("<|im_end|>")

    def _body(self, file: str) -> tuple[str, dict[str, Any]]:
        if file not in self._loaded:
            self._loaded[file] = body_of(self.root / file)
        return self._loaded[file]

    # -- examples ------------------------------------------------------------------------------
    def example(self, scene: Scene, rng: np.random.Generator) -> Example:
        n = int(rng.integers(1, 1000))
        value = str(int(rng.integers(100000, 1000000)))
        sentence = PHRASINGS[int(rng.integers(0, len(PHRASINGS)))].format(n=n)
        route, body = self._body(scene.file)
        text = json.dumps(body)
        text = text.replace(HARNESS_PROMPT, sentence).replace(HARNESS_VALUE, value)
        text = re.sub(r'(path\\*":\s?)423\b', lambda m: f"{m.group(1)}{n}", text)
        req = to_request(route, json.loads(text))
        messages = list(req.messages)
        kwargs = template_kwargs(req)
        think = bool(kwargs.get("enable_thinking"))
        if scene.target == "side":
            answer = SIDE_ANSWERS[scene.side].format(n=n)
            reply = ChatMessage("assistant", answer, reasoning_content="A short answer." if think else "")
            anchor = sentence if sentence in json.dumps([msgspec.to_builtins(m) for m in messages]) else ""
            return Example(scene, [*messages, reply], req.tools, kwargs, len(messages), anchor, answer=answer)
        name = stock_tool(req)
        call_id = f"call_{int(rng.integers(0, 1 << 30)):08x}"
        if scene.target == "call":
            wanted = "mcp__stock__get_stock"
            if scene.via in ("ToolSearch", "tool_search"):
                call = {"name": scene.via, "arguments": {"query": f"select:{wanted}"}}
                why = f"The user wants the stock with path {n}. {wanted} is deferred, so I will call {scene.via}."
            elif scene.via == "tool_call":
                call = {"name": "tool_call", "arguments": {"name": wanted, "arguments": {"path": n}}}
                why = f"The user wants the stock with path {n}. I will call tool_call with {wanted}."
            else:
                assert name is not None, f"{scene.file}: no stock tool declared"
                call = {"name": name, "arguments": {"path": n}}
                why = f"The user wants the stock with path {n}. I will call {name}."
            calls = [ToolCall(call_id, FunctionCall(call["name"], json.dumps(call["arguments"])))]
            reply = ChatMessage("assistant", "", reasoning_content=why if think else "", tool_calls=calls)
            return Example(scene, [*messages, reply], req.tools, kwargs, len(messages), sentence, call=call)
        # answer
        if not scene.recorded_follow_up:
            assert name is not None, f"{scene.file}: no stock tool declared"
            raw = json.dumps({"status": "ok", "value": value})
            wrap = int(rng.integers(0, 3))
            result = raw if wrap == 0 else json.dumps({"result": raw}) if wrap == 1 else \
                json.dumps([{"type": "text", "text": raw}])
            messages += [
                ChatMessage("assistant", "", reasoning_content=f"I will call {name}." if think else "",
                            tool_calls=[ToolCall(call_id, FunctionCall(name, json.dumps({"path": n})))]),
                ChatMessage("tool", result, tool_call_id=call_id, name=name),
            ]
        answer = f"The stock with path {n} is {value}."
        reply = ChatMessage("assistant", answer, reasoning_content=f"The tool returned {value}." if think else "")
        return Example(scene, [*messages, reply], req.tools, kwargs, len(messages), sentence, answer=answer)

    # -- encoding ------------------------------------------------------------------------------
    def prompt_ids(self, ex: Example, messages: list[ChatMessage]) -> list[int]:
        return self.renderer.render(Render(messages, ex.tools, ex.kwargs)).token_ids

    def encode(self, ex: Example) -> Encoded:
        template = to_template_messages(normalize_messages(ex.messages))
        tools = [msgspec.to_builtins(t) for t in ex.tools] if ex.tools else None
        text = self.tokenizer.apply_chat_template(template, tools=tools, add_generation_prompt=False,
                                                  tokenize=False, **ex.kwargs)
        ids = np.asarray(self.tokenizer.backend_tokenizer.encode_batch([text], add_special_tokens=False)[0].ids,
                         np.int32)
        mask = np.zeros(len(ids), dtype=bool)
        first_prompt = 0
        for i in range(ex.train_from, len(ex.messages)):
            if ex.messages[i].role != "assistant":
                continue
            prompt = self.prompt_ids(ex, ex.messages[:i])
            if list(ids[: len(prompt)]) != prompt:
                raise ValueError(f"{ex.scene.file}: the prompt of turn {i} is not a prefix of the conversation")
            first_prompt = first_prompt or len(prompt)
            ends = np.flatnonzero(ids[len(prompt):] == self.im_end)
            mask[len(prompt): len(prompt) + int(ends[0]) + 1] = True
        split = self._split(ids, ex.anchor, first_prompt)
        return Encoded(ids, mask, split, first_prompt)

    def _split(self, ids: np.ndarray, anchor: str, first_prompt: int) -> int:
        """Where the varying text begins: the last occurrence of the anchor's first tokens before
        the first target turn (else 256 tokens before that turn)."""
        fallback = max(first_prompt - 256, 0)
        if not anchor:
            return fallback
        probe = self.tokenizer.backend_tokenizer.encode_batch([anchor], add_special_tokens=False)[0].ids[1:6]
        window = ids[:first_prompt]
        for start in range(len(window) - len(probe), -1, -1):
            if list(window[start: start + len(probe)]) == probe:
                return max(start - 8, 0)
        return fallback


def main() -> None:
    """Show each scene's lengths and its first example's turns (a check of the recordings)."""
    import argparse

    from mlx_relay.actors.normalizer import load_tokenizer

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=ROOT / "mlx_relay/models/relay-tiny-agent")
    ap.add_argument("--show", action="store_true")
    args = ap.parse_args()
    maker = SceneMaker(load_tokenizer(args.model))
    for k, scene in enumerate(maker.scenes):
        try:
            enc = maker.encode(maker.example(scene, np.random.default_rng((0, k))))
        except Exception as exc:  # a recording the server's conversion refuses: say which
            print(f"{scene.agent:15s} {scene.target:6s} {Path(scene.file).name}: {type(exc).__name__}: {exc}")
            continue
        print(f"{scene.agent:15s} {scene.target:6s} {Path(scene.file).name}: {len(enc.ids)} tokens, prefix "
              f"{enc.split}, prompt {enc.prompt_len}, trained {int(enc.mask.sum())}")
        if args.show:
            print("   suffix:", repr(maker.tokenizer.decode(enc.ids[enc.split:].tolist())[:1500]))


if __name__ == "__main__":
    main()
