"""A rollout: the batch the trainer reads of an engine's responses (each cut at its EOS or stop string, padded, with
the engine's log-probs of its tokens), whichever engine (common/engines.py) generated them."""

from __future__ import annotations

import torch

from common.dataproto import DataProto


def stop_end(tokens: list[int], stop_strings: list[str], tokenizer) -> int | None:
    """How many of `tokens` lead up to and include the token that completes the first stop string; None without one."""
    holds_stop = lambda k: any(s in tokenizer.decode(tokens[:k], skip_special_tokens=True) for s in stop_strings)  # noqa: E731
    if not stop_strings or not holds_stop(len(tokens)):
        return None
    low, high = 1, len(tokens)  # the shortest prefix whose text holds a stop string
    while low < high:
        middle = (low + high) // 2
        low, high = (low, middle) if holds_stop(middle) else (middle + 1, high)
    return low


def response_batch(prompts, prompt_mask, responses, log_probs, max_response_length: int, eos_token_ids, pad_token_id):
    """What either engine generated, as the batch the trainer reads.

    `responses` and `response_mask` padded to `max_response_length`, the mask covering tokens up to and
    including the first EOS; the engine's log-prob of each sampled token as `rollout_log_probs`; the full
    sequences as `input_ids`, `attention_mask` and `position_ids`.
    """
    pad = (0, max_response_length - responses.shape[1])
    responses = torch.nn.functional.pad(responses, pad, value=pad_token_id)
    log_probs = torch.nn.functional.pad(log_probs, pad)
    is_eos = torch.isin(responses, torch.tensor(eos_token_ids, device=responses.device))
    response_mask = (is_eos.cumsum(-1) - is_eos.long()) == 0
    responses = responses.masked_fill(~response_mask, pad_token_id)
    return DataProto.from_dict(response_tensors(prompts, prompt_mask, responses, response_mask.float(), log_probs)).to("cpu")


def response_tensors(prompts, prompt_mask, responses, response_mask, log_probs, attends=None) -> dict:
    """The batch's keys of responses to left-padded `prompts`: `responses`, `response_mask` (the tokens the losses
    count), the engine's log-probs of those as `rollout_log_probs`, and the full sequences as `input_ids`,
    `attention_mask` and `position_ids`. `attends`: the response tokens that attend (default: `response_mask`'s)."""
    attends = response_mask if attends is None else attends
    attention_mask = torch.cat([prompt_mask, attends.long()], dim=-1)
    return {
        "responses": responses,
        "response_mask": response_mask,
        "rollout_log_probs": log_probs * response_mask,
        "input_ids": torch.cat([prompts, responses], dim=-1),
        "attention_mask": attention_mask,
        "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0),
    }
