"""An MCP tool server for the multiply-tool demo: `multiply(a, b)`, as the built-in tool (common/tools.py), served by the
`mcp` package's MCPServer on stdio (a server per episode) or, given a port, on Streamable HTTP at /mcp.

    python algos/grpo_hybrid.py --env "mcp:python examples/mcp/multiply_server.py" --chat-template chatml_tools \
        --train-files <the multiply_tool demo's train.parquet> ...
"""

import sys
from typing import Annotated

from mcp.server.mcpserver import MCPServer
from pydantic import Field

server = MCPServer("multiplier", log_level="WARNING")


@server.tool()
def multiply(
    a: Annotated[int, Field(description="The first factor.")], b: Annotated[int, Field(description="The second factor.")]
) -> int:
    """Multiply two integers."""
    return a * b


if __name__ == "__main__":
    if len(sys.argv) > 1:
        server.run("streamable-http", host="127.0.0.1", port=int(sys.argv[1]))
    else:
        server.run()
