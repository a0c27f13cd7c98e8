"""Tools for a chat template that renders none (pure, no MLX): Gemma 3's template has no tool section,
no tool role and no call syntax, and its model no tool tokens. For such a template the renderer
writes the tools into the conversation itself, in the Hermes convention, which the reply parser
and the output grammars read as the "json" tool format (`<tool_call>` is plain text there):

- the tools: a section of the system prompt listing each function's JSON signature inside
  `<tools></tools>` and asking for each call as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
  (the template then puts the system prompt where it puts one: Gemma 3's opens the first user turn);
- an assistant turn's calls: those blocks appended to its text (the turn keeps no `tool_calls`);
- tool results: a user turn of `<tool_response>...</tool_response>` blocks, consecutive results in
  one turn, merged with a user turn next to it, so user and model turns still alternate as such
  templates require.

`renders_tools` tells such a template apart: rendered with a probe tool, its output never names it.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

__all__ = ["fold_tools", "renders_tools", "tools_section"]

_PROBE = "relay_probe_function"


def renders_tools(render: Callable[[list[dict[str, Any]], list[dict[str, Any]]], str],
                  errors: tuple[type[BaseException], ...]) -> bool:
    """Whether a template renders the tools it is given (`render(messages, tools)` -> its text); one
    that fails on the probe with one of `errors` is left to say why on a request's own render."""
    probe = [{"type": "function", "function": {"name": _PROBE, "description": "",
                                                "parameters": {"type": "object", "properties": {}}}}]
    try:
        return _PROBE in render([{"role": "user", "content": "x"}], probe)
    except errors:
        return True


def tools_section(tools: list[dict[str, Any]]) -> str:
    signatures = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            "You are provided with function signatures within <tools></tools> XML tags:\n"
            f"<tools>\n{signatures}\n</tools>\n\n"
            "For each function call, return a json object with function name and arguments within "
            "<tool_call></tool_call> XML tags:\n"
            '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


def _call_block(call: dict[str, Any]) -> str:
    fn = call.get("function", call)
    args = fn.get("arguments")
    arguments = args if isinstance(args, str) else json.dumps(args if args is not None else {}, ensure_ascii=False)
    name = json.dumps(fn.get("name"), ensure_ascii=False)
    return f'<tool_call>\n{{"name": {name}, "arguments": {arguments}}}\n</tool_call>'


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    return "".join(p.get("text", "") for p in content or () if isinstance(p, dict) and p.get("type") == "text")


def fold_tools(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """The template messages with the tools, the calls and the results written into their texts
    (new dicts; the input is not changed)."""
    out: list[dict[str, Any]] = []
    if tools:
        section = tools_section(tools)
        if messages and messages[0].get("role") == "system":
            system = _text(messages[0].get("content"))
            out.append({**messages[0], "content": f"{system}\n\n{section}" if system else section})
            messages = messages[1:]
        else:
            out.append({"role": "system", "content": section})
    for message in messages:
        role = message.get("role")
        if role == "assistant" and message.get("tool_calls"):
            text = _text(message.get("content"))
            blocks = "\n".join(_call_block(c) for c in message["tool_calls"])
            folded = {k: v for k, v in message.items() if k != "tool_calls"}
            out.append({**folded, "content": f"{text}\n{blocks}" if text else blocks})
        elif role == "tool":
            block = f"<tool_response>\n{_text(message.get('content'))}\n</tool_response>"
            if out and out[-1].get("role") == "user" and isinstance(out[-1].get("content"), str):
                out[-1] = {**out[-1], "content": f"{out[-1]['content']}\n{block}"}
            else:
                out.append({"role": "user", "content": block})
        elif role == "user" and out and out[-1].get("role") == "user" and isinstance(out[-1].get("content"), str) \
                and isinstance(message.get("content"), str):
            out[-1] = {**out[-1], "content": f"{out[-1]['content']}\n\n{message['content']}"}
        else:
            out.append(message)
    return out
