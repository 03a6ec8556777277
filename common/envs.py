"""Multi-turn episodes: the model takes a turn, an environment (a tool, a game) answers, and so on until it ends.

An environment is a plain Python class, named like a reward (`--env path/to/file.py:ClassName`), or built in
(`--env calculator`). One object plays one episode:

    class Echo:
        stop_strings = ["</call>"]   # optional: text that ends a model turn, besides EOS

        def reset(self, data_source, ground_truth, extra_info):   # a new episode, for one row of the data
            self.truth = ground_truth

        def step(self, text):        # the model's turn, decoded
            # a string: the environment's answer, and the episode goes on;
            # a number: the episode's score, and it ends;
            # None: it ends, and the reward function scores this last turn
            ...

Its steps run in isolated processes as rewards do (common/isolation.py), one call at a time, and the object
travels between them from one turn to the next (pickled): it must hold only state that pickles.

What the model generated is kept as the engine's token ids and never encoded again: only the environment's answers
are encoded, framed by the chat template as a "tool" message when the tokenizer has one (see AnswerFraming).
"""

from __future__ import annotations

import hashlib
import importlib.util
import math
import os
import pickle
import re
import sys
import traceback
from dataclasses import dataclass, field

from common.isolation import REPORTED_FAILURES, CallKind

# How an episode ended, logged as the share of each under env/ended_<how>.
ENDINGS = ("by_env", "max_turns", "token_limit", "error", "timeout")


class Calculator:
    """The built-in tool: the model writes an expression in square brackets, `[37*48]`, and gets its value back,
    ended by a semicolon (`1776;`: the demo's tokenizer drops whitespace). A turn without a call is the model's
    answer: the episode ends and the reward function scores it."""

    stop_strings = ["]"]

    def reset(self, data_source, ground_truth, extra_info):
        pass

    def step(self, text: str) -> str | None:
        call = re.search(r"\[([^\]]*)\]\s*$", text)
        if call is None:
            return None
        expression = call.group(1)
        if not re.fullmatch(r"[0-9+\-* ()]{1,32}", expression) or "**" in expression:  # no powers: 9**9**9 never ends
            return "error;"  # a tool answers a malformed call; it does not fail the episode
        try:
            return f"{eval(expression, {'__builtins__': {}})};"
        except SyntaxError:
            return "error;"


BUILTIN_ENVS = {"calculator": Calculator}


def load_env(spec: str):
    """A built-in environment by name, or the class `ClassName` of `path/to/file.py:ClassName`."""
    if spec in BUILTIN_ENVS:
        return BUILTIN_ENVS[spec]
    path, _, name = spec.rpartition(":")
    if not path or not name:
        raise ValueError(f"--env '{spec}': name a built-in ({', '.join(BUILTIN_ENVS)}) or write path/to/file.py:ClassName")
    if not os.path.isfile(path):
        raise ValueError(f"--env '{spec}': no file {path}")
    # Under a name every process derives alike, so that an episode's object pickled in one unpickles in another;
    # loaded once per process, so that the class an object was made from stays the one pickle finds.
    module_name = "user_env_" + hashlib.sha1(os.path.abspath(path).encode()).hexdigest()[:16]
    if module_name not in sys.modules:
        module_spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[module_name] = module
        try:
            module_spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[module_name]
            raise
    module = sys.modules[module_name]
    env_cls = getattr(module, name, None)
    if not isinstance(env_cls, type) or not callable(getattr(env_cls, "step", None)):
        raise ValueError(f"--env '{spec}': {path} defines no class '{name}' with a step(text) method")
    stop_strings = getattr(env_cls, "stop_strings", [])
    if not isinstance(stop_strings, (list, tuple)) or not all(isinstance(s, str) and s for s in stop_strings):
        raise ValueError(f"--env '{spec}': stop_strings must be a list of non-empty strings, got {stop_strings!r}")
    return env_cls


ENV_CALLS = CallKind("env", "--env", load="common.envs:load_env", call="common.envs:call_env")


