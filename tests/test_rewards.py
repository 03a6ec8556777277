import numpy as np
import psutil
import pytest
import torch

from common.dataproto import DataProto
from common.isolation import REPORTED_FAILURES, CallProcesses, InProcessCalls, UserCodeError
from common.rewards import (
    REWARD_CALLS,
    RewardError,
    check_data_sources,
    default_reward,
    extra_means,
    gsm8k_lenient,
    gsm8k_reward,
    load_reward_fn,
    reward_weights,
    score_texts,
    score_value,
)
from helpers import score


# (response, ground truth, verl's score, the lenient score): verl's gsm8k.py (strict) gave the third column
@pytest.mark.parametrize(
    "response, truth, verl, lenient",
    [
        ("so the answer is #### 72", "72", 1.0, 1.0),
        ("####72", "72", 0.0, 1.0),
        ("#### 72.0", "72", 0.0, 1.0),
        ("#### 72.", "72", 0.0, 1.0),
        ("#### $18", "18", 0.0, 1.0),
        ("#### 1,234", "1234", 1.0, 1.0),
        ("#### 5 then later #### 6", "6", 1.0, 1.0),
        ("#### 5 then later #### 6", "5", 0.0, 0.0),
        ("#### 7" + "x" * 400, "7", 0.0, 1.0),  # verl reads the last 300 characters only
        ("the answer is 72", "72", 0.0, 0.0),
        ("#### 71", "72", 0.0, 0.0),
    ],
)
def test_gsm8k_scores_as_verl_and_leniently_by_name(response, truth, verl, lenient):
    assert gsm8k_reward(response, truth) == verl == default_reward("openai/gsm8k", response, truth, {})
    assert gsm8k_lenient("openai/gsm8k", response, truth, {}) == lenient


def test_verls_math_data_sources_have_their_built_in_rewards():
    for source in ("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500"):
        assert default_reward(source, "so \\boxed{\\frac{1}{2}}", "0.5", {}) == 1.0
        assert default_reward(source, "so \\boxed{3}", "\\frac{1}{2}", {}) == 0.0
    for source in ("math_dapo", "aime2024", "aime_2025"):  # verl's math_dapo.py scores these 1 or -1
        assert default_reward(source, "work...\nAnswer: $\\frac{1}{2}$", "\\frac{1}{2}", {}) == {"score": 1.0, "acc": 1.0}
        assert default_reward(source, "Answer: 3", "4", {}) == {"score": -1.0, "acc": 0.0}
        assert default_reward(source, "no final answer line", "4", {})["score"] == -1.0
    check_data_sources(DataProto.from_dict(non_tensors={"data_source": ["aime24", "lighteval/MATH"]}), default_reward)


def test_trl_reward_functions_weighted_with_none_for_no_score(tmp_path):
    """TRL's signature: lists of one sample, the row's columns as keyword arguments, None for no score; several functions
    summed by their weights, None left out, each logged under its name."""
    (tmp_path / "trl_rewards.py").write_text(
        "def text(completion):  # TRL's completion: a string, or the assistant's message after a list of messages\n"
        "    return completion if isinstance(completion, str) else completion[0]['content']\n"
        "def correct(completions, answer, **kwargs):\n"
        "    return [1.0 if text(c) == a else 0.0 for c, a in zip(completions, answer)]\n"
        "def short(completions, prompts, level, **kwargs):\n"
        "    assert isinstance(completions[0], str) == isinstance(prompts[0], str)\n"
        "    return [None if lv is None else -len(text(c)) for c, lv in zip(completions, level)]\n"
    )
    spec = f"{tmp_path}/trl_rewards.py:correct,{tmp_path}/trl_rewards.py:short"
    messages = [{"role": "user", "content": "2+2="}]
    batch = DataProto.from_dict(
        non_tensors={
            "data_source": ["custom"] * 3,
            "ground_truth": [""] * 3,
            "extra_info": [{}] * 3,
            "prompt": ["1+2=", messages, messages],
            "columns": [{"answer": "3", "level": 1}, {"answer": "4", "level": None}, {"answer": "5", "level": None}],
        }
    )
    weights = reward_weights(spec, "1.0,0.5")
    for calls in InProcessCalls(load_reward_fn(spec), spec, REWARD_CALLS), CallProcesses(spec, 2, REWARD_CALLS):
        scores, metrics, extras = score_texts(["3", "4", "44"], batch, calls, weights=weights)
        calls.close()
        assert scores == [1.0 - 0.5, 1.0, 0.0] and metrics["reward/errors"] == 0
        assert extras == [{"correct": 1.0, "short": -1.0}, {"correct": 1.0}, {"correct": 0.0}]
        assert extra_means(extras, "reward/") == {"reward/correct": 2 / 3, "reward/short": -1.0}
    only_short = f"{tmp_path}/trl_rewards.py:short"
    calls = InProcessCalls(load_reward_fn(only_short), only_short, REWARD_CALLS)
    scores, metrics, _ = score_texts(["3", "4"], batch[[0, 1]], calls)
    assert scores == [-1.0, 0.0] and metrics["reward/unscored"] == 1  # no function scored the second: 0, counted
    with pytest.raises(ValueError, match="gives 1 weights for the 2 functions of --reward-fn"):
        reward_weights(spec, "1.0")
    with pytest.raises(ValueError, match="pass --reward-fn too"):
        reward_weights(None, "1.0")


