"""Environments: what an episode's model turns are answered by (a tool, a game, a sandbox), and how one is called.

An environment is a plain Python class, named like a reward (`--env path/to/file.py:ClassName`), or built in
(`--env calculator`); one object lives for one episode. It takes one of two shapes:

    class Echo:                      # step(text): it reads the model's turn itself
        stop_strings = ["</call>"]   # optional: text that ends a model turn, besides EOS

        def reset(self, **row):      # a new episode, for one row of the data
            self.truth = row["ground_truth"]

        def step(self, text):        # the model's turn, decoded
            # a string: the environment's answer, and the episode goes on;
            # a number: the episode's score, and it ends;
            # None: it ends, and the reward function scores this last turn
            ...

    class Store:                     # tools: its public methods, called as the chat template frames calls
        def reset(self, ground_truth, **row):   # the row's columns by name: take what you need, **row the rest
            self.stock = {"apple": 3}

        def count(self, item: str) -> int:
            \"\"\"How many of an item the store holds.

            Args:
                item: The item's name.
            \"\"\"
            return self.stock.get(item, 0)

        def get_reward(self) -> float:   # optional: the episode's score, when it ends; else the reward function's
            ...                          # (a parameter `final_turn` gets the model's answer that made no call, else None)

        def close(self):                 # optional: release what the episode held, however it ended
            ...

The second is TRL's `environment_factory` shape, exactly: `reset` gets every column of the data row as keywords (the
`prompt` too; `data_source`, `ground_truth` and `extra_info` as verl's rows name them, where the row has no such
column), and may return text that is added to the prompt's last user message; a tool that raises answers the model
with the error. --tools functions (common/tools.py) are offered beside its methods, or alone without --env. An episode
of tools ends when the model answers without a call. Several environments, comma-separated, serve one run: a data
row's `env` (or TRL's `environment`) field names its own (the class's name, or the built-in's).

Either shape may also reward a turn: `turn_reward(self)`, if it has one, is called after each turn the environment
played (its step, or its tool calls) and returns that turn's reward (None: none). The episode's score is then the sum
of its turns' rewards and of its final score (the reward function's, step's number, get_reward's); PPO and
REINFORCE++ place each turn's reward on that turn's last token.

An episode's object is made, reset, called and closed in one process, on a thread of its own, and stays alive between
turns (common/env_processes.py): it may hold anything, a subprocess, a socket, a client. LiveEpisode below makes one
episode's calls; the play of episodes is common/episode_play.py, their batch common/episodes.py.
"""

from __future__ import annotations

import functools
import inspect
import math
import os
import re
import shlex
import traceback

from common.isolation import import_function, load_user_file
from common.tools import EnvironmentLost, call_tool, check_tool_template, load_tools, tool_schema

# public methods of an environment that are not tools: its life (reset, close), its turns and its rewards
NOT_TOOLS = ("reset", "close", "step", "get_reward", "turn_reward")


class Calculator:
    """The built-in tool: the model writes an expression in square brackets, `[37*48]`, and gets its value back,
    ended by a semicolon (`1776;`: the demo's tokenizer drops whitespace). A turn without a call is the model's
    answer: the episode ends and the reward function scores it."""

    stop_strings = ["]"]

    def step(self, text: str) -> str | None:
        call = re.search(r"\[([^\]]*)\]\s*$", text)
        if call is None:
            return None
        expression = call.group(1)
        if not re.fullmatch(r"[0-9+\-* ()]{1,32}", expression) or "**" in expression:  # no powers: 9**9**9 never ends
            return "error;"  # a tool answers a malformed call; it does not fail the episode
        try:
            return f"{eval(expression, {'__builtins__': {}})};"
        except SyntaxError:
            return "error;"


# the built-in environments, by name: the calculator, and a Python interpreter whose variables live for the episode
BUILTIN_ENVS = {"calculator": "common.envs:Calculator", "python": "common.python_env:PythonInterpreter"}