def call_env(env_cls, state: bytes | None, row: tuple, text: str) -> tuple:
    """One turn of an episode: ("ok", (the environment's state after it, its reply)) or ("error", kind, traceback).
    The state is the environment object, pickled; None before the first turn, when a new one is made and reset from
    `row` (data_source, ground_truth, extra_info)."""
    try:
        if state is None:
            env = env_cls()
            if callable(getattr(env, "reset", None)):
                env.reset(*row)
        else:
            env = pickle.loads(state)
        reply = env.step(text)
        if not (reply is None or isinstance(reply, str)):
            reply = float(reply)  # anything but a string, a number or None fails here, as the environment's error
            if not math.isfinite(reply):
                raise ValueError(f"step returned the score {reply}; a score must be a finite number")
        return "ok", (pickle.dumps(env), reply)
    except (Exception, SystemExit) as error:
        return "error", type(error).__name__, traceback.format_exc()


class AnswerFraming:
    """The tokens that append an environment's answer to a conversation, as the chat template renders it.

    Without a chat template the answer's text alone. With one, what the template puts after an assistant message
    when a tool message follows it: the end of the assistant's message (less the EOS the model generated itself, if
    its turn ended with one), the tool message, and the start of the next assistant message.
    """

    MARK = "\x00hybridrl turn\x00"

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.eos_texts = [t for t in {tokenizer.eos_token} if t]

    def __call__(self, answer: str, ended_with_eos: bool) -> list[int]:
        text = answer
        if self.tokenizer.chat_template:
            messages = [
                {"role": "user", "content": "?"},
                {"role": "assistant", "content": self.MARK},
                {"role": "tool", "content": answer},
            ]
            rendered = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            text = rendered[rendered.index(self.MARK) + len(self.MARK) :]
            if ended_with_eos:
                eos = next((e for e in self.eos_texts if text.startswith(e)), "")
                text = text[len(eos) :]
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]


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


@dataclass
class Episode:
    prompt: list[int]
    row: tuple  # data_source, ground_truth, extra_info
    tokens: list[int] = field(default_factory=list)
    own: list[bool] = field(default_factory=list)  # which tokens the model generated
    log_probs: list[float] = field(default_factory=list)
    env: bytes | None = None  # the environment object, pickled (see call_env)
    turns: int = 0
    last_turn: str = ""
    ending: str | None = None
    score: float | None = None


