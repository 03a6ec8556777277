"""Rule-based rewards, one per `data_source`, plus a user's own from a file.

A reward function has verl's signature, `fn(data_source, solution_str, ground_truth, extra_info) -> float |
{"score": float, ...}`, or TRL's, `fn(completions, prompts=None, **columns) -> list[float | None]` (a parameter named
`completions` tells them apart). --reward-fn may name several, weighted by --reward-weights.
"""

from __future__ import annotations

import inspect
import math
import numbers
import os
import re
import traceback
from collections import defaultdict
from statistics import fmean
from typing import TYPE_CHECKING

from common.isolation import CallKind, UserCodeError, load_user_file, report_once
from common.sandbox import code_reward

if TYPE_CHECKING:
    from common.dataproto import DataProto


def exact_answer_reward(solution_str: str, ground_truth: str) -> float:
    """The built-in demo tasks: the response is exactly the answer."""
    return float(solution_str.strip() == str(ground_truth))


def _number(text: str) -> float | None:
    try:
        return float(text.replace(",", "").replace("$", "").strip())
    except ValueError:
        return None


def last_number_reward(solution_str: str, ground_truth: str) -> float:
    """The real model's times tables: 1 when the last number in the response equals the answer."""
    numbers = re.findall(r"-?\d+(?:\.\d+)?", solution_str.replace(",", ""))
    return float(bool(numbers) and _number(numbers[-1]) == _number(str(ground_truth)))


def gsm8k_reward(solution_str: str, ground_truth) -> float:
    """verl's GSM8K score (its gsm8k.py, strict): 1 when the last '#### <number>' in the response's last 300 characters,
    its commas dropped, is the ground truth's text exactly; so '####72', '#### 72.0' and '#### $72' score 0 for 72."""
    answers = re.findall(r"#### (-?[0-9.,]+)", solution_str[-300:])
    return float(bool(answers) and answers[-1].replace(",", "") == str(ground_truth))


def gsm8k_lenient(data_source, solution_str: str, ground_truth, extra_info) -> float:
    """A GSM8K score for --reward-fn common/rewards.py:gsm8k_lenient: 1 when the last number after '####' (any space
    between, ',' and '$' dropped, a final '.' ignored) equals the ground truth as a number, so '####72' and
    '#### 72.0' score 1 for 72."""
    answers = re.findall(r"####\s*([-$0-9.,]+)", solution_str)
    if not answers:
        return 0.0
    answer, truth = _number(answers[-1].rstrip(".")), _number(str(ground_truth))
    return float(answer is not None and truth is not None and abs(answer - truth) < 1e-6)


def math_reward(solution_str: str, ground_truth: str) -> float:
    """1 when math-verify finds the response's final answer equal to the ground truth.

    Needs the `math` extra (math-verify); parsing and comparing each stop after 5 seconds.
    """
    from math_verify import parse, verify

    gold = parse(f"\\boxed{{{ground_truth}}}", parsing_timeout=5)
    answer = parse(solution_str, parsing_timeout=5)
    return float(verify(gold, answer, timeout_seconds=5))


def dapo_math_reward(solution_str: str, ground_truth) -> dict:
    """verl's data sources math_dapo and aime*: the answer is the text after the last 'Answer:' in the response's last
    300 characters, compared with the ground truth by math-verify (verl normalises both strings instead); 1 when
    equal, -1 otherwise, as verl scores them, with `acc` 1 or 0 beside the score."""
    from math_verify import parse, verify

    answers = re.findall(r"(?i)Answer\s*:\s*([^\n]+)", solution_str[-300:])
    correct = bool(answers) and verify(
        parse(f"\\boxed{{{ground_truth}}}", parsing_timeout=5),
        parse(f"\\boxed{{{answers[-1].strip().strip('$').rstrip('.')}}}", parsing_timeout=5),
        timeout_seconds=5,
    )
    return {"score": 1.0 if correct else -1.0, "acc": float(correct)}


MATH_SOURCES = ("math", "lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500")
BUILTIN_REWARDS = {
    "addition": exact_answer_reward,
    "multiplication": exact_answer_reward,
    "times_tables": last_number_reward,
    "multiply_tool": last_number_reward,  # the multiplication tool's task (common/demo.py), the answer after the call
    "gsm8k": gsm8k_reward,
    "openai/gsm8k": gsm8k_reward,
    **dict.fromkeys(MATH_SOURCES, math_reward),  # verl's names of MATH, and ours
    "math_dapo": dapo_math_reward,
    "math_dapo_reasoning": dapo_math_reward,
    "code": code_reward,  # the response's program against the row's tests, in the sandbox
}


