"""MCP tool servers as environments (common/envs_mcp.py): a server written with the real `mcp` package's MCPServer
(FastMCP's successor in the SDK), on stdio (a server and a session per episode) and on Streamable HTTP (one server the
test starts on localhost, a session per episode), played in the live environment processes by test_tools.py's
scripted engine; a server that dies mid-episode, on stdio and over HTTP; what a server that does not start says."""

import socket
import subprocess
import sys
import time

import pytest

from common.env_processes import EnvProcesses
from common.envs import episode_spec, load_env, load_environments
from common.isolation import REPORTED_FAILURES
from common.tools import render
from test_tools import batch_of, call, play, row

SERVER = '''
import os
import sys

from mcp.server.mcpserver import MCPServer

server = MCPServer("counter", log_level="WARNING")
total = {"n": 0}


@server.tool()
def add(n: int) -> int:
    """Add to this server's running total.

    Args:
        n: What to add.
    """
    total["n"] += n
    return total["n"]


@server.tool()
def crash() -> str:
    """End the server."""
    os._exit(3)


if __name__ == "__main__":
    if len(sys.argv) > 1:
        server.run("streamable-http", host="127.0.0.1", port=int(sys.argv[1]))
    else:
        server.run()
'''


@pytest.fixture(scope="module")
def server_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("mcp") / "counter_server.py"
    path.write_text(SERVER)
    return str(path)


def played(tokenizer, tmp_path, spec: str, rows: list[dict], script: dict):
    environments = load_environments(episode_spec(spec, None))
    batch = batch_of(tokenizer, tmp_path, rows, environments)
    env_calls = EnvProcesses(environments.spec, 2, timeout=60)
    try:
        return environments, batch | play(tokenizer, batch, environments, script, env_calls)
    finally:
        env_calls.close()


def test_a_stdio_server_gives_each_episode_its_own_session(tool_tokenizer, server_file, tmp_path, capsys):
    tokenizer = tool_tokenizer
    script = {
        "first?": [call("add", n=2), call("add", n=3), "5"],
        "second?": [call("add", n=10), "10"],
        "broken?": [call("crash"), "never"],
    }
    REPORTED_FAILURES.clear()
    rows = [row("first?"), row("second?"), row("broken?")]
    environments, episodes = played(tokenizer, tmp_path, f"mcp:python {server_file}", rows, script)
    assert environments.names == ["counter"] and list(environments.schemas("counter")) == ["add", "crash"]
    assert episodes["ending"].tolist() == ["answered", "answered", "error"]  # a server that died ends its episode alone
    assert episodes["episode_score"].tolist() == [None, None, 0.0]
    assert "the environment failed (EnvironmentLost)" in capsys.readouterr().err
    # each episode's own server: the second's total starts at 0; the episode is the template's conversation
    tool_call = lambda n: {"type": "function", "function": {"name": "add", "arguments": {"n": n}}}  # noqa: E731
    conversation = [{"role": "user", "content": "first?"}]
    for n, total in ((2, "2"), (3, "5")):
        conversation += [{"role": "assistant", "content": "", "tool_calls": [tool_call(n)]}]
        conversation += [{"role": "tool", "name": "add", "content": total}]
    conversation += [{"role": "assistant", "content": "5"}]
    schemas = list(environments.schemas("counter").values())
    length = int(episodes["attention_mask"][0].sum() - episodes["prompt_mask"][0].sum())
    ids = episodes["prompts"][0][episodes["prompt_mask"][0].bool()].tolist() + episodes["responses"][0][:length].tolist()
    assert tokenizer.decode(ids) == render(tokenizer, conversation, schemas, add_generation_prompt=False).removesuffix("\n")
    assert "<tool_response>\n10\n</tool_response>" in tokenizer.decode(episodes["responses"][1])


def test_a_server_over_http_on_localhost(tool_tokenizer, server_file, tmp_path):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = subprocess.Popen([sys.executable, server_file, str(port)], stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 60
        while time.time() < deadline:  # until it listens
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.2)
        script = {"one?": [call("add", n=4), "4"], "broken?": [call("add", n=1), call("crash"), "never"]}
        url = f"http://127.0.0.1:{port}/mcp"
        _, episodes = played(tool_tokenizer, tmp_path, f"mcp:{url}", [row("one?")], script)
        REPORTED_FAILURES.clear()
        _, killed = played(tool_tokenizer, tmp_path, f"mcp:{url}", [row("broken?")], script)  # the server dies mid-episode
        assert server.wait(timeout=30) == 3
    finally:
        server.kill()
        server.wait()
    assert episodes["ending"].tolist() == ["answered"] and episodes["tool_errors"].tolist() == [0]
    assert "<tool_response>\n4\n</tool_response>" in tool_tokenizer.decode(episodes["responses"][0])
    assert killed["ending"].tolist() == ["error"] and killed["episode_score"].tolist() == [0.0]  # counted, score 0


def test_a_server_that_does_not_start_stops_the_run_at_once(tmp_path):
    with pytest.raises(ValueError, match=r"--env 'mcp:python .*nowhere.py': the MCP server did not list its tools"):
        load_env(f"mcp:python {tmp_path}/nowhere.py")