def load_env(spec: str):
    """A built-in environment by name, a game of another library (`gym:ID`, `textarena:ID`: common/envs_gym.py), an MCP
    server's tools (`mcp:COMMAND`, `mcp:URL`: common/envs_mcp.py), an OpenEnv environment (`openenv:MODULE:CLASS`,
    `openenv:URL`: common/envs_openenv.py), a verifiers environment (`verifiers:MODULE`: common/envs_verifiers.py), or
    the class `ClassName` of `path/to/file.py:ClassName`."""
    if spec in BUILTIN_ENVS:
        return import_function(BUILTIN_ENVS[spec])
    library, _, game_id = spec.partition(":")
    if library in ("gym", "textarena") and game_id:
        from common.envs_gym import gym_env_class

        return gym_env_class(library, game_id, f"--env '{spec}'")
    if library == "mcp" and game_id:
        from common.envs_mcp import mcp_env_class

        return mcp_env_class(game_id, f"--env '{spec}'")
    if library == "openenv" and game_id:
        from common.envs_openenv import openenv_env_class

        return openenv_env_class(game_id, f"--env '{spec}'")
    if library == "verifiers" and game_id:
        from common.envs_verifiers import verifiers_env_class

        return verifiers_env_class(game_id, f"--env '{spec}'")
    path, _, name = spec.rpartition(":")
    if not path or not name:
        raise ValueError(
            f"--env '{spec}': name a built-in ({', '.join(BUILTIN_ENVS)}), a game (gym:ID, textarena:ID), an adapter's "
            "environment (mcp:, openenv:, verifiers:; docs/other-environments.md) or write path/to/file.py:ClassName"
        )
    if not os.path.isfile(path):
        raise ValueError(f"--env '{spec}': no file {path}")
    env_cls = getattr(load_user_file(path), name, None)
    if not isinstance(env_cls, type):
        raise ValueError(f"--env '{spec}': {path} defines no class '{name}'")
    if not callable(getattr(env_cls, "step", None)) and not tool_methods(env_cls):
        raise ValueError(
            f"--env '{spec}': {name} has neither a step(text) method nor public methods that are tools (docs/tools.md)"
        )
    stop_strings = getattr(env_cls, "stop_strings", [])
    if not isinstance(stop_strings, (list, tuple)) or not all(isinstance(s, str) and s for s in stop_strings):
        raise ValueError(f"--env '{spec}': stop_strings must be a list of non-empty strings, got {stop_strings!r}")
    return env_cls


def tool_methods(env_cls) -> list[str]:
    """The names of `env_cls`'s tools: the public methods but NOT_TOOLS, or those its adapter listed (`tool_schemas`)."""
    if isinstance(getattr(env_cls, "tool_schemas", None), dict):
        return list(env_cls.tool_schemas)
    methods = inspect.getmembers(env_cls, inspect.isfunction)
    return [name for name, _ in methods if not name.startswith("_") and name not in NOT_TOOLS]


