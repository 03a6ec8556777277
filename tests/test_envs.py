"""Multi-turn episodes with an environment: real policy workers (hf engine), real environment processes.

The vllm engine's episodes are tested in test_vllm.py, on its shared engine.
"""

import shutil
import sys

import pytest
import torch
from ray import cloudpickle

from common.data import collate
from common.dataproto import DataProto
from common.env_processes import EnvProcesses, EnvsInProcess
from common.envs import Calculator, Environments, episode_spec, load_env
from common.episode_play import AnswerFraming
from common.episodes import episode_metrics
from common.isolation import REPORTED_FAILURES
from common.rollout import stop_end
from common.worker_group import WorkerGroup
from helpers import LOG_PROB_INPUTS, PolicyProbe, play, turns_of

cloudpickle.register_pickle_by_value(sys.modules[__name__])

ENVS = '''
import glob
import os
import time
import uuid


class Chatty:
    """Answers every turn, so that episodes end by the turn or token limit; fails for some rows."""

    stop_strings = ["1"]

    def reset(self, data_source, ground_truth, extra_info):
        self.a, self.turns = extra_info["a"], 0

    def step(self, text):
        self.turns += 1
        if self.a == 2:
            raise ValueError("a tool that breaks")
        if self.a == 4:
            time.sleep(600)
        return f"ok{self.turns};"


class Sleepy:
    """Answers every turn and rewards each: 0.5 the first, 1.0 the second, ... For a = 4 the first answer waits until
    the four episodes of the other rows have ended (each leaves a file beside this one as its get_reward is called, at
    its end), for at most 20 s: only episodes that never wait for each other end before it."""

    stop_strings = ["1"]

    def reset(self, data_source, ground_truth, extra_info):
        self.a, self.turns = extra_info["a"], 0

    def step(self, text):
        self.turns += 1
        deadline = time.time() + 20
        while self.a == 4 and self.turns == 1 and len(glob.glob(f"{os.path.dirname(__file__)}/ended_*")) < 4:
            if time.time() > deadline:
                break
            time.sleep(0.05)
        return f"ok{self.turns};"

    def turn_reward(self):
        return 0.5 * self.turns

    def get_reward(self):
        if self.a != 4:
            open(f"{os.path.dirname(__file__)}/ended_{uuid.uuid4().hex}", "w").close()
        return 0.0


class Judge:
    """Ends each episode after its first turn with its own score: the length of that turn."""

    def step(self, text):
        return len(text)


class Empty:
    """Neither step(text) nor tools."""
'''


@pytest.fixture(scope="module")
def policy(cpu_pool, tiny_model):
    group = WorkerGroup(PolicyProbe, cpu_pool, "env_policy", model_path=tiny_model, micro_batch_size=4)
    yield group
    group.shutdown()


@pytest.fixture(scope="module")
def env_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("envs") / "envs.py"
    path.write_text(ENVS)
    return str(path)


@pytest.fixture(scope="module")
def eos(tokenizer):
    return [tokenizer.eos_token_id]


def turn_by_turn_log_probs(policy, batch, tokenizer) -> list[torch.Tensor]:
    """Each model turn scored alone, after the conversation before it: the log-probs of its tokens."""
    contexts, turns = [], []
    for prompt, mask, responses, own in zip(
        batch["prompts"], batch["prompt_mask"], batch["responses"], batch["response_mask"]
    ):
        for start, end in turns_of(own):
            contexts.append(prompt[mask.bool()].tolist() + responses[:start].tolist())
            turns.append(responses[start:end].tolist())
    left = collate(DataProto.from_dict(non_tensors={"prompt_ids": contexts}), tokenizer.pad_token_id)
    width = max(map(len, turns))
    responses = torch.tensor([t + [tokenizer.pad_token_id] * (width - len(t)) for t in turns])
    turn_mask = torch.tensor([[1] * len(t) + [0] * (width - len(t)) for t in turns])
    attention_mask = torch.cat([left["prompt_mask"], turn_mask], -1)
    scored = DataProto.from_dict(
        {
            "input_ids": torch.cat([left["prompts"], responses], -1),
            "attention_mask": attention_mask,
            "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0),
            "responses": responses,
        }
    )
    log_probs = policy.scatter("compute_log_prob", scored)["old_log_probs"]
    return [row[: len(t)] for row, t in zip(log_probs, turns)]


