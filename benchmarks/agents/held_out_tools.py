"""Tools the embedded model never saw (issue 44): the vocabulary of `make agents`' held-out scene
and of `held_out.py`'s rate, drawn apart from everything relay-tiny-agent was trained on.

The model was trained on the curriculum's tools (`tools/agent_curriculum.py`: names `verb_object`
from its verbs and objects, typed parameters from its parameter names, descriptions "Verb a
object.") and on the agents' own requests with one MCP tool, `get_stock(path)` of the server
`stock`, asked for in the phrasings of `tools/agent_scenes.py`. A held-out tool here takes its
server name, verb, object and parameter from the lists below, each word absent from those
vocabularies and from every recorded request the scenes train on
(`tests/test_held_out_tools.py` checks both), its description and the user's sentence from
templates of their own. The parameter is an integer (as `path` was): what differs is the name,
the schema's words and the request's phrasing, not the kind of value.

No MLX, no server, no numpy (the MCP servers' venv has none): plain data and a seeded draw
(Python's `random.Random`, seeded by the caller's tuple written out).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from typing import Any

SERVERS = ("harbor", "quarry", "meadow", "beacon", "lagoon", "summit")
VERBS = ("varnish", "calibrate", "reroute", "quarantine", "tally", "rewind", "appraise", "defrost")
OBJECTS = ("parcel", "turbine", "glacier", "lantern", "satchel", "kettle", "anvil", "walrus")
PARAMS = ("hatch", "berth", "gauge", "slot", "crate", "bay")
DESCRIPTIONS = (
    "{Verb} the {obj} with the given {param}.",
    "{Verb}s one {obj}, chosen by its {param}.",
    "Tool to {verb} a {obj}. Takes the {obj}'s {param}.",
)
PHRASINGS = (
    "Could you {verb} the {obj} whose {param} is {n}?",
    "{Verb} {obj} {n} for me, please ({param} {n}).",
    "I need the {obj} at {param} {n}; {verb} it.",
    "Use the {server} server to {verb} the {obj} with {param} {n}.",
)

#: the one tool `make agents`' held-out scene serves (`mcp_held_out.py`), drawn once and kept: the
#: MCP server's Python signature names its parameter, so it is written there by hand and checked
#: against this (`tests/test_held_out_tools.py`)
SCENE_SEED = (44, 1)
SCENE_VALUE = "731902"  # what the scene's tool returns; found in a later request, its result went back


@dataclass(frozen=True)
class HeldOutTool:
    server: str
    verb: str
    obj: str
    param: str
    description: str
    sentence: str  # the user's request for it, with the argument's value
    n: int  # the argument's value

    @property
    def tool(self) -> str:
        return f"{self.verb}_{self.obj}"

    @property
    def schema(self) -> dict[str, Any]:
        """Its input schema as the MCP SDK writes a `(param: int)` signature's."""
        return {"type": "object", "properties": {self.param: {"title": self.param.capitalize(), "type": "integer"}},
                "required": [self.param], "title": f"{self.tool}Arguments"}

    def valid(self, arguments: Any) -> bool:
        """Whether a call's arguments are this schema's: an object with the integer parameter, nothing else."""
        args = as_object(arguments)
        return (args is not None and set(args) == {self.param} and isinstance(args[self.param], int)
                and not isinstance(args[self.param], bool))

    def exact(self, arguments: Any) -> bool:
        """Valid, and the value the user asked for."""
        return self.valid(arguments) and as_object(arguments)[self.param] == self.n  # type: ignore[index]


def as_object(arguments: Any) -> dict[str, Any] | None:
    """A call's arguments as an object (sent as one, or as its JSON text), else None."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    return arguments if isinstance(arguments, dict) else None


def draw(key: tuple[int, ...]) -> HeldOutTool:
    """One held-out tool and the sentence asking for it, drawn from a generator seeded by `key`."""
    rng = random.Random(",".join(str(k) for k in key))
    server, verb, obj, param = (rng.choice(w) for w in (SERVERS, VERBS, OBJECTS, PARAMS))
    n = rng.randrange(2, 1000)
    words = {"verb": verb, "Verb": verb.capitalize(), "obj": obj, "param": param, "server": server, "n": n}
    return HeldOutTool(server, verb, obj, param, rng.choice(DESCRIPTIONS).format(**words),
                       rng.choice(PHRASINGS).format(**words), n)


def scene_tool() -> HeldOutTool:
    return draw(SCENE_SEED)