class Environments:
    """What --env and --tools name, loaded alike in the run and in every environment process: each environment's class
    by its name (None: --tools alone, under the name ""), and the standalone tools, which every environment that is not
    a step(text) one offers beside its methods. `spec`: the flags, as episode_spec writes them."""

    def __init__(self, classes: dict, tools: dict, spec: str = ""):
        self.classes, self.tools, self.spec = classes, tools, spec
        self.names = list(classes)
        self.stop_strings = sorted({s for c in classes.values() for s in getattr(c, "stop_strings", [])})
        self._schemas = {}
        for name in self.names:
            if self.reads_text(name) and tools:
                raise ValueError(
                    f"--tools with --env {name}: a step(text) environment reads the model's turns itself and offers no "
                    "tools; give the tools to an environment whose methods are tools, or drop --tools"
                )

    @classmethod
    def of(cls, env_cls) -> Environments:
        """One environment class alone, by its own name."""
        return cls({env_cls.__name__: env_cls}, {})

    def reads_text(self, name: str) -> bool:
        return callable(getattr(self.classes[name], "step", None))

    def scores(self, name: str) -> bool:
        return callable(getattr(self.classes[name], "get_reward", None))

    def tools_of(self, name: str, env=None) -> dict:
        """The tools of an episode of environment `name`: the standalone ones, then its methods, bound to `env` (to a
        bare instance, made without running its __init__, for their schemas)."""
        env_cls = self.classes[name]
        if env_cls is None:
            return dict(self.tools)
        env = object.__new__(env_cls) if env is None else env
        if isinstance(getattr(env_cls, "tool_schemas", None), dict):  # an adapter's: one `call` serves them all
            return self.tools | {tool: functools.partial(env.call, tool) for tool in env_cls.tool_schemas}
        return self.tools | {method: getattr(env, method) for method in tool_methods(env_cls)}

    def schemas(self, name: str) -> dict[str, dict] | None:
        """The JSON schemas of environment `name`'s tools by tool name; None for a step(text) environment."""
        if self.classes[name] is not None and self.reads_text(name):
            return None
        if name not in self._schemas:
            listed = getattr(self.classes[name], "tool_schemas", None) or {}
            tools = {tool: function for tool, function in self.tools_of(name).items() if tool not in listed}
            self._schemas[name] = {tool: tool_schema(function, f"--env {name}") for tool, function in tools.items()} | listed
        return self._schemas[name]

    def check(self, tokenizer, eos_token_ids: list[int]) -> dict[str, dict | None]:
        """Each environment's tools by name (see schemas), once the chat template is checked to render them
        (check_tool_template) if any environment has tools."""
        tools = {name: self.schemas(name) for name in self.names}
        every_schema = [schema for schemas in tools.values() for schema in (schemas or {}).values()]
        if any(schemas is not None for schemas in tools.values()):
            check_tool_template(tokenizer, every_schema, tokenizer.convert_ids_to_tokens(eos_token_ids))
        return tools


def episode_spec(env: str | None, tools: list[str] | None, agent: str | None = None) -> str:
    """--env, --tools and --agent as flags in one string: what an environment process loads (load_environments)."""
    flags = (["--env", env] if env else []) + (["--tools", *tools] if tools else [])
    return shlex.join(flags + (["--agent", agent] if agent else []))


def load_environments(spec: str) -> Environments:
    """The Environments of `spec` (episode_spec's flags): each of --env's comma-separated environments, by the
    built-in's or the class's name, and --tools' tools; or --agent's program, as the environment `agent`
    (common/envs_agent.py)."""
    flags, current = {"--env": [], "--tools": [], "--agent": []}, None
    for word in shlex.split(spec):
        if word in flags:
            current = word
        else:
            flags[current].append(word)
    if flags["--agent"]:
        from common.envs_agent import agent_env_class

        return Environments({"agent": agent_env_class(flags["--agent"][0])}, {}, spec)
    classes = {}
    for env_spec in ",".join(flags["--env"]).split(",") if flags["--env"] else []:
        env_cls = load_env(env_spec)
        name = env_spec if env_spec in BUILTIN_ENVS else env_cls.__name__
        if name in classes:
            raise ValueError(f"--env: two environments are named {name}; a data row's `env` field picks one by its name")
        classes[name] = env_cls
    tools = load_tools(flags["--tools"])
    both = sorted(set(tools) & {method for env_cls in classes.values() for method in tool_methods(env_cls)})
    if both:
        raise ValueError(f"--tools and --env both offer tools named {', '.join(both)}: rename one")
    return Environments(classes or {"": None}, tools, spec)