def test_the_models_tokens_score_alike_in_one_pass_and_turn_by_turn(policy, prompts, tokenizer, eos, env_file):
    env_calls = EnvProcesses(episode_spec(f"{env_file}:Chatty", None), 2, timeout=30)
    try:
        batch = play(policy, prompts[[1, 2, 3]], env_calls, load_env(f"{env_file}:Chatty"), tokenizer, eos)
    finally:
        env_calls.close()
    own, real = batch["response_mask"].bool(), batch["attention_mask"][:, -12:].bool()
    assert (own <= real).all() and (real.sum(-1) <= 12).all()
    assert 0 < own.sum() < real.sum(), "some tokens are the environment's"
    batch |= policy.scatter("compute_log_prob", batch.select(*LOG_PROB_INPUTS))
    one_pass = [row[mask] for row, mask in zip(batch["old_log_probs"], own)]
    by_turn = iter(turn_by_turn_log_probs(policy, batch, tokenizer))
    for row, mask in zip(one_pass, own):
        turns = [next(by_turn) for _ in turns_of(mask)]
        torch.testing.assert_close(row, torch.cat(turns), atol=1e-5, rtol=0)
    # the engine's log-probs of its own samples are the trainer's, on the model's tokens and nowhere else
    assert (batch["old_log_probs"] - batch["rollout_log_probs"])[own].abs().max() < 1e-4
    assert batch["rollout_log_probs"][~own].abs().sum() == 0
    # each turn computed only what followed its episode's kept keys and values: the answer and the last token sampled
    assert sum(batch["computed_again"]) == 0 and sum(batch["turns"]) > len(batch)
    for i in range(len(batch)):
        text = tokenizer.decode(batch["responses"][i][real[i]])
        spans = turns_of(batch["response_mask"][i])
        assert batch["turns"][i] == len(spans) <= 3
        answers = [tokenizer.decode(batch["responses"][i][end:start]) for (_, end), (start, _) in zip(spans, spans[1:])]
        assert answers == [f"ok{turn};" for turn in range(1, len(spans))], text  # each answer whole, in its place
        for start, end in spans[:-1]:  # a turn the environment answered ended at EOS or the stop string
            ended = batch["responses"][i][end - 1].item() in eos or "1" in tokenizer.decode(batch["responses"][i][start:end])
            assert ended, text
        assert batch["ending"][i] in ("max_turns", "token_limit")
        assert batch["final_turn"][i] == tokenizer.decode(batch["responses"][i][slice(*spans[-1])], skip_special_tokens=True)


def test_the_token_limit_and_the_turn_limit_end_episodes(policy, prompts, tokenizer, eos, env_file):
    env_calls = EnvsInProcess(Environments.of(load_env(f"{env_file}:Chatty")), timeout=30)
    short = play(policy, prompts[[1, 3]], env_calls, load_env(f"{env_file}:Chatty"), tokenizer, eos, 5, 5, n=8)
    assert (short["attention_mask"][:, -5:].sum(-1) <= 5).all()
    assert set(short["ending"]) == {"token_limit"}
    one = play(policy, prompts[[1, 3]], env_calls, load_env(f"{env_file}:Chatty"), tokenizer, eos, 1, 12)
    assert set(one["ending"]) <= {"max_turns", "token_limit"} and set(one["turns"]) == {1}
    assert torch.equal(one["response_mask"], one["attention_mask"][:, -12:].float()), "one turn: no environment tokens"


def test_a_tool_that_raises_or_hangs_ends_its_episode_alone(policy, prompts, tokenizer, eos, env_file, capsys):
    rows = [i for i, extra in enumerate(prompts["extra_info"]) if extra["a"] not in (2, 4)][:2]
    broken = [i for i, extra in enumerate(prompts["extra_info"]) if extra["a"] in (2, 4)]
    assert len(broken) == 2, "the demo's first prompts hold a = 2 and a = 4"
    REPORTED_FAILURES.clear()  # what earlier tests in this process printed
    # the hung calls' processes are replaced after the timeout and the grace, once every other episode has ended
    env_calls = EnvProcesses(episode_spec(f"{env_file}:Chatty", None), 3, timeout=10)
    try:
        batch = play(policy, prompts[rows + broken], env_calls, load_env(f"{env_file}:Chatty"), tokenizer, eos, n=2)
    finally:
        env_calls.close()
    hung = [s for s, ending in zip(batch["episode_seconds"], batch["ending"]) if ending == "timeout"]
    finished = [s for s, ending in zip(batch["episode_seconds"], batch["ending"]) if ending in ("max_turns", "token_limit")]
    assert min(hung) >= 10 and max(finished) < min(hung), "the others played all their turns while the hung call waited"
    for ending, extra, score in zip(batch["ending"], batch["extra_info"], batch["episode_score"]):
        expected = {2: "error", 4: "timeout"}.get(extra["a"])
        if expected:
            assert (ending, score) == (expected, 0.0)
        else:
            assert ending in ("max_turns", "token_limit") and score is None
    assert capsys.readouterr().err.count("the environment failed (ValueError)") == 1