def builtin_reward(data_source: str):
    """The built-in reward of `data_source` (verl's aime* data sources by their prefix), or None."""
    if data_source.startswith("aime"):
        return dapo_math_reward
    return BUILTIN_REWARDS.get(data_source)


def default_reward(data_source: str, solution_str: str, ground_truth, extra_info: dict):
    return builtin_reward(data_source)(solution_str, ground_truth)


def takes_trl_arguments(function) -> bool:
    """Whether a reward function has TRL's signature (a `completions` parameter) rather than verl's."""
    try:
        return "completions" in inspect.signature(function).parameters
    except (TypeError, ValueError):  # a builtin without a signature
        return False


def load_reward_fn(spec: str | None):
    """`None` for the built-in rewards, or --reward-fn's functions, `path/to/file.py:function_name`, several
    comma-separated: a list of (name, function)."""
    if spec is None:
        return default_reward
    functions = [load_function(part, spec) for part in spec.split(",")]
    names = [name for name, _ in functions]
    if len(set(names)) < len(names):
        raise ValueError(f"--reward-fn '{spec}': two functions share a name; each is logged as reward/<its name>")
    return functions


def load_function(part: str, spec: str) -> tuple:
    path, _, name = part.strip().rpartition(":")
    if not path or not name:
        raise ValueError(f"--reward-fn '{spec}': write each function as path/to/file.py:function_name, commas between")
    if not os.path.isfile(path):
        raise ValueError(f"--reward-fn '{spec}': no file {path}")
    module = load_user_file(path)
    if not callable(getattr(module, name, None)):
        raise ValueError(f"--reward-fn '{spec}': {path} defines no function '{name}'")
    return name, getattr(module, name)


def reward_weights(spec: str | None, weights: str | None) -> list[float]:
    """--reward-weights as numbers, one per function of --reward-fn `spec` (1 each when unset)."""
    count = len(spec.split(",")) if spec else 1
    if weights is None:
        return [1.0] * count
    if spec is None:
        raise ValueError("--reward-weights weighs the functions of --reward-fn: pass --reward-fn too")
    try:
        values = [float(weight) for weight in weights.split(",")]
    except ValueError:
        raise ValueError(f"--reward-weights '{weights}': write numbers separated by commas, e.g. 1.0,0.5") from None
    if len(values) != count or not all(map(math.isfinite, values)):
        raise ValueError(
            f"--reward-weights '{weights}' gives {len(values)} weights for the {count} functions of --reward-fn; "
            "give one finite number per function, in the same order"
        )
    return values


def has_rule(data_source: str, reward_fn) -> bool:
    """Whether `reward_fn` scores rows of `data_source`: a user's reward scores every row, the built-in ones theirs."""
    return reward_fn is not default_reward or builtin_reward(data_source) is not None


def check_data_sources(data: DataProto, reward_fn) -> None:
    """Fail before training when the built-in rewards do not cover a data source."""
    unknown = sorted({source for source in data["data_source"] if not has_rule(source, reward_fn)})
    if unknown:
        raise ValueError(
            f"no built-in reward for data_source {unknown}; built in: {sorted(BUILTIN_REWARDS)} and aime*. "
            "Pass --reward-fn path/to/file.py:function_name (rows without a data_source are named 'custom')"
        )


REWARD_CALLS = CallKind(
    "reward",
    "--reward-fn",
    load="common.rewards:load_reward_fn",
    call="common.rewards:call_reward",
    builtin="the built-in rewards",
)


class RewardError(UserCodeError):
    pass


