"""Rule-based rewards, one per `data_source`, plus a user's own from a file.

A reward function has the signature
`fn(data_source, solution_str, ground_truth, extra_info) -> float | {"score": float, ...}`.
"""

from __future__ import annotations

import atexit
import importlib.util
import math
import mmap
import numbers
import os
import pickle
import re
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
import traceback
from collections import defaultdict, deque
from contextlib import contextmanager
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from statistics import fmean
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from common.dataproto import DataProto

PROJECT_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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


def gsm8k_reward(solution_str: str, ground_truth: str) -> float:
    """1 when the last number written after '####' equals the ground truth."""
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


BUILTIN_REWARDS = {
    "addition": exact_answer_reward,
    "multiplication": exact_answer_reward,
    "times_tables": last_number_reward,
    "gsm8k": gsm8k_reward,
    "openai/gsm8k": gsm8k_reward,
    "math": math_reward,
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
    unknown = sorted(set(data["data_source"]) - BUILTIN_REWARDS.keys())
    if unknown:
        raise ValueError(
            f"no built-in reward for data_source {unknown}; built in: {sorted(BUILTIN_REWARDS)}. "
            "Pass --reward-fn path/to/file.py:function_name"
        )


class RewardTimeout(BaseException):  # not an Exception, so that the reward's own `except Exception` cannot swallow it
    pass


@contextmanager
def time_limit(seconds: float | None):
    """Raise RewardTimeout in this (main) thread after `seconds`.

    A reward stuck in Python code, or sleeping, is interrupted; one stuck inside
    a C call is interrupted only when that call returns to Python.
    """
    if not seconds:
        yield
        return

    def expire(signum, frame):
        raise RewardTimeout

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


class RewardError(RuntimeError):
    pass


def call_reward(reward_fn, data_source, solution_str, ground_truth, extra_info) -> tuple:
    """What one call of a reward function came to: ("ok", score, other keys), or ("error", kind, traceback)."""
    try:
        result = reward_fn(data_source, solution_str, ground_truth, extra_info)
        extras = {k: v for k, v in result.items() if k != "score"} if isinstance(result, dict) else {}
        return "ok", score_value(result), extras
    except (Exception, SystemExit) as error:  # sys.exit() in a reward must not end the run quietly
        return "error", type(error).__name__, traceback.format_exc()


def function_name(function) -> str:
    """`path/to/file.py:name` of a function (or class), as --reward-fn and --env name them."""
    path = getattr(getattr(function, "__code__", None), "co_filename", None) or sys.modules[function.__module__].__file__
    return f"{os.path.relpath(path)}:{function.__qualname__}"


class InProcessRewards:
    """Scores responses one after another in this process, so that breakpoint() in a reward stops in the terminal;
    a call past `timeout` seconds is interrupted (see time_limit). With `call` common.envs.call_env and an
    environment's class as `reward_fn`, it plays environments' turns instead."""

    def __init__(self, reward_fn, timeout: float | None = None, call=call_reward):
        self.reward_fn, self.timeout, self.call = reward_fn, timeout, call
        self.name = "the built-in rewards" if reward_fn is default_reward else function_name(reward_fn)

    def __call__(self, samples: list[tuple]) -> list[tuple]:
        return [self._call(sample) for sample in samples]

    def _call(self, sample: tuple) -> tuple:
        try:
            with time_limit(self.timeout):
                return self.call(self.reward_fn, *sample)
        except RewardTimeout:
            return ("timeout",)

    def close(self) -> None:
        pass


CURRENT_CALL = struct.Struct("qd")  # what a reward process is scoring: the sample's index and when the call started


def write_current_call(current_call: mmap.mmap, index: int, start: float) -> None:
    """Write both fields with one copy. Not struct's pack_into: it zeroes the fields before it fills them, and a
    driver that read the start time in between saw a call that started at time 0, long past its deadline."""
    current_call[: CURRENT_CALL.size] = CURRENT_CALL.pack(index, start)


@dataclass
class RewardProcess:
    process: subprocess.Popen
    connection: Connection
    current_call: mmap.mmap  # CURRENT_CALL, written by the process before each call, read by the driver
    ready: bool = False
    scored: int = 0
    sent: list = field(default_factory=list)  # the samples sent to it that it has not answered yet


class RewardProcesses:
    """`size` processes that each load the reward `spec` (as --reward-fn names it) and score responses one at a time,
    all at once; of `kind` "env", processes that load the environment `spec` (as --env names it) and play its turns
    (common.envs.call_env). Nothing a reward does reaches the run: a call past `timeout` seconds is killed, even inside
    a C call, and a process that dies (a segfault, os._exit) is replaced; either way only that call's sample fails. A process
    is also replaced, between batches, after RECYCLE_AFTER samples, so that a reward that leaks memory stays bounded.

    A process is sent a share of the batch at once and answers with all its scores: a message each way per sample
    would cost more than a rule-based reward takes. It writes which sample it is scoring, and since when, to memory
    the driver shares, so each call still has its own deadline, and a kill or a crash fails that sample alone (the
    others of its share are scored again by the next process).
    """

    RECYCLE_AFTER = 10_000
    SHARES_PER_PROCESS = 4  # per batch: small enough that the processes finish together

    def __init__(self, spec: str | None, size: int, timeout: float | None = None, kind: str = "reward"):
        self.spec, self.timeout, self.kind = spec, timeout or math.inf, kind
        self.name = spec or "the built-in rewards"
        self.processes = [self._start() for _ in range(size)]
        atexit.register(self.close)

    def _start(self) -> RewardProcess:
        ours, theirs = socket.socketpair()
        with tempfile.TemporaryFile() as file:
            file.truncate(CURRENT_CALL.size)
            current_call = mmap.mmap(file.fileno(), CURRENT_CALL.size)
            # Its own session: Ctrl-C in the terminal stops the run between steps, not a reward mid-call, and a kill
            # takes whatever the reward started with it.
            process = subprocess.Popen(
                [sys.executable, "-m", "common.rewards", str(theirs.fileno()), str(file.fileno()), self.spec or "", self.kind],
                pass_fds=[theirs.fileno(), file.fileno()],
                stdin=subprocess.DEVNULL,
                env=os.environ | {"PYTHONPATH": os.pathsep.join([PROJECT_ROOT, os.environ.get("PYTHONPATH", "")])},
                start_new_session=True,
            )
        theirs.close()
        return RewardProcess(process, Connection(ours.detach()), current_call)

    def _replace(self, slot: int, todo: deque) -> int:
        """Kill the process in `slot` and start another; the samples it was sent go back to the front of `todo`,
        except the one it was scoring, whose index is returned."""
        worker = self.processes[slot]
        self._kill(worker)
        current, _ = CURRENT_CALL.unpack_from(worker.current_call)
        todo.extendleft(reversed([i for i in worker.sent if i != current]))
        self.processes[slot] = self._start()
        return current

    @staticmethod
    def _kill(worker: RewardProcess) -> None:
        try:
            os.killpg(worker.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        worker.process.wait()
        worker.connection.close()

    def __call__(self, samples: list[tuple]) -> list[tuple]:
        """For each sample (data_source, solution_str, ground_truth, extra_info) what its call came to: ("ok", score,
        other keys), ("error", kind, traceback) or ("timeout",)."""
        outcomes, todo = [None] * len(samples), deque(range(len(samples)))
        share = max(1, len(samples) // (self.SHARES_PER_PROCESS * len(self.processes)))
        while todo or any(worker.sent for worker in self.processes):
            for slot, worker in enumerate(self.processes):
                if worker.ready and not worker.sent and todo:
                    worker.sent = [todo.popleft() for _ in range(min(share, len(todo)))]
                    write_current_call(worker.current_call, worker.sent[0], time.monotonic())
                    try:
                        worker.connection.send([(i, samples[i]) for i in worker.sent])
                    except OSError:  # it died between batches
                        todo.extendleft(reversed(worker.sent))
                        worker.sent = []
                        self._replace(slot, todo)
            deadline = min(self._deadline(worker) for worker in self.processes)
            waiting = [worker.connection for worker in self.processes if worker.sent or not worker.ready]
            ready = wait(waiting, timeout=None if deadline == math.inf else max(0.0, deadline - time.monotonic()))
            for slot, worker in enumerate(self.processes):
                if worker.connection in ready:
                    self._receive(slot, worker, outcomes, todo)
            for slot, worker in enumerate(self.processes):
                if time.monotonic() >= self._deadline(worker):
                    outcomes[self._replace(slot, todo)] = ("timeout",)
        for slot, worker in enumerate(self.processes):
            if worker.scored >= self.RECYCLE_AFTER:
                self._replace(slot, todo)
        return outcomes

    def _deadline(self, worker: RewardProcess) -> float:
        return CURRENT_CALL.unpack_from(worker.current_call)[1] + self.timeout if worker.sent else math.inf

    def _receive(self, slot: int, worker: RewardProcess, outcomes: list, todo: deque) -> None:
        try:
            message = worker.connection.recv()
        except (EOFError, OSError):
            code = worker.process.wait()
            if not worker.sent:
                raise RewardError(f"a {self.kind} process exited with code {code} while loading {self._flag()} {self.spec}")
            death = (
                f"the {self.kind} process died with exit code {code} during this call (a crash in C code, a "
                "signal, os._exit or the out-of-memory killer); a new process took its place\n"
            )
            outcomes[self._replace(slot, todo)] = ("error", "ProcessDied", death)
            return
        if message == "ready":
            worker.ready = True
        elif isinstance(message, str):
            raise RewardError(f"{self._flag()} {self.spec}: loading it in a {self.kind} process failed:\n{message}")
        else:
            for i, outcome in zip(worker.sent, message):
                outcomes[i] = outcome
            worker.scored += len(worker.sent)
            worker.sent = []

    def _flag(self) -> str:
        return "--reward-fn" if self.kind == "reward" else "--env"

    def close(self) -> None:
        for worker in self.processes:
            self._kill(worker)
        self.processes = []


def serve(fd: int, current_call_fd: int, spec: str, kind: str) -> None:
    """A reward process: load the reward (or the environment), then make the calls of each share of samples that
    arrives on the socket `fd` and answer with their outcomes, until the socket closes."""
    from common.envs import call_env, load_env

    connection, current_call = Connection(fd), mmap.mmap(current_call_fd, CURRENT_CALL.size)
    call = call_reward if kind == "reward" else call_env
    try:
        reward_fn = load_reward_fn(spec or None) if kind == "reward" else load_env(spec)
    except BaseException:
        connection.send(traceback.format_exc())
        return
    connection.send("ready")
    while True:
        try:
            share = connection.recv()
        except EOFError:
            return
        outcomes = []
        for index, sample in share:
            write_current_call(current_call, index, time.monotonic())
            outcomes.append(call(reward_fn, *sample))
        try:
            connection.send(outcomes)
        except Exception:  # keys beside a score that cannot be pickled: that sample fails
            connection.send([sendable(outcome) for outcome in outcomes])


def sendable(outcome: tuple) -> tuple:
    try:
        pickle.dumps(outcome)
        return outcome
    except Exception:
        return "error", "PicklingError", traceback.format_exc()


def score(batch: DataProto, tokenizer, rewards, max_error_share: float = 1.0) -> tuple[torch.Tensor, dict, list[dict]]:
    """One scalar score per response of `batch` (see score_texts)."""
    import torch  # here, not above: the reward processes import this module and need no torch

    scores, metrics, extras = score_texts(response_texts(batch, tokenizer), batch, rewards, max_error_share)
    return torch.tensor(scores, dtype=torch.float32), metrics, extras


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


REPORTED_FAILURES: set[str] = set()  # the kinds of reward failure printed so far in this process


def score_texts(texts: list[str], batch: DataProto, rewards, max_error_share: float = 1.0) -> tuple[list, dict, list[dict]]:
    """One scalar score per decoded response, the error and timeout counts, and per response the other keys a
    reward function returned beside "score" (verl's reward managers return such keys: {"score": 1.0, "exact": 1}).

    `rewards` (RewardProcesses or InProcessRewards) makes the calls. A reward function that raises (or exits, or
    crashes its process), returns anything but a finite number, or runs past the timeout scores 0 for that sample,
    which is counted. The first failure of each kind is printed with its traceback and sample. When more than
    `max_error_share` of the samples fail, RewardError stops the run before any update uses these scores.
    Episodes whose environment gave a score (`episode_score`) keep it and call no reward.
    """
    samples = list(zip(*(batch[k] for k in ("data_source", "ground_truth", "extra_info"))))
    prompts = batch["prompt_text"] if "prompt_text" in batch else [None] * len(texts)
    given = batch["episode_score"] if "episode_score" in batch else [None] * len(texts)
    unscored = [i for i, value in enumerate(given) if value is None]
    outcomes = [("ok", value, {}) for value in given]
    calls = rewards([(samples[i][0], texts[i], *samples[i][1:]) for i in unscored]) if unscored else []
    for i, outcome in zip(unscored, calls):
        outcomes[i] = outcome
    scores, extras, errors, timeouts, first_failure = [], [], 0, 0, None
    for text, prompt, (source, truth, _), outcome in zip(texts, prompts, samples, outcomes):
        scores.append(outcome[1] if outcome[0] == "ok" else 0.0)
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
            if kind not in REPORTED_FAILURES:
                REPORTED_FAILURES.add(kind)
                print(f"{failure}The sample scores 0 and counts in reward/errors; fix the reward function.", file=sys.stderr)
    if errors > max_error_share * len(texts):
        raise RewardError(
            f"the reward function failed for {errors} of {len(texts)} samples, more than --max-reward-error-share "
            f"{max_error_share} allows; no update used these scores. The first failure: {first_failure}"
        )
    return scores, {"reward/errors": errors, "reward/timeouts": timeouts}, extras


def extra_means(extras, prefix: str) -> dict[str, float]:
    """`prefix` + key: the mean of each extra key over the responses whose reward returned a finite number for it."""
    values = defaultdict(list)
    for extra in extras:
        for key, value in extra.items():
            if isinstance(value, numbers.Real) and math.isfinite(value):
                values[key].append(float(value))
    return {f"{prefix}{key}": fmean(v) for key, v in values.items()}


def validate(generate, val_loader, tokenizer, rewards, n: int = 1, max_error_share: float = 1.0) -> tuple[dict, list[dict]]:
    """Accuracy (mean score) over the validation set, overall and per data source, and every completion, generated by
    `generate(batch, do_sample)` (Run.generate).

    With n == 1 decoding is greedy; with n > 1 each prompt gets n samples and
    mean@n (the mean score) and pass@n (the share of prompts with a sample
    scoring 1) are reported.
    """
    by_source, samples, group_best, all_extras = defaultdict(list), [], defaultdict(float), []
    reward_metrics = defaultdict(int)
    for batch in val_loader:
        batch = batch.repeat(n, interleave=True)
        batch |= generate(batch, do_sample=n > 1)
        responses = tokenizer.batch_decode(batch["responses"], skip_special_tokens=True)
        scores, metrics, extras = score_texts(response_texts(batch, tokenizer), batch, rewards, max_error_share)
        all_extras += extras
        for key, value in metrics.items():
            reward_metrics[key] += value
        for i, value in enumerate(scores):
            source, uid = batch["data_source"][i], batch["uid"][i]
            by_source[source].append(value)
            group_best[uid] = max(group_best[uid], value)
            prompt, truth = batch["prompt_text"][i], batch["ground_truth"][i]
            samples.append({**extras[i], "prompt": prompt, "response": responses[i], "ground_truth": truth, "score": value})
    all_scores = [s["score"] for s in samples]
    metrics = {
        "val/accuracy": fmean(all_scores),
        **{f"val/{k.removeprefix('reward/')}": v for k, v in reward_metrics.items()},
    }
    metrics.update({f"val/accuracy/{source}": fmean(values) for source, values in by_source.items()})
    metrics.update(extra_means(all_extras, "val/reward/"))
    if n > 1:
        metrics[f"val/mean@{n}"] = metrics["val/accuracy"]
        metrics[f"val/pass@{n}"] = fmean([best >= 1 for best in group_best.values()])
    return metrics, samples


if __name__ == "__main__":
    serve(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])
