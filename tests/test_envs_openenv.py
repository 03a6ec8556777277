"""OpenEnv environments as environments (common/envs_openenv.py): an environment written on the real openenv-core's
base classes, made in the environment process (in-process), and served by its own create_app on localhost (a server the
run starts for each episode, and one the test starts; a WebSocket session per episode through OpenEnv's client), played
in the live environment processes by test_tools.py's scripted engine; servers killed mid-play; what bad input says."""

import socket
import subprocess
import sys
import time

import pytest

from common import envs_openenv
from common.env_processes import EnvProcesses
from common.envs import episode_spec, load_env, load_environments
from common.isolation import REPORTED_FAILURES
from common.tools import render
from test_tools import batch_of, play, row

GAME = '''
import os
import sys

from openenv.core import Action, Environment, Observation, State, create_app


class GuessAction(Action):
    guess: str


class GuessObservation(Observation):
    hint: str
    guesses: int = 0


class GuessDigit(Environment[GuessAction, GuessObservation, State]):
    """Guess a digit: "higher" or "lower" after each wrong guess (-0.1), 1 for the right one; 5 guesses at most; the
    guess "crash" ends the process that serves it."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def reset(self, seed=None, episode_id=None, **kwargs):
        self.target, self.guesses = (seed or 0) % 10, 0
        return GuessObservation(hint="Guess a digit.")

    def step(self, action, timeout_s=None, **kwargs):
        if action.guess == "crash":
            os._exit(3)
        self.guesses += 1
        digits = [int(c) for c in action.guess if c.isdigit()]
        if digits and digits[-1] == self.target:
            return GuessObservation(hint="right", guesses=self.guesses, reward=1.0, done=True)
        hint = "higher" if digits and digits[-1] < self.target else "lower"
        return GuessObservation(hint=hint, guesses=self.guesses, reward=-0.1, done=self.guesses >= 5)

    @property
    def state(self):
        return State(step_count=self.guesses)


class TwoFields(Action):
    guess: str
    note: str


class NoText(Environment):
    def reset(self, seed=None, episode_id=None, **kwargs):
        return GuessObservation(hint="")

    def step(self, action: TwoFields, timeout_s=None, **kwargs):
        return GuessObservation(hint="")

    @property
    def state(self):
        return State()


app = create_app(GuessDigit, GuessAction, GuessObservation, max_concurrent_envs=8)

if __name__ == "__main__":
    import uvicorn

    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
'''


@pytest.fixture(scope="module")
def game_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("openenv") / "guess_digit.py"
    path.write_text(GAME)
    return str(path)


