"""Rule-based rewards, one per `data_source`, plus a user's own from a file.

A reward function has the signature
`fn(data_source, solution_str, ground_truth, extra_info) -> float | {"score": float, ...}`.
"""

from __future__ import annotations

import importlib.util
import os
import re
from collections import defaultdict

import numpy as np
import torch

from common.dataproto import DataProto


def addition_reward(solution_str: str, ground_truth: str) -> float:
    """The built-in demo task: the response is exactly the sum."""
    return float(solution_str.strip() == str(ground_truth))


def _number(text: str) -> float | None:
    try:
        return float(text.replace(",", "").replace("$", "").strip())
    except ValueError:
        return None


def gsm8k_reward(solution_str: str, ground_truth: str) -> float:
    """1 when the last number written after '####' equals the ground truth."""
    answers = re.findall(r"####\s*([-$0-9.,]+)", solution_str)
    if not answers:
        return 0.0
    answer, truth = _number(answers[-1].rstrip(".")), _number(str(ground_truth))
    return float(answer is not None and truth is not None and abs(answer - truth) < 1e-6)


BUILTIN_REWARDS = {
    "addition": addition_reward,
    "gsm8k": gsm8k_reward,
    "openai/gsm8k": gsm8k_reward,
}


def default_reward(data_source: str, solution_str: str, ground_truth, extra_info: dict):
    return BUILTIN_REWARDS[data_source](solution_str, ground_truth)


def load_reward_fn(spec: str | None):
    """`None` for the built-in rewards, or `path/to/file.py:function_name`."""
    if spec is None:
        return default_reward
    path, _, name = spec.rpartition(":")
    if not path or not name:
        raise ValueError(f"--reward-fn '{spec}': write it as path/to/file.py:function_name")
    if not os.path.isfile(path):
        raise ValueError(f"--reward-fn '{spec}': no file {path}")
    module_spec = importlib.util.spec_from_file_location(f"user_reward_{abs(hash(path))}", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    if not callable(getattr(module, name, None)):
        raise ValueError(f"--reward-fn '{spec}': {path} defines no function '{name}'")
    return getattr(module, name)


def check_data_sources(data: DataProto, reward_fn) -> None:
    """Fail before training when the built-in rewards do not cover a data source."""
    if reward_fn is not default_reward:
        return
    unknown = sorted(set(data.non_tensor["data_source"]) - BUILTIN_REWARDS.keys())
    if unknown:
        raise ValueError(
            f"no built-in reward for data_source {unknown}; built in: {sorted(BUILTIN_REWARDS)}. "
            "Pass --reward-fn path/to/file.py:function_name"
        )


def score(batch: DataProto, tokenizer, reward_fn) -> tuple[torch.Tensor, dict]:
    """One scalar score per response. A reward function that raises scores 0 and is counted."""
    texts = tokenizer.batch_decode(batch.batch["responses"], skip_special_tokens=True)
    scores, errors = [], 0
    for text, source, truth, extra in zip(texts, *(batch.non_tensor[k] for k in ("data_source", "ground_truth", "extra_info"))):
        try:
            result = reward_fn(source, text, truth, extra)
            scores.append(float(result["score"] if isinstance(result, dict) else result))
        except Exception:
            scores.append(0.0)
            errors += 1
    return torch.tensor(scores, dtype=torch.float32), {"reward/errors": errors}


def validate(policy, val_loader, tokenizer, reward_fn, max_response_length: int) -> dict:
    """Greedy accuracy (mean score) over the validation set, overall and per data source."""
    by_source, all_scores, errors = defaultdict(list), [], 0
    for batch in val_loader:
        batch |= policy.scatter("generate", batch.select("prompts", "prompt_mask"), max_response_length=max_response_length, do_sample=False)
        scores, metrics = score(batch, tokenizer, reward_fn)
        errors += metrics["reward/errors"]
        for source, value in zip(batch.non_tensor["data_source"], scores.tolist()):
            by_source[source].append(value)
            all_scores.append(value)
    metrics = {"val/accuracy": float(np.mean(all_scores)), "val/reward_errors": errors}
    metrics.update({f"val/accuracy/{source}": float(np.mean(values)) for source, values in by_source.items()})
    return metrics
