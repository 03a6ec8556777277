"""Scores from an LLM judge (--judge-model): a language model asked, by a template, whether a response is right.

The template (--judge-template, a text file) holds {prompt}, {response} and {ground_truth}: each is replaced by the
row's prompt (its messages' text), the policy's response and the row's ground truth, and the result is the judge's
question, a user message rendered by the judge's own chat template (verl renders a reward model's input so too). The
template asks for a verdict: Yes or No.

How a verdict becomes a score (--judge-mode):
- "probability": one forward pass of the judge over the question. The score is p(Yes) / (p(Yes) + p(No)) for its
  next token, each summed over the spellings that are one token in its tokenizer ("Yes", " Yes", "yes", " yes").
  The verdict is missing when the judge's most likely next token is none of them.
- "parsed": the judge answers greedily, up to --judge-max-tokens tokens, on the run's rollout engine (hf or vllm);
  the first word "yes" or "no" (any case) in its answer is the verdict, 1 or 0. Missing when neither appears.

A missing verdict scores 0 and counts in reward/judge_failures; the first is printed with the judge's answer, and
more than --max-reward-error-share of a batch stops the run before an update uses the scores, as a reward's failures
do. The judge's score meets a rule's as a reward model's does (common/reward_model.py: combine).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import torch

from common.data import collate, pad_token_id
from common.dataproto import DataProto
from common.rewards import RewardError
from common.rollout import response_batch

FIELDS = ("{prompt}", "{response}", "{ground_truth}")
VERDICTS = {"yes": ("Yes", " Yes", "yes", " yes"), "no": ("No", " No", "no", " no")}
VERDICT_WORD = re.compile(r"\b(yes|no)\b", re.IGNORECASE)


def load_template(path: str) -> str:
    """The template's text; it must hold {response}, or the judge would never see what it judges."""
    file = Path(path)
    if not file.is_file():
        raise ValueError(f"--judge-template {path}: no such file; write the judge's question in a text file")
    template = file.read_text()
    if "{response}" not in template:
        raise ValueError(
            f"--judge-template {path} has no {{response}}: the judge would not see the response. Put {{response}} "
            "(and {prompt}, {ground_truth} as it needs) where they go in the question"
        )
    return template


def verdict_token_ids(tokenizer, judge_model: str) -> tuple[list[int], list[int]]:
    """The token ids of the spellings of Yes, and of No, that are one token each in the judge's tokenizer."""
    ids = {}
    for verdict, spellings in VERDICTS.items():
        tokens = [tokenizer.encode(spelling, add_special_tokens=False) for spelling in spellings]
        ids[verdict] = sorted({token[0] for token in tokens if len(token) == 1})
        if not ids[verdict]:
            raise ValueError(
                f"--judge-model {judge_model}: no spelling of {spellings[0]} ({', '.join(map(repr, spellings))}) is one "
                "token in its tokenizer, so --judge-mode probability cannot read it; use --judge-mode parsed"
            )
    return ids["yes"], ids["no"]


def question(template: str, messages: list[dict], response: str, ground_truth) -> str:
    """The template with the row's prompt (its messages' text, a blank line between), the response and the truth."""
    values = ("\n\n".join(message["content"] for message in messages), response, str(ground_truth))
    text = template
    for field, value in zip(FIELDS, values):
        text = text.replace(field, value)
    return text


def question_ids(text: str, tokenizer) -> list[int]:
    """The question as the judge's user message, rendered by its chat template (the text alone without one)."""
    if tokenizer.chat_template:
        text = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def check_question_length(template: str, tokenizer, ground_truths, prompt_and_response: int, max_prompt_length: int):
    """Fail before any worker starts when a question can outgrow --judge-max-prompt-length: the template in the judge's
    chat template, the longest ground truth, and `prompt_and_response` tokens (the policy's longest prompt and response;
    the judge's tokenizer may count a few more, which a question's own check catches)."""
    frame = len(question_ids(question(template, [], "", ""), tokenizer))
    # each distinct truth once: rows repeat their answers, and without --val-files the training rows come twice
    truth = max(len(tokenizer(value, add_special_tokens=False)["input_ids"]) for value in set(map(str, ground_truths)))
    if frame + truth + prompt_and_response > max_prompt_length:
        raise ValueError(
            f"a judge's question can reach {frame + truth + prompt_and_response} tokens (the template in the judge's chat "
            f"template {frame}, the longest ground truth {truth}, --max-prompt-length + --max-response-length "
            f"{prompt_and_response}), more than --judge-max-prompt-length {max_prompt_length}: raise it"
        )