def batch_of(tokenizer, texts, truths, source="addition"):
    responses = torch.tensor([tokenizer(t)["input_ids"] + [tokenizer.pad_token_id] * (4 - len(t)) for t in texts])
    return DataProto.from_dict(
        {"responses": responses},
        {"data_source": [source] * len(texts), "ground_truth": truths, "extra_info": [{}] * len(texts)},
    )


def test_score_builtin(tokenizer):
    batch = batch_of(tokenizer, ["3", "12", "4"], ["3", "12", "5"])
    for scorer in InProcessCalls(default_reward, None, REWARD_CALLS), CallProcesses(None, 2, REWARD_CALLS):
        scores, metrics, _ = score(batch, tokenizer, scorer)
        scorer.close()
        assert scores.tolist() == [1.0, 1.0, 0.0]
        assert metrics["reward/errors"] == 0


def test_user_reward_from_file_and_a_raising_one(tmp_path, tokenizer):
    (tmp_path / "my_reward.py").write_text(
        "def length_reward(data_source, solution_str, ground_truth, extra_info):\n"
        "    return {'score': len(solution_str), 'note': 'x', 'exact': int(solution_str == ground_truth[:1])}\n"
        "def picky(data_source, solution_str, ground_truth, extra_info):\n"
        "    if solution_str == '12':\n"
        "        raise ValueError('boom')\n"
        "    return 1.0\n"
    )
    spec = f"{tmp_path}/my_reward.py:length_reward"
    for scorer in InProcessCalls(load_reward_fn(spec), spec, REWARD_CALLS), CallProcesses(spec, 2, REWARD_CALLS):
        scores, _, extras = score(batch_of(tokenizer, ["3", "12"], ["3", "12"]), tokenizer, scorer)
        scorer.close()
        assert scores.tolist() == [1.0, 2.0]
        assert extras == [{"note": "x", "exact": 1}, {"note": "x", "exact": 0}]  # the keys beside "score", per response
        assert extra_means(extras, "reward/") == {"reward/exact": 0.5}  # numbers only
    spec = f"{tmp_path}/my_reward.py:picky"
    for scorer in InProcessCalls(load_reward_fn(spec), spec, REWARD_CALLS), CallProcesses(spec, 2, REWARD_CALLS):
        scores, metrics, _ = score(batch_of(tokenizer, ["3", "12", "7"], ["3", "12", "7"]), tokenizer, scorer)
        scorer.close()
        assert scores.tolist() == [1.0, 0.0, 1.0]
        assert metrics["reward/errors"] == 1


def test_bad_reward_specs(tmp_path):
    with pytest.raises(ValueError, match="path/to/file.py:function_name"):
        load_reward_fn("nofunction.py")
    with pytest.raises(ValueError, match="no file"):
        load_reward_fn(f"{tmp_path}/missing.py:f")
    (tmp_path / "r.py").write_text("x = 1\n")
    with pytest.raises(ValueError, match="defines no function 'f'"):
        load_reward_fn(f"{tmp_path}/r.py:f")


def test_unknown_data_source_fails_early():
    data = DataProto.from_dict(non_tensors={"data_source": ["addition", "my_task"]})
    with pytest.raises(ValueError, match=r"no built-in reward for data_source \['my_task'\]"):
        check_data_sources(data, default_reward)
    check_data_sources(data, lambda *a: 0.0)


@pytest.mark.parametrize(
    "result, value",
    [(1, 1.0), (0.5, 0.5), (True, 1.0), (np.float32(0.25), 0.25), (torch.tensor(2.0), 2.0), ({"score": 3, "exact": 1.0}, 3.0)],
)
def test_a_score_is_a_finite_number(result, value):
    assert score_value(result) == value


@pytest.mark.parametrize("result", [None, "1.0", {"exact": 1.0}, float("nan"), float("inf"), {"score": None}])
def test_anything_else_is_an_error(result):
    with pytest.raises((TypeError, ValueError), match="the reward function returned"):
        score_value(result)


def test_failures_are_printed_once_per_kind_and_too_many_stop_the_run(tokenizer, capsys):
    def half_broken(data_source, solution_str, ground_truth, extra_info):
        if solution_str == "12":
            import sys

            sys.exit(3)  # ends nothing: one failing sample
        return None if solution_str == "7" else 1.0

    REPORTED_FAILURES.clear()  # what earlier tests in this process printed
    batch = batch_of(tokenizer, ["3", "12", "7", "4"], ["3", "12", "7", "4"])
    half_broken = InProcessCalls(half_broken, "half_broken.py:half_broken", REWARD_CALLS)
    scores, metrics, _ = score(batch, tokenizer, half_broken, max_error_share=0.5)
    assert scores.tolist() == [1.0, 0.0, 0.0, 1.0] and metrics["reward/errors"] == 2
    printed = capsys.readouterr().err
    assert printed.count("the reward function failed for data_source 'addition'") == 2  # SystemExit and TypeError
    assert "response '12'" in printed and "(the reward: half_broken.py:half_broken)" in printed
    assert "fix the reward function" in printed
    score(batch, tokenizer, half_broken, max_error_share=0.5)
    assert capsys.readouterr().err == ""  # each kind once
    with pytest.raises(RewardError, match=r"failed for 2 of 4 samples, more than --max-reward-error-share 0.25 allows"):
        score(batch, tokenizer, half_broken, max_error_share=0.25)


