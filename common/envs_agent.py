"""An agent program as an episode's environment: `--agent path/to/file.py:solve` runs `solve(row, client)` in the
environment processes (common/env_processes.py), each session on its thread, with an `openai` client whose base URL is
its session's on the run's endpoint (common/agent_endpoint.py). The whole of `solve` is the episode's first call, so
--agent-timeout bounds it, and what it raises ends the session with score 0, as an environment's failure does.
"""

from __future__ import annotations

import asyncio
import inspect
import os

from common.isolation import load_user_file


def load_agent(spec: str):
    """The function `path/to/file.py:solve` names, checked to take (row, client); a ValueError that names the flag."""
    path, _, name = spec.rpartition(":")
    if not path or not name:
        raise ValueError(f"--agent '{spec}': write path/to/file.py:function, a function solve(row, client)")
    if not os.path.isfile(path):
        raise ValueError(f"--agent '{spec}': no file {path}")
    solve = getattr(load_user_file(path), name, None)
    if not inspect.isfunction(solve):
        raise ValueError(f"--agent '{spec}': {path} defines no function '{name}'")
    try:
        inspect.signature(solve).bind(None, None)
    except TypeError:
        raise ValueError(
            f"--agent '{spec}': {name}{inspect.signature(solve)} cannot be called as {name}(row, client)"
        ) from None
    return solve


def agent_env_class(spec: str) -> type:
    """The environment class that runs the agent of `spec`: its reset runs the whole session, get_reward gives what the
    agent returned (None: the reward function scores the session's last completion)."""
    solve = load_agent(spec)

    class AgentSession:
        def reset(self, row: dict, base_url: str, timeout: float) -> None:
            import openai

            client = dict(base_url=base_url, api_key="hybridrl", max_retries=0, timeout=timeout)  # a refusal is final
            if inspect.iscoroutinefunction(solve):
                self.reward = asyncio.run(solve_async(solve, row, client))
            else:
                with openai.OpenAI(**client) as session_client:
                    self.reward = solve(row, session_client)

        def get_reward(self):
            return self.reward

    return AgentSession


async def solve_async(solve, row: dict, client: dict):
    import openai

    async with openai.AsyncOpenAI(**client) as session_client:
        return await solve(row, session_client)