def call_reward(reward_fn, data_source, solution_str, ground_truth, extra_info, prompt=None, columns=None) -> tuple:
    """What one call of the reward came to: ("ok", one score per function, other keys), or ("error", kind, traceback).

    `reward_fn`: the built-in rewards, a function, or load_reward_fn's list. A function in TRL's signature is called
    with this one sample's lists, `completions` (the text, or the assistant's message when the prompt is a list of
    messages), `prompts` and the row's other `columns`, and may score None (no score from it). With several
    functions each score is also kept under the function's name."""
    functions = reward_fn if isinstance(reward_fn, list) else [(None, reward_fn)]
    values, extras = [], {}
    try:
        for name, function in functions:
            if takes_trl_arguments(function):
                completion = solution_str if isinstance(prompt, str) else [{"role": "assistant", "content": solution_str}]
                lists = {key: [value] for key, value in (columns or {}).items() if key not in ("completions", "prompts")}
                result = function(completions=[completion], prompts=[prompt], **lists)
                if not isinstance(result, (list, tuple)) or len(result) != 1:
                    raise TypeError(f"the reward function {name} returned {result!r} for one completion; return a list of one")
                value = None if result[0] is None else score_value(result[0])
            else:
                result = function(data_source, solution_str, ground_truth, extra_info)
                extras |= {k: v for k, v in result.items() if k != "score"} if isinstance(result, dict) else {}
                value = score_value(result)
            values.append(value)
            if len(functions) > 1 and value is not None:
                extras[name] = value
        return "ok", values, extras
    except (Exception, SystemExit) as error:  # sys.exit() in a reward must not end the run quietly
        return "error", type(error).__name__, traceback.format_exc()


def response_texts(batch: DataProto, tokenizer) -> list[str]:
    """What a reward scores: each response's text; of a multi-turn episode, its last turn."""
    if "final_turn" in batch:
        return list(batch["final_turn"])
    return tokenizer.batch_decode(batch["responses"], skip_special_tokens=True)


def score_value(result) -> float:
    """The score in what a reward function returned: a finite number, alone or under "score" in a dict."""
    value = result.get("score") if isinstance(result, dict) else result
    if hasattr(value, "item") and not isinstance(value, numbers.Real):  # a one-element tensor or array
        value = value.item()
    if not isinstance(value, numbers.Real):
        raise TypeError(f"the reward function returned {result!r}; return a number, or a dict with a number under 'score'")
    if not math.isfinite(value):
        raise ValueError(f"the reward function returned the score {value}; a score must be a finite number")
    return float(value)


def score_texts(
    texts: list[str], batch: DataProto, rewards, max_error_share: float = 1.0, weights: list[float] | None = None
) -> tuple[list, dict, list[dict]]:
    """One scalar score per decoded response, the error, timeout and unscored counts, and per response the other keys
    a reward function returned beside "score" (verl's reward managers return such keys: {"score": 1.0, "exact": 1}).

    `rewards` (CallProcesses or InProcessCalls of REWARD_CALLS) makes the calls. A reward function that raises (or exits, or
    crashes its process), returns anything but a finite number, or runs past the timeout scores 0 for that sample,
    which is counted. The first failure of each kind is printed with its traceback and sample. When more than
    `max_error_share` of the samples fail, RewardError stops the run before any update uses these scores.
    A response's score is the sum of its functions' scores times `weights` (1 each), leaving out those that scored
    None (TRL's nansum): one that no function scored scores 0, counted in `reward/unscored`.
    Episodes whose environment gave a score (`episode_score`) keep it and call no reward.
    """
    samples = list(zip(*(batch[k] for k in ("data_source", "ground_truth", "extra_info"))))
    prompts = batch["prompt_text"] if "prompt_text" in batch else [None] * len(texts)
    given_prompts = batch["prompt"] if "prompt" in batch else prompts
    columns = batch["columns"] if "columns" in batch else [{}] * len(texts)
    given = batch["episode_score"] if "episode_score" in batch else [None] * len(texts)
    unscored = [i for i, value in enumerate(given) if value is None]
    outcomes = [("ok", [value], {}) for value in given]
    calls = [(samples[i][0], texts[i], *samples[i][1:], given_prompts[i], columns[i]) for i in unscored]
    for i, outcome in zip(unscored, rewards(calls) if unscored else []):
        outcomes[i] = outcome
    scores, extras, errors, timeouts, nothing, first_failure = [], [], 0, 0, 0, None
    for text, prompt, (source, truth, _), outcome in zip(texts, prompts, samples, outcomes):
        values = outcome[1] if outcome[0] == "ok" else [0.0]
        nothing += all(value is None for value in values)
        weighed = weights if weights and len(weights) == len(values) else [1.0] * len(values)  # an episode's: its own
        scores.append(sum(w * v for w, v in zip(weighed, values) if v is not None))
        extras.append(outcome[2] if outcome[0] == "ok" else {})
        timeouts += outcome[0] == "timeout"
        if outcome[0] == "error":
            errors += 1
            kind, trace = outcome[1:]
            failure = (
                f"the reward function failed for data_source {source!r}, ground_truth {truth!r}, prompt {prompt!r}, "
                f"response {text!r} (the reward: {rewards.name}):\n{trace}"
            )
            first_failure = first_failure or failure
            report_once(kind, f"{failure}The sample scores 0 and counts in reward/errors; fix the reward function.")
    if errors > max_error_share * len(texts):
        raise RewardError(
            f"the reward function failed for {errors} of {len(texts)} samples, more than --max-reward-error-share "
            f"{max_error_share} allows; no update used these scores. The first failure: {first_failure}"
        )
    return scores, {"reward/errors": errors, "reward/timeouts": timeouts, "reward/unscored": nothing}, extras