def parse_verdict(answer: str) -> float | None:
    """1.0 or 0.0 for the first word yes or no in `answer`; None when it has neither."""
    match = VERDICT_WORD.search(answer)
    return None if match is None else float(match.group(1).lower() == "yes")


def probability_verdicts(log_probs: torch.Tensor, top_tokens: torch.Tensor, verdict_ids: list[int]) -> list[float | None]:
    """p(Yes) / (p(Yes) + p(No)) from each row's (log p(Yes), log p(No)); None where the row's most likely token is
    not one of `verdict_ids`."""
    scores = torch.sigmoid(log_probs[:, 0] - log_probs[:, 1]).tolist()
    return [score if token in verdict_ids else None for score, token in zip(scores, top_tokens.tolist())]


class Judge:
    """The judge's worker group (common/workers.py) and what it needs to turn responses into scores."""

    def __init__(self, group, tokenizer, template: str, mode: str, max_tokens: int, max_prompt_length: int, model: str):
        self.group, self.tokenizer, self.template, self.mode = group, tokenizer, template, mode
        self.max_tokens, self.max_prompt_length, self.model = max_tokens, max_prompt_length, model
        self.pad_token_id = pad_token_id(tokenizer)
        self.verdict_ids = verdict_token_ids(tokenizer, model) if mode == "probability" else None
        self.reported = False

    def score(self, messages, responses, ground_truths, max_failure_share: float) -> tuple[list[float], int]:
        """Each response's score and how many verdicts were missing (each scores 0). More than `max_failure_share` of
        the responses without a verdict raises RewardError: no update uses scores that are mostly missing."""
        questions = [question(self.template, *row) for row in zip(messages, responses, ground_truths)]
        ids = [question_ids(text, self.tokenizer) for text in questions]
        longest = max(map(len, ids))
        if longest > self.max_prompt_length:
            raise ValueError(
                f"a judge's question has {longest} tokens, more than --judge-max-prompt-length {self.max_prompt_length}: "
                "raise it, or shorten --judge-template or the responses (--max-response-length)"
            )
        prompts = collate(DataProto.from_dict(non_tensors={"prompt_ids": ids}), self.pad_token_id).select(
            "prompts", "prompt_mask"
        )
        if self.mode == "probability":
            yes, no = self.verdict_ids
            one_token = torch.full((len(ids), 1), yes[0], dtype=torch.long)
            batch = response_batch(
                prompts["prompts"], prompts["prompt_mask"], one_token, torch.zeros(len(ids), 1), 1, [], self.pad_token_id
            )
            judged = self.group.scatter("verdict_log_probs", batch, yes_ids=yes, no_ids=no)
            verdicts = probability_verdicts(judged["verdict_log_probs"], judged["top_tokens"], yes + no)
            answers = [
                f"its most likely next token is {token!r}"
                for token in self.tokenizer.batch_decode(judged["top_tokens"][:, None])
            ]
        else:
            answered = self.group.scatter("generate", prompts, max_response_length=self.max_tokens, do_sample=False)
            answers = self.tokenizer.batch_decode(answered["responses"], skip_special_tokens=True)
            verdicts = [parse_verdict(answer) for answer in answers]
            answers = [f"its answer {answer!r}" for answer in answers]
        failures = [i for i, verdict in enumerate(verdicts) if verdict is None]
        if failures and not self.reported:
            self.reported = True
            print(
                f"the judge gave no verdict (--judge-model {self.model}, --judge-mode {self.mode}) to the question "
                f"{questions[failures[0]]!r}: {answers[failures[0]]}. The response scores 0 and counts in "
                "reward/judge_failures; make --judge-template ask for Yes or No",
                file=sys.stderr,
            )
        if len(failures) > max_failure_share * len(verdicts):
            raise RewardError(
                f"the judge gave no verdict for {len(failures)} of {len(verdicts)} responses, more than "
                f"--max-reward-error-share {max_failure_share} allows; no update used these scores. Make "
                f"--judge-template ask for Yes or No, or try the other --judge-mode"
            )
        return [0.0 if verdict is None else verdict for verdict in verdicts], len(failures)
