"""verifiers environments (prime-rl's) as environments: `--env verifiers:my_env.py` (or `verifiers:my_env_module`), whose
`load_environment()` returns a `vf.MultiTurnEnv` of the verifiers API that prime-rl's environments are written in
(`MultiTurnEnv`, `SingleTurnEnv`, `ToolEnv`, `StatefulToolEnv`, `Rubric`; verifiers 0.1.14, whose 0.4 dropped it).

The environment is loaded once in each process and plays each episode on a `State` of its own, as its rollout would:
`init_state` and `setup_state` from the row (its `prompt`; its `answer`, else `ground_truth`; its `info`, else
`extra_info`), each model turn an assistant message. A `MultiTurnEnv` becomes a step(text) environment (common/envs.py):
its stop conditions (`is_completed`) end the episode, else `env_response(messages, state)` answers, its messages' text
the environment's answer. A `ToolEnv` offers its tools (`tool_defs`) through the chat template; each call goes to its
`call_tool` (after `update_tool_args` for a `StatefulToolEnv`). When the episode ends, its rubric scores it
(`score_rollout`, each reward function by its weight), so its rows need no reward function.
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import inspect
import json
import os
import threading

PIP = "pip install 'verifiers==0.1.14'"  # the last verifiers with the MultiTurnEnv API at its top level beside mcp 2


def verifiers_env_class(target: str, flag: str):
    """The environment class of `--env verifiers:target`, the module or file whose load_environment() builds it."""
    try:
        import verifiers as vf
    except ImportError:
        vf = None
    if not hasattr(vf, "MultiTurnEnv"):  # verifiers 0.4 has none: its API is verifiers.v1's
        raise ValueError(f"{flag}: verifiers with its MultiTurnEnv API is not installed; {PIP}")
    try:
        module = load_user_module(target)
    except ImportError as error:
        raise ValueError(f"{flag}: {target} does not import ({error})") from None
    if not callable(getattr(module, "load_environment", None)):
        raise ValueError(f"{flag}: {target} has no load_environment() that returns the verifiers environment")
    environment = module.load_environment()
    if not isinstance(environment, vf.MultiTurnEnv):
        raise ValueError(
            f"{flag}: load_environment() returned {type(environment).__name__}; the adapter plays a vf.MultiTurnEnv "
            "(SingleTurnEnv, ToolEnv and StatefulToolEnv are ones)"
        )
    name = os.path.basename(target).removesuffix(".py").rpartition(".")[2]
    if isinstance(environment, vf.ToolEnv):
        schemas = {
            tool.name: {
                "type": "function",
                "function": {"name": tool.name, "description": tool.description, "parameters": tool.parameters},
            }
            for tool in environment.tool_defs
        }
        return type(name, (VerifiersTools,), {"environment": environment, "tool_schemas": schemas})
    return type(name, (VerifiersTurns,), {"environment": environment})


def load_user_module(target: str):
    """The module of a file `path/to/my_env.py`, or of an importable module's name."""
    from common.isolation import load_user_file

    return load_user_file(target) if target.endswith(".py") and os.path.isfile(target) else importlib.import_module(target)


@functools.cache
def event_loop() -> asyncio.AbstractEventLoop:
    """This process's loop for the environment's coroutines, on a thread of its own: every episode's state and what
    the environment made lives on one loop."""
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    return loop


def settled(value):
    """`value`, or what it returns once awaited on the event loop: verifiers' hooks may be coroutines or not."""
    if inspect.isawaitable(value):
        return asyncio.run_coroutine_threadsafe(value, event_loop()).result()
    return value


def model_client():
    """A verifiers Client that stands for the model init_state records: the run plays the model's turns itself."""
    from verifiers.clients.client import Client

    def refuse(*args, **kwargs):
        raise NotImplementedError("the run plays the model's turns; the environment does not call a model")

    return type("RunsModel", (Client,), {name: refuse for name in Client.__abstractmethods__})(None)