class LiveEpisode:
    """One episode's environment object, alive from its `open` request to its `finish`: each request of the episode
    (see handle) made on it in turn. A request that fails ends the episode: the object is closed at once."""

    def __init__(self, environments: Environments, name: str):
        self.environments, self.name, self.env, self.ended = environments, name, None, False

    def handle(self, request: tuple) -> tuple:
        """("ok", what the request returned) or ("error", kind, traceback); never raises. `request`: ("open", the
        row's columns), which makes and resets the object and returns the text reset added to the prompt (or None);
        ("text", the model's turn) for step(text), and ("tools", calls parsed by parse_tool_calls), which return the
        environment's answer and the turn's reward (see act); ("finish", whether get_reward scores the episode[, the
        model's final turn]), which returns that score (None: it has none, or get_reward returned None, and the reward
        function scores the episode) and closes the object."""
        try:
            if request[0] == "open":
                return "ok", self.open(request[1])
            if request[0] == "finish":
                self.ended = True
                try:
                    score = self.score(*request[2:]) if request[1] else None
                    return "ok", None if score is None else finite_score(score, "get_reward")
                finally:
                    self.close()
            return "ok", act(self.environments, self.name, self.env, request)
        except (Exception, SystemExit) as error:
            failure = traceback.format_exc()
            if not self.ended:
                self.ended = True
                failure += self.close_quietly()
            return "error", type(error).__name__, failure

    def open(self, columns: dict) -> str | None:
        env_cls = self.environments.classes[self.name]
        if env_cls is None:  # --tools alone: the tools are plain functions
            return None
        self.env = env_cls()
        if not callable(getattr(self.env, "reset", None)):
            return None
        text = self.env.reset(**reset_arguments(self.env.reset, columns))
        if text is not None and not isinstance(text, str):
            raise TypeError(f"reset returned {type(text).__name__}: return None, or text to add to the prompt")
        return text

    def score(self, final_turn: str | None = None) -> float:
        """get_reward's score; given the model's answer that made no call when it takes `final_turn`: a tool environment
        sees no other trace of it."""
        if "final_turn" in inspect.signature(self.env.get_reward).parameters:
            return self.env.get_reward(final_turn=final_turn)
        return self.env.get_reward()

    def close(self) -> None:
        """The object's close(), if it has one."""
        if callable(getattr(self.env, "close", None)):
            self.env.close()

    def close_quietly(self) -> str:
        """close(), never raising: the traceback of its failure, if it failed (after a failure: to add to its)."""
        try:
            self.close()
            return ""
        except (Exception, SystemExit):
            return "close() failed after that too:\n" + traceback.format_exc()


def reset_arguments(reset, columns: dict) -> dict:
    """What `reset` takes of a row's `columns`: all of them for a reset with **keywords (TRL's), else those it names."""
    parameters = inspect.signature(reset).parameters.values()
    if any(parameter.kind is parameter.VAR_KEYWORD for parameter in parameters):
        return columns
    return {parameter.name: columns[parameter.name] for parameter in parameters if parameter.name in columns}


def act(environments: Environments, name: str, env, action: tuple) -> tuple:
    """The environment's answer to the model's turn `action`, the turn's reward (turn_reward's, None without), and the
    first traceback of a tool that raised (None without). For ("text", turn): step's reply, a string, a score or None.
    For ("tools", calls): each call's (result, whether it is an error message); a tool that raises answers with the
    error, as TRL's do."""
    raised = None
    if action[0] == "text":
        reply = env.step(action[1])
        if not (reply is None or isinstance(reply, str)):
            reply = finite_score(reply, "step")
    else:
        tools, schemas = environments.tools_of(name, env), environments.schemas(name)
        reply = []
        for call in action[1]:
            if "error" in call:
                reply.append((call["error"], True))
            elif call["name"] not in tools:
                reply.append((f"error: there is no tool {call['name']}; the tools: {', '.join(tools)}", True))
            else:
                try:
                    reply.append(call_tool(tools[call["name"]], schemas[call["name"]], call["arguments"]))
                except EnvironmentLost:
                    raise
                except Exception as error:
                    reply.append((f"error: {type(error).__name__}: {error}", True))
                    raised = raised or traceback.format_exc()
    turn_reward = None
    if callable(getattr(env, "turn_reward", None)):
        turn_reward = env.turn_reward()
        turn_reward = None if turn_reward is None else finite_score(turn_reward, "turn_reward")
    return reply, turn_reward, raised


def finite_score(value, method: str) -> float:
    score = float(value)  # anything but a number fails here, as the environment's error
    if not math.isfinite(score):
        raise ValueError(f"{method} returned the score {score}; a score must be a finite number")
    return score
