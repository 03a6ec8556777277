"""OpenEnv environments (`openenv-core`) as environments, in three ways: `--env openenv:my_env.py:MyEnv` (or
`openenv:my_package.env:MyEnv`), a class written on OpenEnv's `Environment`, made for each episode in the environment
process (in-process); `--env openenv:my_env.server.app:app`, the app of its `create_app`, which the run serves with
uvicorn for each episode on a free port of localhost; `--env openenv:http://127.0.0.1:8000`, a server of it that runs
already. A server is reached through OpenEnv's own client (`GenericEnvClient`, a WebSocket session per episode).

Each becomes a step(text) environment (common/envs.py) alive for its episode: reset gets the row's columns (it takes
those its signature names; a row's `seed` seeds it) and its observation's text is added to the prompt's last user message;
each model turn fills the action's one text field; the observation that step returns is the environment's answer, its
`reward` that turn's reward (turn_reward), and its `done` ends the episode; the environment scores every episode (the sum
of its turns' rewards), so its rows need no reward function. An observation's text is its one string field, or, with
several or none, its fields as JSON (`done`, `reward` and `metadata` aside). A server that stops answering ends the
episodes using it with score 0 (common/tools.py's EnvironmentLost); the next episode connects again, or starts its own.
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
import socket
import subprocess
import sys
import time
import typing

SCHEMA_SECONDS = 30.0  # how long the run waits for a server to listen, and for its metadata and action schema
NOT_FIELDS = ("done", "reward", "metadata")  # an observation's fields that are not its text


def openenv_env_class(target: str, flag: str):
    """The environment class of `--env openenv:target`: a server's URL, an Environment class or an app of create_app."""
    try:
        import openenv.core  # noqa: F401
    except ImportError:
        raise ValueError(f"{flag}: the openenv-core package is not installed; pip install openenv-core") from None
    if target.startswith(("http://", "https://")):
        url = target.rstrip("/")
        name, field = served_environment(url, flag)
        return type(name, (OpenEnvSession,), {"url": url, "action_field": field})
    from fastapi import FastAPI
    from openenv.core import Environment

    where, name, named = named_object(target, flag)
    if isinstance(named, type) and issubclass(named, Environment):
        action_cls = action_class(named, flag)
        field = text_field(action_cls.model_json_schema(), flag)
        return type(named.__name__, (OpenEnvInProcess,), {"env_cls": named, "action_cls": action_cls, "action_field": field})
    if not isinstance(named, FastAPI):
        raise ValueError(f"{flag}: {where}'s '{name}' is neither a class written on openenv.core's Environment nor an app")
    app = uvicorn_app(where, name)
    try:
        server, url = start_server(app)
    except RuntimeError as error:
        raise ValueError(f"{flag}: {error}") from None
    try:
        env_name, field = served_environment(url, flag)
    finally:
        server.kill()
        server.wait()
    return type(env_name, (OpenEnvServedByRun,), {"app": app, "action_field": field})


def named_object(target: str, flag: str) -> tuple[str, str, object]:
    """Where `target` (`path/to/file.py:name` or `module:name`) points, the name, and what the module calls that name."""
    from common.isolation import load_user_file

    where, _, name = target.rpartition(":")
    if not where or not name:
        raise ValueError(f"{flag}: write openenv:path/to/file.py:NAME, openenv:module:NAME or openenv:URL")
    try:
        module = load_user_file(where) if where.endswith(".py") and os.path.isfile(where) else importlib.import_module(where)
    except ImportError as error:
        raise ValueError(f"{flag}: {where} does not import ({error})") from None
    if not hasattr(module, name):
        raise ValueError(f"{flag}: {where} defines no '{name}' (an Environment class, or the app of its create_app)")
    return where, name, getattr(module, name)


def action_class(env_cls, flag: str):
    """The Action class `env_cls` takes: its step's annotation, else its Environment[Action, ...] base's argument."""
    from openenv.core import Action

    hinted = typing.get_type_hints(env_cls.step).get("action")
    candidates = [hinted] + [arg for base in getattr(env_cls, "__orig_bases__", ()) for arg in typing.get_args(base)]
    for candidate in candidates:
        if isinstance(candidate, type) and issubclass(candidate, Action):
            return candidate
    raise ValueError(
        f"{flag}: {env_cls.__name__} names no Action class: annotate step(self, action: MyAction) or derive it from "
        "Environment[MyAction, MyObservation, State]"
    )


def served_environment(url: str, flag: str) -> tuple[str, str]:
    """The name of the environment the server at `url` serves and its action's text field (its /metadata and /schema,
    as OpenEnv's own CLI reads them), once a WebSocket session opens through OpenEnv's client."""
    import requests
    from openenv.core import GenericEnvClient

    try:
        answers = [requests.get(f"{url}/{what}", timeout=SCHEMA_SECONDS) for what in ("metadata", "schema")]
        for answer in answers:
            answer.raise_for_status()
        client = GenericEnvClient(base_url=url, connect_timeout_s=SCHEMA_SECONDS).sync()
        client.connect()
        client.close()
    except Exception as error:
        raise ValueError(
            f"{flag}: no OpenEnv server answers at {url} ({type(error).__name__}: {error}); start it (its create_app, "
            "served by uvicorn) or check the address"
        ) from None
    return answers[0].json()["name"], text_field(answers[1].json()["action"], flag)