class VerifiersEpisode:
    """One episode of the environment: its verifiers State and its conversation, scored by its rubric at the end."""

    environment = None

    def reset(self, prompt, ground_truth=None, extra_info=None, **row) -> None:
        rollout_input = {"prompt": prompt, "example_id": row.get("example_id", 0), "info": row.get("info", extra_info or {})}
        if row.get("answer", ground_truth) is not None:
            rollout_input["answer"] = str(row.get("answer", ground_truth))
        self.state = settled(self.environment.init_state(rollout_input, model_client(), "hybridrl"))
        settled(self.environment.setup_state(self.state))
        self.messages = list(self.state["prompt"])

    def played(self, message) -> bool:
        """Add the model's turn `message` to the conversation and the state's trajectory; whether that ends it."""
        from verifiers.types import TrajectoryStep

        blank = dict(response=None, tokens=None, reward=None, advantage=None, is_truncated=False, extras={})  # not yet known
        turn = dict(prompt=list(self.messages), completion=[message], trajectory_id=self.state["trajectory_id"])
        step = TrajectoryStep(**turn, **blank)
        settled(self.environment.add_trajectory_step(self.state, step))
        self.messages.append(message)
        return settled(self.environment.is_completed(self.state))

    def get_reward(self, final_turn: str | None = None) -> float:
        """The rubric's score of the conversation (its model's final answer added, for tools), once its cleanup ran."""
        from verifiers.types import AssistantMessage

        if final_turn is not None:
            self.played(AssistantMessage(content=final_turn))
        settled(self.environment.cleanup(self.state))  # renders state["completion"] from the trajectory, as a rollout
        settled(self.environment.rubric.score_rollout(self.state))
        return self.state["reward"]


class VerifiersTurns(VerifiersEpisode):
    """A MultiTurnEnv: each model turn is answered by its env_response, until one of its stop conditions holds."""

    def step(self, text: str) -> str | float:
        from verifiers.types import AssistantMessage

        if self.played(AssistantMessage(content=text)):
            return 0.0  # the episode ends; get_reward scores it
        reply = settled(self.environment.env_response(self.messages, self.state))
        self.messages += reply
        if self.state.get("final_env_response") is not None:  # its last word, which no model turn follows
            return 0.0
        return "\n".join(text_of(message) for message in reply)


class VerifiersTools(VerifiersEpisode):
    """A ToolEnv: its tools answer the model's calls; a turn's calls make one assistant message, its results follow."""

    tool_schemas: dict = {}

    def reset(self, **row) -> None:
        super().reset(**row)
        self.calls, self.results = [], []

    def call(self, name: str, **arguments) -> str:
        """What tool `name` answered, as text; what it raises, it raises, for the model to read."""
        from verifiers.types import AssistantMessage, ToolCall, ToolMessage

        call = ToolCall(id=f"call_{len(self.messages)}_{len(self.calls)}", name=name, arguments=json.dumps(arguments))
        self.calls.append(call)
        if hasattr(self.environment, "update_tool_args"):  # a StatefulToolEnv: it puts the state into the arguments
            so_far = [*self.messages, AssistantMessage(tool_calls=list(self.calls)), *self.results]
            arguments = self.environment.update_tool_args(name, arguments, so_far, self.state)
        try:
            result = settled(self.environment.call_tool(name, arguments, call.id))
        except Exception as error:
            self.results.append(ToolMessage(tool_call_id=call.id, content=self.environment.error_formatter(error)))
            raise
        self.results.append(result)
        return text_of(result)

    def turn_reward(self) -> None:
        """The turn's calls end: their assistant message and results join the conversation (no reward of a turn)."""
        from verifiers.types import AssistantMessage

        self.played(AssistantMessage(tool_calls=self.calls))
        self.messages += self.results
        self.calls, self.results = [], []


def text_of(message) -> str:
    """A verifiers message's text: its content, or its parts' text."""
    content = message.content
    if isinstance(content, str):
        return content
    return "".join(getattr(part, "text", "") or "" for part in content or [])
