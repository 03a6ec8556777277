"""OpenEnv environments (`openenv-core`) as environments: `--env openenv:my_env.py:MyEnv` (or `openenv:my_package.env:MyEnv`),
a class written on OpenEnv's `Environment`, made for each episode in the environment process (in-process); or `--env
openenv:http://127.0.0.1:8000`, a server that OpenEnv's `create_app` serves and that runs already, reached through
OpenEnv's own client (`GenericEnvClient`, a WebSocket session per episode).

Each becomes a step(text) environment (common/envs.py) alive for its episode: reset gets the row's columns (it takes
those its signature names; a row's `seed` seeds it) and its observation's text is added to the prompt's last user message;
each model turn fills the action's one text field; the observation that step returns is the environment's answer, its
`reward` that turn's reward (turn_reward), and its `done` ends the episode; the environment scores every episode (the sum
of its turns' rewards), so its rows need no reward function. An observation's text is its one string field, or, with
several or none, its fields as JSON (`done`, `reward` and `metadata` aside). A server that stops answering ends the
episodes using it with score 0 (common/tools.py's EnvironmentLost); the next episode connects again.
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
import typing

SCHEMA_SECONDS = 30.0  # how long the run waits for a server's action schema when it starts
NOT_FIELDS = ("done", "reward", "metadata")  # an observation's fields that are not its text


def openenv_env_class(target: str, flag: str):
    """The environment class of `--env openenv:target`: a server's URL, or the Environment class `module:ClassName`."""
    try:
        import openenv.core  # noqa: F401
    except ImportError:
        raise ValueError(f"{flag}: the openenv-core package is not installed; pip install openenv-core") from None
    if target.startswith(("http://", "https://")):
        url = target.rstrip("/")
        field = text_field(served_action_schema(url, flag), flag)
        return type("openenv", (OpenEnvSession,), {"url": url, "action_field": field})
    env_cls = environment_class(target, flag)
    action_cls = action_class(env_cls, flag)
    field = text_field(action_cls.model_json_schema(), flag)
    return type(env_cls.__name__, (OpenEnvInProcess,), {"env_cls": env_cls, "action_cls": action_cls, "action_field": field})


def environment_class(target: str, flag: str):
    """The class `ClassName` of `path/to/file.py:ClassName` or `module:ClassName`, an OpenEnv Environment."""
    from openenv.core import Environment

    from common.isolation import load_user_file

    where, _, name = target.rpartition(":")
    if not where or not name:
        raise ValueError(f"{flag}: write openenv:path/to/file.py:ClassName, openenv:module:ClassName or openenv:URL")
    try:
        module = load_user_file(where) if where.endswith(".py") and os.path.isfile(where) else importlib.import_module(where)
    except ImportError as error:
        raise ValueError(f"{flag}: {where} does not import ({error})") from None
    env_cls = getattr(module, name, None)
    if not (isinstance(env_cls, type) and issubclass(env_cls, Environment)):
        raise ValueError(f"{flag}: {where} defines no class '{name}' written on openenv.core's Environment")
    return env_cls


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


def served_action_schema(url: str, flag: str) -> dict:
    """The JSON schema of the action the server at `url` takes (its /schema, as OpenEnv's own CLI reads it), once its
    WebSocket sessions open through OpenEnv's client."""
    import requests
    from openenv.core import GenericEnvClient

    try:
        response = requests.get(f"{url}/schema", timeout=SCHEMA_SECONDS)
        response.raise_for_status()
        client = GenericEnvClient(base_url=url, connect_timeout_s=SCHEMA_SECONDS).sync()
        client.connect()
        client.close()
        return response.json()["action"]
    except Exception as error:
        raise ValueError(
            f"{flag}: no OpenEnv server answers at {url} ({type(error).__name__}: {error}); start it (its create_app, "
            "served by uvicorn) or check the address"
        ) from None


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