def test_a_slow_environment_delays_its_own_episode_alone_and_turns_are_rewarded(policy, prompts, tokenizer, eos, env_file):
    rows = [i for i, extra in enumerate(prompts["extra_info"]) if extra["a"] != 4][:2]
    slow = [i for i, extra in enumerate(prompts["extra_info"]) if extra["a"] == 4]
    # one process: each episode's calls on a thread of its own, so the slow ones hold no other
    env_calls = EnvProcesses(episode_spec(f"{env_file}:Sleepy", None), 1, timeout=30)
    try:
        batch = play(policy, prompts[slow + rows], env_calls, load_env(f"{env_file}:Sleepy"), tokenizer, eos, n=2)
    finally:
        env_calls.close()
    seconds = batch["episode_seconds"]
    assert min(seconds[:2]) > max(seconds[2:]), "the slow episodes end last"
    assert set(batch["ending"]) <= {"max_turns", "token_limit"}
    for i in range(len(batch)):  # each turn the environment answered has its reward on the turn's last token
        ends = [end - 1 for _, end in turns_of(batch["response_mask"][i])]
        expected = [0.5 * turn for turn in range(1, len(batch["turn_rewards"][i]) + 1)]
        assert batch["turn_rewards"][i] == expected and len(expected) in (len(ends), len(ends) - 1)
        placed = torch.zeros(12)
        placed[ends[: len(expected)]] = torch.tensor(expected)
        assert torch.equal(batch["turn_reward_tokens"][i], placed)
    assert episode_metrics(batch, "env/")["env/turn_reward_1"] == 0.5


def test_an_environments_score_ends_the_episode(policy, prompts, tokenizer, eos, env_file):
    env_calls = EnvsInProcess(Environments.of(load_env(f"{env_file}:Judge")))
    batch = play(policy, prompts[[0, 1]], env_calls, load_env(f"{env_file}:Judge"), tokenizer, eos)
    assert set(batch["ending"]) == {"by_env"} and set(batch["turns"]) == {1}
    assert batch["episode_score"].tolist() == [float(len(text)) for text in batch["final_turn"]]


def test_the_calculator():
    calculator = Calculator()
    assert calculator.step("[37*48]") == "1776;"
    assert calculator.step("[37*]") == "error;"
    assert calculator.step("[9**9**9]") == "error;"
    assert calculator.step("[__import__('os')]") == "error;"
    assert calculator.step("1776") is None


def test_bad_env_specs(env_file):
    for spec, message in [
        ("nowhere.py:Env", "no file"),
        (f"{env_file}:Missing", "defines no class"),
        (f"{env_file}:Empty", "neither a step"),
        ("calculatr", "name a built-in"),
    ]:
        with pytest.raises(ValueError, match=message):
            load_env(spec)


def test_a_stop_string_ends_the_turn_at_the_token_that_completes_it(tokenizer):
    tokens = tokenizer("12</c>34")["input_ids"]
    assert stop_end(tokens, ["</c>"], tokenizer) == 6
    assert stop_end(tokens, ["3"], tokenizer) == 7
    assert stop_end(tokens, ["x"], tokenizer) is None and stop_end(tokens, [], tokenizer) is None


@pytest.fixture(scope="module")
def chat_tokenizer(tiny_model, tmp_path_factory):
    """The tiny tokenizer with ChatML's markers, and its template with "#" for newlines (the tiny tokenizer has none)."""
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("chat_tokenizer")
    shutil.copytree(tiny_model, folder, dirs_exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.eos_token = "<|im_end|>"
    tokenizer.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m.role }}#{{ m.content }}<|im_end|>#{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant#{% endif %}"
    )
    return tokenizer


@pytest.mark.parametrize("first_turn_ends_with_eos", [True, False])
def test_answers_are_framed_as_the_chat_template_renders_the_conversation(chat_tokenizer, first_turn_ends_with_eos):
    tokenizer, frame = chat_tokenizer, AnswerFraming(chat_tokenizer)
    user = [{"role": "user", "content": "3*4="}]
    ids = tokenizer.apply_chat_template(user, add_generation_prompt=True, tokenize=True, return_dict=False)
    first = tokenizer("[3*4]", add_special_tokens=False)["input_ids"]  # as the model wrote it, ended by "]"
    if first_turn_ends_with_eos:
        first += [tokenizer.eos_token_id]
    ids = list(ids) + first + frame("12", ended_with_eos=first_turn_ends_with_eos)
    ids += tokenizer("12", add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    conversation = user + [
        {"role": "assistant", "content": "[3*4]"},
        {"role": "tool", "content": "12"},
        {"role": "assistant", "content": "12"},
    ]
    rendered = tokenizer.apply_chat_template(conversation, tokenize=False)
    assert tokenizer.decode(ids) == rendered.removesuffix("#")