@pytest.fixture
def server(game_file):
    """The game served by create_app on a free port of localhost: its URL, while it runs."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    process = subprocess.Popen([sys.executable, game_file, str(port)], stderr=subprocess.DEVNULL)
    deadline = time.time() + 60
    while time.time() < deadline:  # until it listens
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            time.sleep(0.2)
    yield f"http://127.0.0.1:{port}"
    process.kill()
    process.wait()


def played(tokenizer, tmp_path, spec: str, rows: list[dict], script: dict):
    environments = load_environments(episode_spec(spec, None))
    batch = batch_of(tokenizer, tmp_path, rows, environments)
    env_calls = EnvProcesses(environments.spec, 2, timeout=60)
    try:
        return batch, play(tokenizer, batch, environments, script, env_calls, max_turns=5)
    finally:
        env_calls.close()


def check_the_game(tokenizer, episodes, script):
    assert episodes["ending"].tolist() == ["by_env", "by_env"]  # the game ended each: solved, and out of guesses
    assert episodes["turn_rewards"][0] == [-0.1, -0.1, 1.0] and episodes["episode_score"][0] == 0.0
    assert episodes["turn_rewards"][1] == [-0.1] * 5
    # token in, token out: the episode is the chat template's rendering of the game's conversation
    conversation = [{"role": "user", "content": "Play.Guess a digit."}]
    for turn, answer in zip(script["Play."], ["higher", "lower", None]):
        conversation.append({"role": "assistant", "content": turn})
        conversation += [{"role": "tool", "content": answer}] if answer else []
    length = int(episodes["attention_mask"][0].sum() - episodes["prompt_mask"][0].sum())
    ids = episodes["prompts"][0][episodes["prompt_mask"][0].bool()].tolist() + episodes["responses"][0][:length].tolist()
    assert tokenizer.decode(ids) == render(tokenizer, conversation, add_generation_prompt=False).removesuffix("\n")


SCRIPT = {"Play.": ["5", "9", "7"], "Again.": ["1", "2", "3", "4", "6"]}
ROWS = [row("Play.", seed=7), row("Again.", seed=7)]


def test_an_environment_class_in_process(tool_tokenizer, tmp_path, game_file):
    _, episodes = played(tool_tokenizer, tmp_path, f"openenv:{game_file}:GuessDigit", ROWS, SCRIPT)
    check_the_game(tool_tokenizer, episodes, SCRIPT)


def test_a_server_of_create_app_on_localhost(tool_tokenizer, tmp_path, server):
    environments = load_environments(episode_spec(f"openenv:{server}", None))
    assert environments.names == ["GuessDigit"] and environments.classes["GuessDigit"].action_field == "guess"
    _, episodes = played(tool_tokenizer, tmp_path, f"openenv:{server}", ROWS, SCRIPT)
    check_the_game(tool_tokenizer, episodes, SCRIPT)


def test_a_server_the_run_starts_for_each_episode(tool_tokenizer, tmp_path, game_file, capsys):
    REPORTED_FAILURES.clear()
    environments = load_environments(episode_spec(f"openenv:{game_file}:app", None))
    assert environments.names == ["GuessDigit"] and environments.classes["GuessDigit"].app[0] == "guess_digit:app"
    _, episodes = played(tool_tokenizer, tmp_path, f"openenv:{game_file}:app", ROWS, SCRIPT)
    check_the_game(tool_tokenizer, episodes, SCRIPT)
    # a server killed mid-play takes its episode alone: the others play on their own servers, and the next starts one
    script = {"Play.": ["5", "crash"], "Again.": ["1", "2", "3", "4", "6"], "Later.": ["7"]}
    rows = [row("Play.", seed=7), row("Again.", seed=7), row("Later.", seed=7)]
    _, episodes = played(tool_tokenizer, tmp_path, f"openenv:{game_file}:app", rows, script)
    assert episodes["ending"].tolist() == ["error", "by_env", "by_env"]
    assert episodes["turn_rewards"][1] == [-0.1] * 5 and episodes["turn_rewards"][2] == [1.0]
    assert episodes["episode_score"].tolist() == [0.0, 0.0, 0.0]
    assert "the environment failed (EnvironmentLost)" in capsys.readouterr().err


def test_a_server_killed_mid_play_ends_its_episodes(tool_tokenizer, tmp_path, server, capsys):
    REPORTED_FAILURES.clear()
    script = {"Play.": ["5", "crash", "7"], "Again.": ["1", "2", "3", "4", "6"]}
    _, episodes = played(tool_tokenizer, tmp_path, f"openenv:{server}", ROWS, script)
    # the crash ends its episode; the other ends too, at its next step or reset, whichever met the dead server
    assert episodes["ending"].tolist() == ["error", "error"] and episodes["episode_score"].tolist() == [0.0, 0.0]
    assert "the environment failed (EnvironmentLost)" in capsys.readouterr().err


def test_what_an_environment_that_cannot_be_reached_says(game_file, tmp_path, monkeypatch):
    broken_app = tmp_path / "broken_app.py"  # an app the run imports, and its server, importing it by name, cannot
    broken_app.write_text("from fastapi import FastAPI\n\napp = FastAPI()\nassert __name__ != 'broken_app'\n")
    with socket.socket() as probe:  # a port where nothing listens
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with pytest.raises(ValueError, match=rf"--env 'openenv:http://127.0.0.1:{port}': no OpenEnv server answers at"):
        load_env(f"openenv:http://127.0.0.1:{port}")
    with pytest.raises(ValueError, match=r"defines no 'Nope' \(an Environment class, or the app of its create_app\)"):
        load_env(f"openenv:{game_file}:Nope")
    with pytest.raises(ValueError, match="'GuessAction' is neither a class written on openenv.core's Environment nor an"):
        load_env(f"openenv:{game_file}:GuessAction")
    with pytest.raises(ValueError, match=r"the server of broken_app:app did not listen within 30 s \(exit 1\)"):
        load_env(f"openenv:{broken_app}:app")
    with pytest.raises(ValueError, match="the action TwoFields has the fields guess, note; the adapter fills one text"):
        load_env(f"openenv:{game_file}:NoText")
    monkeypatch.setitem(sys.modules, "openenv.core", None)
    with pytest.raises(ValueError, match="the openenv-core package is not installed; pip install openenv-core"):
        load_env(f"openenv:{game_file}:GuessDigit")
    assert envs_openenv.observation_text({"hint": "a", "guesses": 2}) == "a"
    assert envs_openenv.observation_text({"a": 1, "b": [2]}) == '{"a": 1, "b": [2]}'