def run_episodes(policy, batch, env_calls, stop_strings, tokenizer, eos_token_ids, max_turns, max_response_length, sampling):
    """Play one episode per row of `batch`: the model's turns generated by `policy` (either engine, `sampling` as its
    generate takes it), the environment's steps made by `env_calls` (CallProcesses or InProcessCalls of ENV_CALLS).
    Returns what one turn's generate returns, with `response_mask` over the model's own tokens alone and
    `max_response_length` tokens for the whole episode; and per row `final_turn` (the text a reward scores),
    `episode_score` (the environment's score, or None), `turns` and `ending` (one of ENDINGS)."""
    import torch

    from common.data import collate
    from common.dataproto import DataProto

    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos_token_ids[0]
    frame = AnswerFraming(tokenizer)
    rows = zip(batch["data_source"], batch["ground_truth"], batch["extra_info"])
    episodes = [Episode(p[m.bool()].tolist(), row) for p, m, row in zip(batch["prompts"], batch["prompt_mask"], rows)]
    failures = {}
    for turn in range(max_turns):
        active = [e for e in episodes if e.ending is None]
        if not active:
            break
        contexts = collate(DataProto.from_dict(non_tensors={"prompt_ids": [e.prompt + e.tokens for e in active]}), pad)
        budget = max(max_response_length - len(e.tokens) for e in active)
        out = policy.scatter(
            "generate",
            contexts.select("prompts", "prompt_mask"),
            **sampling,
            max_response_length=budget,
            stop_strings=stop_strings,
        )
        lengths = out["response_mask"].sum(-1).long().tolist()  # up to the first EOS
        for episode, tokens, log_probs, length in zip(active, out["responses"], out["rollout_log_probs"], lengths):
            tokens, room = tokens[:length].tolist(), max_response_length - len(episode.tokens)
            end = stop_end(tokens, stop_strings, tokenizer)
            if end is None and tokens and tokens[-1] in eos_token_ids:
                end = len(tokens)
            kept = min(len(tokens), room) if end is None or end > room else end
            episode.tokens += tokens[:kept]
            episode.own += [True] * kept
            episode.log_probs += log_probs[:kept].tolist()
            episode.turns += 1
            episode.last_turn = tokenizer.decode(tokens[:kept], skip_special_tokens=True)
            if end is None or end > room:  # the model was still writing when the episode's tokens ran out
                episode.ending = "token_limit"
        stepping = [e for e in active if e.ending is None]
        for episode, outcome in zip(stepping, env_calls([(e.env, e.row, e.last_turn) for e in stepping])):
            if outcome[0] != "ok":
                episode.ending, episode.score = outcome[0], 0.0
                if outcome[0] == "error":
                    failures.setdefault(outcome[1], (episode, outcome[2]))
                continue
            episode.env, reply = outcome[1]
            if not isinstance(reply, str):
                episode.ending, episode.score = "by_env", reply
            elif turn + 1 == max_turns:
                episode.ending = "max_turns"
            else:
                answer = frame(reply, ended_with_eos=episode.tokens[-1] in eos_token_ids)
                if len(episode.tokens) + len(answer) >= max_response_length:  # no room left to act on it
                    episode.ending = "token_limit"
                    continue
                episode.tokens += answer
                episode.own += [False] * len(answer)
                episode.log_probs += [0.0] * len(answer)
    for kind, (episode, trace) in failures.items():
        if f"env {kind}" in REPORTED_FAILURES:  # once per kind and run, as the reward's failures
            continue
        REPORTED_FAILURES.add(f"env {kind}")
        print(
            f"the environment failed ({kind}) after the turn {episode.last_turn!r} of an episode for {episode.row}:\n"
            f"{trace}The episode ends with score 0 and counts in env/ended_error; fix the environment.",
            file=sys.stderr,
        )
    responses = torch.full((len(episodes), max_response_length), pad, dtype=torch.long)
    own = torch.zeros(len(episodes), max_response_length)
    log_probs = torch.zeros(len(episodes), max_response_length)
    for i, episode in enumerate(episodes):
        responses[i, : len(episode.tokens)] = torch.tensor(episode.tokens, dtype=torch.long)
        own[i, : len(episode.own)] = torch.tensor(episode.own, dtype=torch.float)
        log_probs[i, : len(episode.log_probs)] = torch.tensor(episode.log_probs)
    # every token of the episode attends and is read; the model's own are the ones the losses count
    real = (torch.arange(max_response_length) < torch.tensor([len(e.tokens) for e in episodes])[:, None]).long()
    attention_mask = torch.cat([batch["prompt_mask"], real], dim=-1)
    return DataProto.from_dict(
        {
            "responses": responses,
            "response_mask": own,
            "rollout_log_probs": log_probs * own,
            "input_ids": torch.cat([batch["prompts"], responses], dim=-1),
            "attention_mask": attention_mask,
            "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0),
        },
        {
            "final_turn": [e.last_turn for e in episodes],
            "episode_score": [e.score for e in episodes],
            "turns": [e.turns for e in episodes],
            "ending": [e.ending for e in episodes],
        },
    )


def episode_metrics(batch, prefix: str) -> dict[str, float]:
    """Model turns per episode on average, and the share of episodes that ended each way (ENDINGS)."""
    endings = list(batch["ending"])
    metrics = {f"{prefix}turns_mean": sum(batch["turns"]) / len(endings)}
    return metrics | {f"{prefix}ended_{how}": endings.count(how) / len(endings) for how in ENDINGS}
