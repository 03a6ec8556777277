"""Rollout engines apart from the policy (split placement, --rollout-workers), and what they were asked, in order.

The engines (`RolloutWorker`, common/workers.py) run each call in the order it was made, so a queue of those calls on
the driver mirrors theirs: new weights (the policy's rank 0 sends them from a copy, in a thread, see
PolicyWorker.send_weights) and batches to generate. A batch asked after some weights is generated from them, and
tagged with their version. After each weight sync every engine scores a probe that the trainer scored with the same
weights: the log-prob guard for samples that come from older weights than the trainer's (see RolloutSupply.next_rollouts).
"""

from __future__ import annotations

import collections

import numpy as np
import torch

from common.data import collate
from common.dataproto import DataProto
from common.memory import record_peak_memory
from common.rollout import response_batch
from common.rollout_correction import check_probe
from common.worker_group import Pending, ResourcePool, WorkerGroup, wait_all
from common.workers import LOG_PROB_INPUTS
from common.workers import RolloutWorker


class SplitEngines:
    """`count` engines on accelerators of their own, joined to `policy`'s rank 0 by a weight group.

    `probe`: a sequence (a response_batch row) that the trainer and the engines score after every sync;
    `logprob_bound`: the largest mean gap between them (--max-rollout-logprob-diff); `sends_adapter`: the engines
    serve the policy's LoRA adapter, sent alone, rather than receiving every weight; `engine`: how they generate
    (EngineSettings), each from `model_path`'s weights until the policy's first arrive; `whole_plays` (--deterministic):
    new weights wait for the episodes' plays asked before them to end, so that a play's turns share one version and
    a play on the driver's thread (validation's) never shares the engines with one in the player's thread.
    """

    def __init__(
        self,
        policy,
        count: int,
        use_gpu: bool,
        probe: DataProto,
        logprob_bound: float,
        sends_adapter: bool,
        engine,
        model_path: str,
        call_timeout: float,
        whole_plays: bool = False,
    ):
        self.policy, self.probe, self.logprob_bound, self.sends_adapter = policy, probe, logprob_bound, sends_adapter
        self.whole_plays = whole_plays
        self.pool = ResourcePool(count, use_gpu, call_timeout=call_timeout)
        adapter_config = policy.broadcast("adapter_config")[0] if sends_adapter else None
        settings = dict(engine=engine, model_path=model_path, adapter_config=adapter_config)
        self.group = WorkerGroup(RolloutWorker, self.pool, "rollout", call_timeout, **settings)
        self.dtype = self.group.broadcast("weight_dtype")[0]  # what the policy sends the weights in
        address, size = policy.broadcast("master_address")[0], count + 1
        wait_all(policy.submit("join_weight_group", address, size), self.group.submit("join_weight_group", address, size))
        # ("weights", version, the trainer's probe log-probs, call) and
        # ("batch", prompts, the engines' peak memory, call)
        self.in_flight, self.version = collections.deque(), None
        self.player = None  # the thread that plays episodes (ask_episodes)

    def send_weights(self, version: int) -> None:
        """Queue the policy's weights of update `version`, behind what the engines were asked before, unless queued.

        The policy's rank 0 sends one version at a time, once the engines took the one before: waiting for that here
        names an engine that died (WorkerDied) rather than the broken connection the policy would report."""
        if self.whole_plays:
            self.wait_for_plays()
        if version == self.version:
            return
        for kind, *_, call in self.in_flight:  # the weights the engines have not yet been seen to take
            if kind == "weights":
                call.result()
        response = self.probe["response_mask"].bool()
        trainer_probe = self.policy.scatter("probe_log_probs", self.probe.select(*LOG_PROB_INPUTS))["old_log_probs"][response]
        self.policy.submit("send_weights", self.sends_adapter, self.dtype).result()
        tokens = self.probe["input_ids"][self.probe["attention_mask"].bool()].tolist()
        receive = self.group.submit("receive_weights", version, tokens, len(trainer_probe))
        self.in_flight.append(("weights", version, trainer_probe, receive))
        self.version = version

    def ask(self, prompts: DataProto, **generate) -> None:
        """The engines generate `prompts` once done with what they were asked before."""
        call = self.group.submit_scatter("generate", prompts.select("prompts", "prompt_mask"), **generate)
        peaks = self.group.submit("phase_peak_memory")  # of the batch and the weights taken before it
        self.in_flight.append(("batch", prompts, peaks, call))

    def ask_episodes(self, prompts: DataProto, play) -> None:
        """The engines play `prompts`' episodes: `play(prompts)` (run_episodes on this group) runs in a thread of the
        driver while the policy trains, one batch after another, its turns queued on the engines behind what they were
        asked before it began them."""
        if self.player is None:
            from concurrent.futures import ThreadPoolExecutor

            self.player = ThreadPoolExecutor(max_workers=1)
        played = self.player.submit(lambda: (play(prompts), self.group.broadcast("phase_peak_memory")))
        self.in_flight.append(("batch", prompts, Later(played, 1), Later(played, 0)))

    def wait_for_plays(self) -> None:
        """Until every play of episodes asked so far (ask_episodes) has ended."""
        for kind, *_, call in self.in_flight:
            if kind == "batch" and isinstance(call, Later):
                call.future.exception()  # a play that failed raises where its batch is taken

    def batches_asked(self) -> int:
        return sum(entry[0] == "batch" for entry in self.in_flight)

    def take(self, metrics: dict) -> DataProto:
        """The oldest batch asked, with its samples (waiting for them), after checking the probes of the weights queued
        before it. `metrics` gets the probe's gap, the seconds the engines waited before they began the batch, and
        their peak memory."""
        while True:
            kind, *entry, call = self.in_flight.popleft()
            if kind == "weights":
                metrics |= check_probe(*entry, call.result(), self.logprob_bound)
                continue
            prompts, peaks = entry
            batch = prompts | call.result()
            record_peak_memory(metrics, "rollout", peaks.result())
            if "engine_idle_s" in batch:  # a batch of single turns
                idle = metrics.get("timing/rollout_idle", 0.0) + batch["engine_idle_s"].mean().item()  # the engines' mean
                metrics["timing/rollout_idle"] = idle
            return batch

    def settle(self, metrics: dict) -> None:
        """Check the probes of every weight sync so far, once the engines are done with them (nothing else asked), and
        put the engines' peak memory in `metrics`."""
        while self.in_flight:
            _, *entry, call = self.in_flight.popleft()
            metrics |= check_probe(*entry, call.result(), self.logprob_bound)
        record_peak_memory(metrics, "rollout", self.group.broadcast("phase_peak_memory"))

    def finish(self) -> list[tuple]:
        """What the engines were asked and no step has taken, each answer waited for: the batches (prompts, samples,
        weight versions) and the weight syncs whose probes are still to check. A checkpoint keeps it, and a resumed run
        takes it (`resume`) where the stopped one would have; this run goes on taking it from the queue as before."""
        self.in_flight = collections.deque(
            tuple(Answered(part.result()) if isinstance(part, (Pending, Later)) else part for part in entry)
            for entry in self.in_flight
        )
        return list(self.in_flight)

    def resume(self, in_flight: list[tuple]) -> None:
        """Take first what a checkpoint's run had asked and not taken (`finish`), before asking the engines anything."""
        self.in_flight.extend(in_flight)


class Later:
    """Part `index` of what a thread's future returns, read as a Pending is."""

    def __init__(self, future, index: int):
        self.future, self.index = future, index

    def result(self):
        return self.future.result()[self.index]


class Answered:
    """A call already answered (kept in a checkpoint), read as a Pending is."""

    def __init__(self, value):
        self.value = value

    def result(self):
        return self.value


def probe(prompts, eos_token_ids: list[int], pad_token_id: int, max_response_length: int) -> DataProto:
    """The sequence that the trainer and every engine score after each weight sync: the first of `prompts` (rows of
    load_prompts), answered with its own tokens (any tokens do, but an EOS, which would end the answer)."""
    first = collate(prompts[np.array([0])], 0)
    prompt = first["prompts"][first["prompt_mask"].bool()]
    answer = prompt[~torch.isin(prompt, torch.tensor(eos_token_ids))][-max_response_length:]
    log_probs = torch.zeros(1, len(answer))
    return response_batch(
        first["prompts"], first["prompt_mask"], answer[None], log_probs, max_response_length, eos_token_ids, pad_token_id
    )