def test_reward_processes_survive_what_a_reward_does(tmp_path, tokenizer, capsys):
    """Each of these fails its own sample only, and the processes score the next batch as before."""
    (tmp_path / "wild.py").write_text(
        "import ctypes, os, re, signal, sys, time\n"
        "def score(data_source, solution_str, ground_truth, extra_info):\n"
        "    if solution_str == '0':\n"
        "        os.kill(os.getpid(), signal.SIGSTOP)  # stopped, as by a SIGSTOP from outside: it never answers\n"
        "    if solution_str == '1':\n"
        "        ctypes.string_at(0)  # a segfault\n"
        "    if solution_str == '2':\n"
        "        os._exit(3)\n"
        "    if solution_str == '3':\n"
        "        sys.exit(4)\n"
        "    if solution_str == '4':\n"
        "        re.match(r'(a+)+$', 'a' * 64 + 'b')  # stuck inside a C call: no signal handler runs\n"
        "    if solution_str == '5':\n"
        "        time.sleep(60)\n"
        "    if solution_str == '6':\n"
        "        return {'score': 1.0, 'how': lambda: 0}  # cannot be sent back\n"
        "    return {'score': 1.0, 'pid': os.getpid()}\n"
    )
    REPORTED_FAILURES.clear()
    pool = CallProcesses(f"{tmp_path}/wild.py:score", 2, REWARD_CALLS, timeout=1.0)
    try:
        texts = ["0", "1", "2", "3", "4", "5", "6"] + ["7"] * 10  # sent two at a time: a killed call's partner goes again
        scores, metrics, extras = score(batch_of(tokenizer, texts, texts), tokenizer, pool)
        assert scores.tolist() == [0.0] * 7 + [1.0] * 10
        assert metrics == {"reward/errors": 4, "reward/timeouts": 3, "reward/unscored": 0}
        printed = capsys.readouterr().err
        assert "died with exit code -11" in printed and "SystemExit: 4" in printed and "pickle" in printed
        assert printed.count("died with exit code") == 1  # the second death, os._exit's, is the same kind
        scores, metrics, extras = score(batch_of(tokenizer, ["7", "8"], ["7", "8"]), tokenizer, pool)
        assert scores.tolist() == [1.0, 1.0] and metrics == {"reward/errors": 0, "reward/timeouts": 0, "reward/unscored": 0}
        assert all(psutil.pid_exists(extra["pid"]) for extra in extras)
    finally:
        pool.close()
    assert not any(psutil.pid_exists(extra["pid"]) for extra in extras)


def test_reward_processes_score_at_once(tmp_path, tokenizer):
    """Two calls that each wait for the other to start finish only when they run at the same time."""
    (tmp_path / "meet.py").write_text(
        "import os, time\n"
        "def score(data_source, solution_str, ground_truth, extra_info):\n"
        f"    folder = {str(tmp_path)!r}\n"
        "    open(os.path.join(folder, solution_str), 'w').close()\n"
        "    other = os.path.join(folder, '2' if solution_str == '1' else '1')\n"
        "    for _ in range(500):\n"
        "        if os.path.exists(other):\n"
        "            return 1.0\n"
        "        time.sleep(0.01)\n"
        "    return 0.0\n"
    )
    pool = CallProcesses(f"{tmp_path}/meet.py:score", 2, REWARD_CALLS, timeout=30)
    try:
        scores, _, _ = score(batch_of(tokenizer, ["1", "2"], ["1", "2"]), tokenizer, pool)
    finally:
        pool.close()
    assert scores.tolist() == [1.0, 1.0]


def test_a_reward_file_that_fails_in_the_processes_stops_the_run(tmp_path, tokenizer):
    (tmp_path / "once.py").write_text(
        "import os\n"
        "if os.path.exists(__file__ + '.loaded'):\n"
        "    raise ImportError('only loads once')\n"
        "open(__file__ + '.loaded', 'w').close()\n"
        "def score(data_source, solution_str, ground_truth, extra_info):\n"
        "    return 1.0\n"
    )
    spec = f"{tmp_path}/once.py:score"
    load_reward_fn(spec)  # the driver's check of --reward-fn
    pool = CallProcesses(spec, 1, REWARD_CALLS)
    try:
        with pytest.raises(UserCodeError, match=r"(?s)loading it in a reward process failed.*only loads once"):
            score(batch_of(tokenizer, ["1"], ["1"]), tokenizer, pool)
    finally:
        pool.close()
