"""The MCP server of the MCP example: the calculator of examples/tool_calling, served over stdio with
the MCP SDK's MCPServer (its FastMCP). verl_fast starts it (rollout.multi_turn.mcp_servers), lists its
tools into the chat template and calls them in its tool workers."""

import sys
from pathlib import Path

from mcp.server.mcpserver import MCPServer

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tool_calling"))
from tools import calculator  # noqa: E402 - the tool_calling example's function, served here

server = MCPServer("calculator")
server.tool()(calculator)

if __name__ == "__main__":
    server.run()  # stdio
