"""common/scoring.py in this process: the Scorer checks what scores a run before any worker starts, and scores
responses by the rule (the reward model and the judge on workers: test_reward_model.py, test_judge.py)."""

import pytest

from common.args import RunArgs
from common.data import load_prompts
from common.dataproto import DataProto
from common.scoring import Scorer

RULE = """
def score(data_source, solution_str, ground_truth, extra_info):
    return {"score": float(solution_str == ground_truth), "length": len(solution_str)}
"""


def batch_of(sources, truths) -> DataProto:
    return DataProto.from_dict({}, {"data_source": sources, "ground_truth": truths, "extra_info": [{} for _ in sources]})


def test_the_rule_scores_each_response_and_keeps_its_other_keys(tokenizer, tmp_path):
    (tmp_path / "rule.py").write_text(RULE)
    scorer = Scorer(RunArgs(reward_fn=f"{tmp_path}/rule.py:score"), tokenizer)
    assert not scorer.by_model and scorer.groups() == {}
    scorer.start(None, 0)  # the rule's calls in this process
    try:
        scores, counts, extras = scorer.score_texts(["7", "12"], batch_of(["addition"] * 2, ["7", "13"]))
    finally:
        scorer.close()
    assert scores == [1.0, 0.0]
    assert counts == {"reward/errors": 0, "reward/timeouts": 0, "reward/unscored": 0}
    assert extras == [{"length": 1}, {"length": 2}]


def test_a_data_source_no_rule_scores_fails_before_any_worker(demo_files, tokenizer):
    prompts = load_prompts([demo_files[1]], tokenizer, 8)
    Scorer(RunArgs(), tokenizer).check_prompts(prompts, prompts)  # the demo's addition has a built-in reward
    prompts.non_tensors["data_source"][:] = "geometry"
    with pytest.raises(ValueError, match=r"no built-in reward for data_source \['geometry'\]; .* --reward-fn"):
        Scorer(RunArgs(), tokenizer).check_prompts(prompts, prompts)


def test_a_reward_model_is_checked_when_the_scorer_is_made(reward_model, tiny_model, tokenizer, demo_files):
    scorer = Scorer(RunArgs(reward_model=reward_model), tokenizer)
    assert scorer.by_model and scorer.reward_model_tokenizer.chat_template is not None
    prompts = load_prompts([demo_files[1]], tokenizer, 8)
    prompts.non_tensors["data_source"][:] = "geometry"
    scorer.check_prompts(prompts, prompts)  # rows no rule scores are the model's alone
    with pytest.raises(ValueError, match="a reward model is a ...ForSequenceClassification with one label"):
        Scorer(RunArgs(reward_model=tiny_model), tokenizer)
    with pytest.raises(ValueError, match="--reward-model /nowhere: no such folder"):
        Scorer(RunArgs(reward_model="/nowhere"), tokenizer)
