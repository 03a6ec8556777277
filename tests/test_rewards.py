import pytest
import torch

from common.dataproto import DataProto
from common.rewards import check_data_sources, default_reward, gsm8k_reward, load_reward_fn, score


@pytest.mark.parametrize(
    "response, truth, expected",
    [
        ("so the answer is #### 72", "72", 1.0),
        ("#### 1,234", "1234", 1.0),
        ("#### $18.", "18", 1.0),
        ("#### 5 then later #### 6", "6", 1.0),
        ("#### 5 then later #### 6", "5", 0.0),
        ("the answer is 72", "72", 0.0),
        ("#### 71", "72", 0.0),
    ],
)
def test_gsm8k(response, truth, expected):
    assert gsm8k_reward(response, truth) == expected


def batch_of(tokenizer, texts, truths, source="addition"):
    responses = torch.tensor([tokenizer(t)["input_ids"] + [tokenizer.pad_token_id] * (4 - len(t)) for t in texts])
    return DataProto.from_dict(
        {"responses": responses}, {"data_source": [source] * len(texts), "ground_truth": truths, "extra_info": [{}] * len(texts)}
    )


def test_score_builtin(tokenizer):
    scores, metrics = score(batch_of(tokenizer, ["3", "12", "4"], ["3", "12", "5"]), tokenizer, default_reward)
    assert scores.tolist() == [1.0, 1.0, 0.0]
    assert metrics["reward/errors"] == 0


def test_user_reward_from_file_and_a_raising_one(tmp_path, tokenizer):
    (tmp_path / "my_reward.py").write_text(
        "def length_reward(data_source, solution_str, ground_truth, extra_info):\n"
        "    return {'score': len(solution_str), 'note': 'x'}\n"
        "def picky(data_source, solution_str, ground_truth, extra_info):\n"
        "    if solution_str == '12':\n"
        "        raise ValueError('boom')\n"
        "    return 1.0\n"
    )
    fn = load_reward_fn(f"{tmp_path}/my_reward.py:length_reward")
    scores, _ = score(batch_of(tokenizer, ["3", "12"], ["3", "12"]), tokenizer, fn)
    assert scores.tolist() == [1.0, 2.0]
    picky = load_reward_fn(f"{tmp_path}/my_reward.py:picky")
    scores, metrics = score(batch_of(tokenizer, ["3", "12", "7"], ["3", "12", "7"]), tokenizer, picky)
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
