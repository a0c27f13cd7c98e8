"""Responses tool namespaces: the names the model sees, and the names the client gets back.

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