def uvicorn_app(where: str, name: str) -> tuple[str, str | None]:
    """What uvicorn imports to serve the app `name` of `where` (a module, or a file): its import string, its folder."""
    if where.endswith(".py") and os.path.isfile(where):
        return f"{os.path.basename(where).removesuffix('.py')}:{name}", os.path.dirname(os.path.abspath(where))
    return f"{where}:{name}", None


def start_server(app: tuple[str, str | None]) -> tuple[subprocess.Popen, str]:
    """A server of `app` (uvicorn_app's) on a free port of localhost, once it listens, and its URL; its log's warnings
    reach this process's standard error (the real one, where a test captures sys.stderr)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    import_string, folder = app
    command = [sys.executable, "-m", "uvicorn", import_string, "--host", "127.0.0.1", "--port", str(port)]
    command += ["--log-level", "warning"] + (["--app-dir", folder] if folder else [])
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=sys.__stderr__)
    deadline = time.monotonic() + SCHEMA_SECONDS
    while server.poll() is None and time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return server, f"http://127.0.0.1:{port}"
        except OSError:
            time.sleep(0.1)
    server.kill()
    raise RuntimeError(f"the server of {import_string} did not listen within {SCHEMA_SECONDS:.0f} s (exit {server.wait()})")


def text_field(action_schema: dict, flag: str) -> str:
    """The action's one text field, which a model turn fills: its only string field, and no other field required."""
    properties = {name: spec for name, spec in action_schema.get("properties", {}).items() if name != "metadata"}
    texts = [name for name, spec in properties.items() if spec.get("type") == "string"]
    others = [name for name in action_schema.get("required", []) if name not in texts]
    if len(texts) != 1 or others:
        raise ValueError(
            f"{flag}: the action {action_schema.get('title', '')} has the fields {', '.join(properties) or 'none'}; "
            "the adapter fills one text field (a str field, no other field required)"
        )
    return texts[0]


def observation_text(fields: dict) -> str:
    """An observation's text: its one string field, or its fields as JSON (NOT_FIELDS aside)."""
    fields = {name: value for name, value in fields.items() if name not in NOT_FIELDS}
    texts = [value for value in fields.values() if isinstance(value, str)]
    return texts[0] if len(texts) == 1 else json.dumps(fields, default=str)


class OpenEnvEpisode:
    """What both ways of reaching an OpenEnv environment share: the turn's reward, the episode's end and score."""

    action_field = ""

    def reset(self, **row) -> str:
        fields, _, _ = self.started(row)
        self.reward = None
        return observation_text(fields)

    def step(self, text: str) -> str | float:
        fields, reward, done = self.stepped({self.action_field: text})
        self.reward = None if reward is None else float(reward)
        return 0.0 if done else observation_text(fields)  # at its end, the score is its turns' rewards

    def turn_reward(self) -> float | None:
        return self.reward

    def get_reward(self) -> float:
        return 0.0  # the environment's rewards are its turns'


class OpenEnvInProcess(OpenEnvEpisode):
    """An instance of the Environment class, made for the episode in this process."""

    env_cls = action_cls = None

    def started(self, row: dict) -> tuple[dict, float | None, bool]:
        self.env = self.env_cls()
        parameters = inspect.signature(self.env.reset).parameters  # the columns it takes, as its server passes them
        takes_all = any(parameter.kind is parameter.VAR_KEYWORD for parameter in parameters.values())
        return self.split(self.env.reset(**{name: value for name, value in row.items() if takes_all or name in parameters}))

    def stepped(self, action: dict) -> tuple[dict, float | None, bool]:
        return self.split(self.env.step(self.action_cls(**action)))

    @staticmethod
    def split(observation) -> tuple[dict, float | None, bool]:
        """An Observation as its server would send it: its fields, its reward, its done."""
        from openenv.core.env_server.serialization import serialize_observation

        sent = serialize_observation(observation)
        return sent["observation"], sent["reward"], sent["done"]

    def close(self) -> None:
        if getattr(self, "env", None) is not None:
            self.env.close()


class OpenEnvSession(OpenEnvEpisode):
    """A session of the server at `url`, through OpenEnv's client, open from the episode's reset to its close."""

    url = ""

    def started(self, row: dict) -> tuple[dict, float | None, bool]:
        from openenv.core import GenericEnvClient

        self.client = GenericEnvClient(base_url=self.url).sync()
        return self.reached(lambda: self.client.reset(**json.loads(json.dumps(row, default=str))))

    def stepped(self, action: dict) -> tuple[dict, float | None, bool]:
        return self.reached(lambda: self.client.step(action))

    def reached(self, call) -> tuple[dict, float | None, bool]:
        """What `call` of the client returned, as fields, reward and done; a connection that broke ends the episode."""
        from websockets.exceptions import WebSocketException

        from common.tools import EnvironmentLost

        try:
            result = call()
        except (ConnectionError, OSError, WebSocketException) as error:
            raise EnvironmentLost(f"the OpenEnv server at {self.url} is gone: {type(error).__name__}: {error}") from error
        return result.observation, result.reward, result.done

    def close(self) -> None:
        if getattr(self, "client", None) is not None:
            self.client.close()


class OpenEnvServedByRun(OpenEnvSession):
    """A server of the app, started for the episode (as create_app's default of one session serves) and stopped with it:
    a server that dies takes its episode alone, and the next episode starts its own."""

    app: tuple[str, str | None] = ("", None)

    def started(self, row: dict) -> tuple[dict, float | None, bool]:
        self.server, self.url = start_server(self.app)
        return super().started(row)

    def close(self) -> None:
        try:
            super().close()
        finally:
            if getattr(self, "server", None) is not None:
                self.server.kill()
                self.server.wait()
