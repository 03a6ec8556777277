"""Gym-style text games as environments (common/envs_gym.py): a game registered with the real gymnasium, in its
five-tuple convention, and one of the real TextArena's single-player games, each played in the live environment
processes by test_tools.py's scripted engine; what bad input says."""

import pytest

from common import envs_gym
from common.env_processes import EnvProcesses
from common.envs import episode_spec, load_env, load_environments
from common.tools import render
from test_tools import batch_of, play, row

GAME = '''
import gymnasium
from gymnasium import spaces


class TextGuess(gymnasium.Env):
    """Guess a digit: "higher" or "lower" after each wrong guess (-0.1), 1 for the right one; 5 guesses at most."""

    observation_space = spaces.Text(64)
    action_space = spaces.Text(64)

    def reset(self, seed=None, options=None):
        super().reset(seed=seed)
        self.target, self.guesses = int(self.np_random.integers(10)) if seed is None else seed % 10, 0
        return "Guess a digit.", {}

    def step(self, action):
        self.guesses += 1
        digits = [int(c) for c in action if c.isdigit()]
        if digits and digits[-1] == self.target:
            return "right", 1.0, True, False, {}
        hint = "higher" if digits and digits[-1] < self.target else "lower"
        return hint, -0.1, False, self.guesses >= 5, {}


gymnasium.register("TextGuess-v0", entry_point=TextGuess)
'''


@pytest.fixture
def game_module(tmp_path, monkeypatch):
    """The module that registers TextGuess-v0, importable here and in the environment processes."""
    (tmp_path / "text_games.py").write_text(GAME)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    return "text_games"


def played(tokenizer, tmp_path, spec: str, rows: list[dict], script: dict, max_turns: int = 5):
    environments = load_environments(episode_spec(spec, None))
    batch = batch_of(tokenizer, tmp_path, rows, environments)
    env_calls = EnvProcesses(environments.spec, 1, timeout=30)
    try:
        return batch, play(tokenizer, batch, environments, script, env_calls, max_turns=max_turns)
    finally:
        env_calls.close()


def test_a_gymnasium_text_game_plays_its_five_tuple(tool_tokenizer, tmp_path, game_module):
    tokenizer = tool_tokenizer
    rows = [row("Play.", seed=7), row("Again.", seed=7)]
    script = {"Play.": ["5", "9", "7"], "Again.": ["1", "2", "3", "4", "6"]}
    batch, episodes = played(tokenizer, tmp_path, f"gym:{game_module}:TextGuess-v0", rows, script)
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


def test_a_textarena_game_for_one_player(tool_tokenizer, tmp_path):
    rows = [row("Play the game.", seed=3)]
    script = {"Play the game.": ["[10]", "[8]"]}  # seed 3's number is 8
    _, episodes = played(tool_tokenizer, tmp_path, "textarena:GuessTheNumber-v0", rows, script)
    assert episodes["ending"].tolist() == ["by_env"] and episodes["episode_score"].tolist() == [1.0]
    prompt = tool_tokenizer.decode(episodes["prompts"][0][episodes["prompt_mask"][0].bool()])
    assert "Play the game." in prompt and "Enter your guess." in prompt  # the game's first observation, in the prompt
    answer = tool_tokenizer.decode(episodes["responses"][0][~episodes["response_mask"][0].bool()])
    assert "[GAME] The target number is lower." in answer and "Enter your guess" not in answer  # only what is new


def test_a_games_rows_need_no_reward_function(tool_tokenizer, tmp_path):
    from common.args import RunArgs
    from common.scoring import Scorer

    environments = load_environments(episode_spec("textarena:GuessTheNumber-v0", None))
    batch = batch_of(tool_tokenizer, tmp_path, [row("Play.", data_source="no_rule_for_this")], environments)
    Scorer(RunArgs(), tool_tokenizer).check_prompts(batch, batch, environments)  # the game scores every episode
    with pytest.raises(ValueError, match="no built-in reward for data_source"):
        Scorer(RunArgs(), tool_tokenizer).check_prompts(batch, batch)


def test_what_a_game_that_cannot_be_played_says(monkeypatch):
    with pytest.raises(ValueError, match="--env 'gym:NoSuchGame-v0': gymnasium knows no game 'NoSuchGame-v0'"):
        load_env("gym:NoSuchGame-v0")
    with pytest.raises(ValueError, match="--env 'textarena:Nope-v0': TextArena has no game 'Nope-v0'"):
        load_env("textarena:Nope-v0")
    monkeypatch.setitem(envs_gym.PACKAGES, "gym", ("gymnasium_not_here", "gymnasium"))
    with pytest.raises(ValueError, match="the gymnasium package is not installed; pip install gymnasium"):
        load_env("gym:TextGuess-v0")
