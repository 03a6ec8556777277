"""verifiers environments as environments (common/envs_verifiers.py): a MultiTurnEnv and a StatefulToolEnv written in the
test on the real verifiers (0.1.14: CI runs this file in a virtual environment of its own, .ci/run), each module's
load_environment() loaded in the live environment processes and played by test_tools.py's scripted engine, its rubric
scoring each episode by its weights; what bad input says (this part runs without verifiers too)."""

import sys

import pytest

from common.env_processes import EnvProcesses
from common.envs import episode_spec, load_env, load_environments
from common.tools import render
from test_tools import batch_of, call, play, row

try:
    import verifiers
except ImportError:
    verifiers = None
# verifiers' own version pins (mcp 2.0, openai 2) leave it out of the test extra: CI runs this file in its venv (.ci/run)
needs_verifiers = pytest.mark.skipif(not hasattr(verifiers, "MultiTurnEnv"), reason="verifiers 0.1.14 is not installed")

GUESS = '''
import verifiers as vf
from datasets import Dataset
from verifiers.types import UserMessage


class Guess(vf.MultiTurnEnv):
    """Guess a digit: "higher" or "lower" after each wrong guess; "right" is the environment's last word."""

    async def env_response(self, messages, state, **kwargs):
        guess = messages[-1].content.strip()
        if guess == state["answer"]:
            state["final_env_response"] = [UserMessage(content="right")]
            return state["final_env_response"]
        return [UserMessage(content="higher" if guess < state["answer"] else "lower")]


def found(completion, answer) -> float:
    return float(any(m.role == "assistant" and m.content.strip() == answer for m in completion))


def few_turns(state) -> float:
    return 1.0 / len(state["trajectory"])


def load_environment():
    dataset = Dataset.from_list([{"question": "Play.", "answer": "7"}])  # a verifiers environment's own rows: not read here
    return Guess(dataset=dataset, rubric=vf.Rubric(funcs=[found, few_turns], weights=[1.0, 0.5]), max_turns=4)
'''

COUNTER = '''
import verifiers as vf
from datasets import Dataset


def add(n: int, totals: dict) -> int:
    """Add to the episode's running total.

    Args:
        n: What to add.
        totals: The episode's totals (from its state).
    """
    totals["sum"] = totals.get("sum", 0) + n
    return totals["sum"]


class Counter(vf.StatefulToolEnv):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.add_tool(add, args_to_skip=["totals"])

    async def setup_state(self, state):
        state["totals"] = {}

    def update_tool_args(self, tool_name, tool_args, messages, state, **kwargs):
        return {**tool_args, "totals": state["totals"]}


def answered_the_sum(completion, state) -> float:
    return float(completion[-1].content.strip() == str(state["totals"].get("sum")))


def load_environment():
    dataset = Dataset.from_list([{"question": "first?", "answer": "5"}])
    return Counter(dataset=dataset, rubric=vf.Rubric(funcs=[answered_the_sum], weights=[2.0]))
'''


@pytest.fixture
def env_files(tmp_path):
    (tmp_path / "guess_env.py").write_text(GUESS)
    (tmp_path / "counter_env.py").write_text(COUNTER)
    (tmp_path / "no_loader.py").write_text("x = 1\n")
    return tmp_path


def played(tokenizer, tmp_path, spec: str, rows: list[dict], script: dict):
    environments = load_environments(episode_spec(spec, None))
    batch = batch_of(tokenizer, tmp_path, rows, environments)
    env_calls = EnvProcesses(environments.spec, 2, timeout=60)
    try:
        return environments, batch | play(tokenizer, batch, environments, script, env_calls, max_turns=5)
    finally:
        env_calls.close()


@needs_verifiers
def test_a_multi_turn_env_answers_with_env_response(tool_tokenizer, tmp_path, env_files):
    tokenizer = tool_tokenizer
    script = {"Play.": ["5", "9", "7"], "Again.": ["1", "2", "3", "4", "5"]}
    rows = [row("Play.", truth="7"), row("Again.", truth="7")]
    environments, episodes = played(tokenizer, tmp_path, f"verifiers:{env_files}/guess_env.py", rows, script)
    assert environments.names == ["guess_env"]
    # the first found it in 3 turns: 1 + 0.5/3; the second hit the environment's max_turns (4) without: 0.5/4
    assert episodes["ending"].tolist() == ["by_env", "by_env"]
    assert episodes["episode_score"].tolist() == pytest.approx([1 + 0.5 / 3, 0.5 / 4])
    conversation = [{"role": "user", "content": "Play."}]
    for turn, answer in zip(script["Play."], ["higher", "lower", None]):
        conversation.append({"role": "assistant", "content": turn})
        conversation += [{"role": "tool", "content": answer}] if answer else []
    length = int(episodes["attention_mask"][0].sum() - episodes["prompt_mask"][0].sum())
    ids = episodes["prompts"][0][episodes["prompt_mask"][0].bool()].tolist() + episodes["responses"][0][:length].tolist()
    assert tokenizer.decode(ids) == render(tokenizer, conversation, add_generation_prompt=False).removesuffix("\n")


@needs_verifiers
def test_a_stateful_tool_env_offers_its_tools(tool_tokenizer, tmp_path, env_files):
    tokenizer = tool_tokenizer
    script = {"first?": [call("add", n=2), call("add", n=3), "5"], "second?": [call("add", n=10), "11"]}
    rows = [row("first?"), row("second?")]
    environments, episodes = played(tokenizer, tmp_path, f"verifiers:{env_files}/counter_env.py", rows, script)
    schemas = environments.schemas("counter_env")
    assert list(schemas) == ["add"] and list(schemas["add"]["function"]["parameters"]["properties"]) == ["n"]
    assert episodes["ending"].tolist() == ["answered", "answered"] and episodes["tool_errors"].tolist() == [0, 0]
    assert episodes["episode_score"].tolist() == [2.0, 0.0]  # the rubric read each final answer, by its weight 2
    tool_call = lambda n: {"type": "function", "function": {"name": "add", "arguments": {"n": n}}}  # noqa: E731
    conversation = [{"role": "user", "content": "first?"}]
    for n, total in ((2, "2"), (3, "5")):  # each episode's own state: its total starts at 0
        conversation += [{"role": "assistant", "content": "", "tool_calls": [tool_call(n)]}]
        conversation += [{"role": "tool", "name": "add", "content": total}]
    conversation += [{"role": "assistant", "content": "5"}]
    length = int(episodes["attention_mask"][0].sum() - episodes["prompt_mask"][0].sum())
    ids = episodes["prompts"][0][episodes["prompt_mask"][0].bool()].tolist() + episodes["responses"][0][:length].tolist()
    expected = render(tokenizer, conversation, list(schemas.values()), add_generation_prompt=False)
    assert tokenizer.decode(ids) == expected.removesuffix("\n")


@needs_verifiers
def test_what_a_module_without_load_environment_says(env_files):
    with pytest.raises(ValueError, match=rf"--env 'verifiers:{env_files}/no_loader.py': .* has no load_environment\(\)"):
        load_env(f"verifiers:{env_files}/no_loader.py")


def test_what_a_run_without_verifiers_says(env_files, monkeypatch):
    monkeypatch.setitem(sys.modules, "verifiers", None)
    with pytest.raises(ValueError, match=r"verifiers with its MultiTurnEnv API is not installed; pip install 'verifiers=="):
        load_env(f"verifiers:{env_files}/guess_env.py")
