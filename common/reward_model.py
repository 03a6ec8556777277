"""Scores from a reward model (--reward-model): what it reads, and how its score meets a rule's.

The reward model reads each conversation as its own chat template renders it, in its own tokens: the prompt's
messages, then the response as the assistant's message. A reward model trained with another template or tokenizer
than the policy's still sees what it was trained on (verl re-renders so too, when the tokenizers differ). Its
score is its head's output at the rendered conversation's last token (common/workers.py).

The rule, one for every script: a row whose data source has a rule (a built-in reward, or --reward-fn for every
row) scores rule + --reward-model-coef x the model's score; a row without one scores the model's alone.
"""

from __future__ import annotations

from pathlib import Path

import torch

from common.dataproto import DataProto


def conversation_text(prompt: list[dict], response: str, tokenizer) -> str:
    """A prompt's messages and its response as the assistant's message, rendered by `tokenizer`'s chat template (the
    messages' text, one per line, when it has none)."""
    if tokenizer.chat_template:
        return tokenizer.apply_chat_template([*prompt, {"role": "assistant", "content": response}], tokenize=False)
    return "\n".join([*(message["content"] for message in prompt), response])


def render_conversations(messages: list[list[dict]], responses: list[str], tokenizer) -> list[list[int]]:
    """Each conversation's text (conversation_text), tokenised by `tokenizer`."""
    texts = [conversation_text(prompt, response, tokenizer) for prompt, response in zip(messages, responses)]
    return [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]


def reward_model_batch(conversations: list[list[int]], pad_token_id: int) -> DataProto:
    """The conversations right-padded, as RewardModelWorker.compute_rm_score takes them."""
    longest = max(map(len, conversations))
    input_ids = torch.full((len(conversations), longest), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((len(conversations), longest), dtype=torch.long)
    for row, ids in enumerate(conversations):
        input_ids[row, : len(ids)] = torch.tensor(ids, dtype=torch.long)
        attention_mask[row, : len(ids)] = 1
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    return DataProto.from_dict({"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": position_ids})


def combine(rule_scores: dict[int, float], model_scores: list[float], coef: float) -> list[float]:
    """The rule: rule + coef x model where a row has a rule score (`rule_scores`, by row), the model's alone
    elsewhere."""
    return [rule_scores[i] + coef * model if i in rule_scores else model for i, model in enumerate(model_scores)]


def check_reward_model(path: str) -> None:
    """Fail before any worker starts when --reward-model is no sequence-classification model with one label."""
    import json

    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        return  # a hub id: the worker's own check says what is wrong
    config = json.loads(config_file.read_text())
    architectures, labels = config.get("architectures") or [], len(config.get("id2label") or {0: ""})
    if not any(name.endswith("ForSequenceClassification") for name in architectures) or labels != 1:
        raise ValueError(
            f"--reward-model {path}: its config.json names {architectures or 'no architecture'} with {labels} labels; a "
            "reward model is a ...ForSequenceClassification with one label (num_labels=1), one score per sequence"
        )
