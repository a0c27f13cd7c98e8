"""The MCP tool server of `make agents`' held-out scene (stdio; run by each agent, from the venv
`make agents` makes with the `mcp` SDK, never imported by the server or the tests).

One tool the embedded model never saw (`held_out_tools.scene_tool()`: its server name, tool name,
parameter and description from a vocabulary apart from the training data's). The SDK reads a
tool's schema from its Python signature, so the name and parameter are written here as that draw
made them (`tests/test_held_out_tools.py` checks they agree). The harness finds its value
(`held_out_tools.SCENE_VALUE`) in a later request to tell that the tool's result went back to the model.
"""

from __future__ import annotations

import json

from held_out_tools import SCENE_VALUE, scene_tool
from mcp.server.mcpserver import MCPServer

TOOL = scene_tool()
server = MCPServer(TOOL.server)


@server.tool(description=TOOL.description)
def quarantine_satchel(slot: int) -> str:
    return json.dumps({"status": "ok", "value": SCENE_VALUE})


if __name__ == "__main__":
    server.run("stdio")
