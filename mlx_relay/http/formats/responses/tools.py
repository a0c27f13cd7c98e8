"""Responses tools: the request's `tools` and `tool_choice` as the chat request's (function
tools only; OpenAI's hosted tools are left out), and namespaces: the names the model sees, and
the names the client gets back.

Codex sends MCP tools grouped, `{"type": "namespace", "name": "mcp__stock", "tools": [{"type":
"function", "name": "delete_stock", ...}]}`, and dispatches a call only when its `function_call`
item names both, `{"type": "function_call", "namespace": "mcp__stock", "name": "delete_stock",
...}`. The model sees one flat list of functions, so each inner tool gets a qualified name,
`<namespace>__<name>` (Codex's own MCP naming; `mcp__stock__delete_stock`). Unambiguous by
construction: a qualified name that another tool already has (a flat tool of that name, or two
namespaces that join to the same text, `a__b` + `c` and `a` + `b__c`) gets `_2`, `_3`, ... appended,
and the table, not the text, maps it back. A `function_call` input item carrying a `namespace`
renders under the same qualified name, so the history reads as the model wrote it.
"""

from __future__ import annotations

from typing import Any

import msgspec

from mlx_relay.chat.types import FunctionDef, NamedToolChoice, ToolChoice, ToolDef
from mlx_relay.errors import InvalidRequest
from mlx_relay.http.formats.responses.types import FunctionTool, FunctionToolChoice, convert, type_of

SEPARATOR = "__"


class ToolNames:
    """One request's table: qualified name <-> (namespace, name)."""

    def __init__(self) -> None:
        self._inner: dict[str, tuple[str, str]] = {}  # qualified -> (namespace, name)
        self._qualified: dict[tuple[str, str], str] = {}
        self._taken: set[str] = set()

    def plain(self, name: str) -> None:
        """A flat tool's name: no namespaced tool may take it."""
        self._taken.add(name)

    def add(self, namespace: str, name: str) -> str:
        """The qualified name of `name` in `namespace` (the same one if added before)."""
        key = (namespace, name)
        if key in self._qualified:
            return self._qualified[key]
        base = qualified = f"{namespace}{SEPARATOR}{name}"
        n = 1
        while qualified in self._taken:
            n += 1
            qualified = f"{base}_{n}"
        self._taken.add(qualified)
        self._qualified[key] = qualified
        self._inner[qualified] = key
        return qualified

    def qualified(self, namespace: str | None, name: str) -> str:
        """The name the model knows for a call the client sends back (no namespace: as it is)."""
        if not namespace:
            return name
        return self._qualified.get((namespace, name), f"{namespace}{SEPARATOR}{name}")

    def split(self, qualified: str) -> tuple[str | None, str]:
        """A name the model wrote as (namespace, name); a flat tool's (or an unknown) name has none."""
        return self._inner.get(qualified, (None, qualified))


_HOSTED_TOOLS = frozenset({"web_search", "web_search_preview", "file_search", "image_generation", "code_interpreter",
                           "computer_use_preview", "local_shell", "mcp", "tool_search"})


def parse_tools(raw: list[dict[str, Any]] | None) -> tuple[list[FunctionTool], ToolNames]:
    """Function tools only; the flat Responses shape, or the nested Chat Completions one. A
    namespace's tools (Codex's MCP tools) are offered under qualified names (`ToolNames`);
    the table maps the model's calls back."""
    found: list[tuple[str | None, FunctionTool]] = []
    for i, tool in enumerate(raw or []):
        where = f"tools[{i}]"
        if type_of(tool, where) != "namespace":
            found.extend((None, t) for t in _function_tool(tool, where))
            continue
        namespace = tool.get("name")
        if not isinstance(namespace, str) or not namespace:
            raise InvalidRequest(f"{where}.name: a namespace needs a name", param=f"{where}.name")
        for j, inner in enumerate(tool.get("tools") or []):
            if isinstance(inner, dict):
                found.extend((namespace, t) for t in _function_tool(inner, f"{where}.tools[{j}]", nested=True))
    names = ToolNames()
    for namespace, t in found:  # flat names first: a qualified name never takes one
        if namespace is None:
            names.plain(t.name)
    tools = [t if ns is None else msgspec.structs.replace(t, name=names.add(ns, t.name)) for ns, t in found]
    return tools, names


def _function_tool(tool: dict[str, Any], where: str, nested: bool = False) -> list[FunctionTool]:
    """The tool as a function tool (none for OpenAI's hosted tools)."""
    kind = type_of(tool, where)
    if kind == "custom":  # a freeform tool: offered as a function with one string `input`
        tool = {"type": "function", "name": tool.get("name"), "description": tool.get("description"),
                "parameters": {"type": "object", "properties": {"input": {"type": "string"}}, "required": ["input"]}}
        kind = "function"
    if kind in _HOSTED_TOOLS:  # OpenAI-hosted (web search, image generation, ...): not ours to run
        return []
    if kind != "function":
        what = "namespaces do not nest" if nested and kind == "namespace" else "only function tools are"
        raise InvalidRequest(f"{where}: tool type '{kind}' is not supported; {what}", param=f"{where}.type")
    if "name" not in tool and isinstance(tool.get("function"), dict):
        tool = {**tool["function"], "type": "function"}
    return [convert(tool, FunctionTool, where)]


def parse_tool_choice(raw: str | dict[str, Any] | None, tools: list[FunctionTool], names: ToolNames | None = None
                      ) -> tuple[ToolChoice, str | FunctionToolChoice]:
    """`tool_choice` for the ChatRequest, and as the response echoes it (a namespaced function by
    its namespace and inner name)."""
    if raw is None:
        return "auto", "auto"
    if isinstance(raw, str):
        if raw not in ("auto", "none", "required"):
            raise InvalidRequest(f"tool_choice '{raw}' is not supported (auto, none, required or a function)",
                                 param="tool_choice")
        if raw == "required" and not tools:
            raise InvalidRequest("tool_choice 'required' needs at least one tool", param="tool_choice")
        return raw, raw  # type: ignore[return-value]
    kind = type_of(raw, "tool_choice")
    if kind != "function":
        raise InvalidRequest(f"tool_choice type '{kind}' is not supported; only function", param="tool_choice")
    choice = convert(raw, FunctionToolChoice, "tool_choice")
    namespace = choice.namespace if isinstance(choice.namespace, str) else None
    name = (names or ToolNames()).qualified(namespace, choice.name)
    if name not in {t.name for t in tools}:
        raise InvalidRequest(f"tool_choice names the function '{choice.name}', which is not among the tools",
                             param="tool_choice")
    return NamedToolChoice(name), choice


def to_tool_defs(tools: list[FunctionTool]) -> list[ToolDef] | None:
    if not tools:
        return None
    return [ToolDef(FunctionDef(t.name, t.description, t.parameters, t.strict)) for t in tools]