def extra_means(extras, prefix: str) -> dict[str, float]:
    """`prefix` + key: the mean of each extra key over the responses whose reward returned a finite number for it."""
    values = defaultdict(list)
    for extra in extras:
        for key, value in extra.items():
            if isinstance(value, numbers.Real) and math.isfinite(value):
                values[key].append(float(value))
    return {f"{prefix}{key}": fmean(v) for key, v in values.items()}


EPISODE_COLUMNS = ("turns", "tool_calls", "tool_errors", "ending")
"""what a validation sample of an episode (--env, --tools) says of how it went"""


def validate(generate, val_loader, tokenizer, score_responses, n: int = 1) -> tuple[dict, list[dict]]:
    """Accuracy (mean score) over the validation set, overall and per data source, and every completion, generated by
    `generate(batch, do_sample)` (Run.generate) and scored by `score_responses(texts, batch)` (score_texts's result).

    With n == 1 decoding is greedy; with n > 1 each prompt gets n samples and
    mean@n (the mean score) and pass@n (the share of prompts with a sample
    scoring 1) are reported. Episodes (--env, --tools) are reported as a step's are (`val/env/...`, episode_metrics),
    with the share of them that made a tool call (`val/env/tool_call_share`), and each sample says how its went.
    """
    from common.dataproto import DataProto

    by_source, samples, group_best, all_extras, played = defaultdict(list), [], defaultdict(float), [], []
    reward_metrics = defaultdict(int)
    for batch in val_loader:
        batch = batch.repeat(n, interleave=True)
        batch |= generate(batch, do_sample=n > 1)
        responses = tokenizer.batch_decode(batch["responses"], skip_special_tokens=True)
        scores, metrics, extras = score_responses(response_texts(batch, tokenizer), batch)
        all_extras += extras
        for key, value in metrics.items():
            reward_metrics[key] += value
        if "ending" in batch:
            played.append(DataProto(non_tensors=dict(batch.non_tensors)))
        for i, value in enumerate(scores):
            if "segment" in batch and batch["segment"][i] < batch["segments"][i] - 1:
                continue  # an agent's session counts once: its last segment holds its last completion, and its score
            source, uid = batch["data_source"][i], batch["uid"][i]
            by_source[source].append(value)
            group_best[uid] = max(group_best[uid], value)
            prompt, truth = batch["prompt_text"][i], batch["ground_truth"][i]
            episode = {key: batch[key][i] for key in EPISODE_COLUMNS if key in batch}  # how it went, with --env or --tools
            samples.append({**extras[i], "prompt": prompt, "response": responses[i], "ground_truth": truth, "score": value})
            samples[-1] |= episode
    all_scores = [s["score"] for s in samples]
    metrics = {
        "val/accuracy": fmean(all_scores),
        **{f"val/{k.removeprefix('reward/')}": v for k, v in reward_metrics.items()},
    }
    metrics.update({f"val/accuracy/{source}": fmean(values) for source, values in by_source.items()})
    metrics.update(extra_means(all_extras, "val/reward/"))
    if played:
        metrics |= played_metrics(DataProto.concat(played), "val/env/")
    if n > 1:
        metrics[f"val/mean@{n}"] = metrics["val/accuracy"]
        metrics[f"val/pass@{n}"] = fmean([best >= 1 for best in group_best.values()])
    return metrics, samples


def played_metrics(episodes, prefix: str) -> dict[str, float]:
    """A batch of episodes' figures as a step logs them (common/episodes.py's episode_metrics), and the share of the episodes
    that made at least one tool call, well-formed or not (`tool_call_share`): where it is low, the model answers from its
    head, and the format of the calls has not taken."""
    from common.episodes import episode_metrics

    share = sum(calls > 0 for calls in episodes["tool_calls"]) / len(episodes)
    return episode_metrics(episodes, prefix) | {f"{prefix}tool_call_share": share}
