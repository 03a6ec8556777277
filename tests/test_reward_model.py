"""The reward model (--reward-model): its worker group, what it reads, and how its score meets a rule's."""

import json

import pyarrow.parquet as pq
import pytest
import torch
from helpers import SMALL_RUN, metrics_of, run_script, stop_in_process

from common.reward_model import combine, conversation_text, render_conversations, reward_model_batch
from common.worker_group import WorkerGroup
from common.workers import RewardModelWorker

MESSAGES = [[{"role": "user", "content": f"{a}+{b}="}] for a, b in [(3, 4), (1, 2), (9, 9), (0, 5), (7, 1)]]
RESPONSES = ["7", "3;maybe", "", "x" * 12, "8"]


def test_a_conversation_is_rendered_by_the_reward_models_own_template(reward_model, tokenizer):
    from transformers import AutoTokenizer

    conversations = render_conversations(MESSAGES[:2], RESPONSES[:2], AutoTokenizer.from_pretrained(reward_model))
    assert [tokenizer.decode(ids) for ids in conversations] == ["[u]3+4=[a]7", "[u]1+2=[a]3;maybe"]
    assert conversation_text(MESSAGES[0], RESPONSES[0], tokenizer) == "3+4=\n7"  # no template: the texts, a line each


def test_the_worker_scores_each_conversation_at_its_last_token(cpu_pool, reward_model):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(reward_model)
    conversations = render_conversations(MESSAGES, RESPONSES, tokenizer)
    group = WorkerGroup(
        RewardModelWorker, cpu_pool, "reward_model", model_path=reward_model, micro_batch_size=2, compute_dtype="float32"
    )
    try:
        batch = reward_model_batch(conversations, tokenizer.pad_token_id)
        scores = group.scatter("compute_rm_score", batch)["rm_scores"]
    finally:
        group.shutdown()
    # transformers' own score of each conversation alone, unpadded: its head at the last token
    model = AutoModelForSequenceClassification.from_pretrained(reward_model)
    with torch.no_grad():
        expected = [model(torch.tensor([ids])).logits[0, 0].item() for ids in conversations]
    assert scores.tolist() == pytest.approx(expected, abs=1e-5)
    assert len(set(expected)) == len(expected)  # five conversations, five scores: each row read at its own end


def test_rows_with_a_rule_add_the_weighted_model_score_others_take_it_alone():
    assert combine({0: 1.0, 2: 0.0}, [0.5, -2.0, 4.0], coef=0.25) == [1.125, -2.0, 1.0]


def test_a_causal_language_model_is_refused_as_a_reward_model(demo_files, tmp_path, monkeypatch):
    stop = stop_in_process("grpo_hybrid.py", "--reward-model", demo_files[0], cwd=tmp_path, monkeypatch=monkeypatch)
    assert "a reward model is a ...ForSequenceClassification with one label" in stop
    assert "PolicyWorker" not in stop  # before any worker started


def test_ppo_against_a_reward_model_beside_the_rule(ray_cluster, demo_files, reward_model, tmp_path):
    result = run_script(
        "ppo_hybrid.py", *SMALL_RUN, "--reward-model", reward_model, "--reward-model-coef", "0.5", cwd=tmp_path
    )
    assert result.returncode == 0, result.stderr[-3000:]
    _, rows = metrics_of(tmp_path)
    for row in rows[1:]:
        assert row["train/reward_mean"] == pytest.approx(row["reward/rule"] + 0.5 * row["reward/model"], abs=1e-6)
        assert "val/reward/model" in row and "critic/loss" in row


def test_rows_without_a_rule_train_on_the_model_alone_placed_apart(ray_cluster, demo_files, reward_model, tmp_path):
    """Data sources with no rule are the reward model's: no error at start-up, and its score is the reward."""
    rows = pq.read_table(demo_files[1]).to_pylist()
    chat = tmp_path / "chat.jsonl"
    chat.write_text("".join(json.dumps(row | {"data_source": "chat"}) + "\n" for row in rows))
    flags = [*SMALL_RUN, "--train-files", str(chat), "--val-files", str(chat), "--reward-model", reward_model]
    result = run_script("grpo_hybrid.py", *flags, "--num-workers", "1", "--reward-model-workers", "1", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    _, metrics = metrics_of(tmp_path)
    for row in metrics[1:]:
        assert row["train/reward_mean"] == pytest.approx(row["reward/model"], abs=1e-6) and "reward/rule" not in row
        assert row["val/accuracy"] == pytest.approx(row["val/reward/model"], abs=1e-6)
