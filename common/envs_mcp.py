"""MCP tool servers as environments: `--env "mcp:python my_server.py"`, a server on stdio, started for each episode
(its own session, its own process), or `--env mcp:http://127.0.0.1:8000/mcp`, a server already running, reached over
Streamable HTTP with a session per episode. The server's tools, listed through the `mcp` package's client when the run
starts, are offered through the chat template as --tools are; each call goes to the episode's session.

A tool that reports an error answers the model with it (as a tool that raises does); a server that dies or stops
answering ends the episodes using it with score 0 (common/tools.py's EnvironmentLost), and the next episode starts its
own server again (stdio).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import shlex
import sys
import threading

LIST_SECONDS = 60.0  # how long the run waits for a server's tool list when it starts


def mcp_env_class(target: str, flag: str):
    """The environment class of `--env mcp:target`, its tools listed from the server."""
    try:
        import mcp  # noqa: F401
    except ImportError:
        raise ValueError(f"{flag}: the mcp package is not installed; pip install mcp") from None
    try:
        name, tools = asyncio.run(asyncio.wait_for(listed(target), LIST_SECONDS))
    except Exception as error:
        raise ValueError(
            f"{flag}: the MCP server did not list its tools ({type(error).__name__}: {error}); check that "
            f"{target!r} starts a server on stdio, or is the URL of one that runs"
        ) from None
    schemas = {
        tool.name: {
            "type": "function",
            "function": {"name": tool.name, "description": tool.description or "", "parameters": tool.input_schema},
        }
        for tool in tools
    }
    return type(name, (MCPTools,), {"target": target, "tool_schemas": schemas})


def server_of(target: str):
    """What the `mcp` client connects to: a URL as it is, a command as a server on stdio, whose own log goes to this
    process's standard error (the real one, where a test captures sys.stderr)."""
    from mcp import StdioServerParameters
    from mcp.client.stdio import stdio_client

    if target.startswith(("http://", "https://")):
        return target
    command = shlex.split(target)
    program = sys.executable if command[0] == "python" else command[0]  # `python`: the run's own
    return stdio_client(StdioServerParameters(command=program, args=command[1:]), errlog=sys.__stderr__)


async def listed(target: str) -> tuple[str, list]:
    """The server's name and its tools."""
    from mcp import Client

    async with Client(server_of(target)) as client:
        tools = (await client.list_tools()).tools
        return client.server_info.name if client.server_info else "mcp", tools


class MCPTools:
    """One episode's session with an MCP server, held by a task of an event loop on a thread of its own, so that the
    client's context is entered and left in one task."""

    target = ""
    tool_schemas: dict = {}

    def reset(self, **row) -> None:
        self.loop = asyncio.new_event_loop()
        self.runner = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.runner.start()
        opened = concurrent.futures.Future()
        self.session = asyncio.run_coroutine_threadsafe(self._session(opened), self.loop)
        opened.result()

    async def _session(self, opened: concurrent.futures.Future) -> None:
        from mcp import Client

        self.calls = asyncio.Queue()
        try:
            async with Client(server_of(self.target)) as client:
                opened.set_result(None)
                while (call := await self.calls.get()) is not None:
                    name, arguments, answer = call
                    try:
                        answer.set_result(await client.call_tool(name, arguments))
                    except Exception as error:
                        answer.set_exception(error)
        except BaseException as error:
            if not opened.done():
                opened.set_exception(error)
            raise

    def call(self, name: str, **arguments) -> str:
        """What tool `name` of the server answered, as text; an error it reports is raised, for the model to read."""
        from common.tools import EnvironmentLost

        answer = concurrent.futures.Future()
        self.loop.call_soon_threadsafe(self.calls.put_nowait, (name, arguments, answer))
        concurrent.futures.wait([answer, self.session], return_when=concurrent.futures.FIRST_COMPLETED)
        try:
            if not answer.done():  # the session ended first: the server exited
                self.session.result()
            result = answer.result()
        except Exception as error:  # the session broke: the server died or closed it
            raise EnvironmentLost(f"the MCP server {self.target!r} is gone: {type(error).__name__}: {error}") from error
        if not answer.done():
            raise EnvironmentLost(f"the MCP server {self.target!r} ended the session")
        text = "\n".join(block.text for block in result.content if getattr(block, "text", None) is not None)
        if result.is_error:
            raise RuntimeError(text)
        return text

    def close(self) -> None:
        if not getattr(self, "runner", None):
            return
        self.loop.call_soon_threadsafe(self.calls.put_nowait, None)
        try:
            self.session.result(timeout=5)
        except BaseException:  # it broke, or did not end: its task is cancelled, the server's process with it
            self.session.cancel()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.runner.join(5)
