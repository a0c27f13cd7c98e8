"""The MCP tool server the agents of `make agents` call (stdio; run by each agent, from the venv
`make agents` makes with the `mcp` SDK, never imported by the server or the tests).

One tool in the embedded model's curriculum shape (`verb_object`, a typed parameter; see
`tools/agent_curriculum.py`): `get_stock(path: int)`, whose result is a fixed JSON object. The
harness finds its value (``agents.STOCK.value``) in a later request to tell that the tool's result went back
to the model.
"""

from __future__ import annotations

import json

from agents import STOCK
from mcp.server.mcpserver import MCPServer

server = MCPServer(STOCK.server)


@server.tool()
def get_stock(path: int) -> str:
    """Get a stock."""
    return json.dumps({"status": "ok", "value": STOCK.value})


if __name__ == "__main__":
    server.run("stdio")
