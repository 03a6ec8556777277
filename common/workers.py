"""The worker kinds, each a rank of a worker group (common/worker_group.py): the policy (the hybrid engine: the
FSDP2-sharded policy that trains, a rollout engine that generates from it and, with LoRA, the reference), the judge, the
critic, the reward model, and the rollout worker (an engine in a process of its own, --rollout-workers). What an engine
is and how one is built is common/engines.py; the FSDP2 base the models share is common/fsdp_worker.py. No worker
knows an algorithm: losses arrive from the script as plain functions."""

from __future__ import annotations

import dataclasses
import functools
import os
import queue
import random
import shutil
import time
from contextlib import contextmanager, nullcontext

import numpy as np
import torch

from common import weight_sync
from common.data import pad_token_id
from common.dataproto import DataProto
from common.engine_registry import make_engine
from common.engines import EngineContext, EngineSettings, eos_token_ids
from common.fsdp_worker import FSDPWorker, lora_model
from common.layouts import response_outputs, rows_of
from common.log_probs import chunked_log_probs, head_outputs_pass_through, response_log_probs
from common.memory import measured
from common.rollout import response_batch
from common.worker_group import Worker

LOG_PROB_INPUTS = ("input_ids", "attention_mask", "position_ids", "responses")
"""what the log-prob passes (compute_log_prob, compute_ref_log_prob, the critic's compute_values) read of a batch"""


class EngineWorker(Worker):
    """A worker with a rollout engine in its process (`self.engine`, common/engines.py) that generates from it: a batch
    of prompts at once (`generate`), or episodes' turns one by one as they come (`open_turns`, `turns`, `close_turns`).
    """

    version = None
    """the weights' version the engine generates from, where the worker keeps one (a rollout worker)"""
    engine_seconds = 0.0
    """seconds the engine spent generating so far"""
    plays = 0
    """the episodes' plays under way on this engine (each between its open_turns and close_turns)"""

    def build_engine(self, settings: EngineSettings, master, model_path: str, policy=None, optimizer=None, **context):
        """The engine `settings` names in this process (self.engine), from `policy` (None: from `model_path`'s weights,
        then from those sent it), its placement this rank in the worker's group, whose rendezvous is `master`; the
        tokens that end a response and the pad token are the model's. `context`: EngineContext's frozen and
        adapter_config."""
        if getattr(self, "tokenizer", None) is None:
            self.load_tokenizer(model_path)
        placement = dict(rank=self.rank, world_size=self.world_size, master=master, on_gpu=self.device.type == "cuda")
        self.engine_settings = settings
        tokens = (self.tokenizer, self.eos_token_ids, self.pad_token_id)
        context = EngineContext(settings, policy, optimizer, *tokens, model_path, self.device, placement, **context)
        self.engine = make_engine(context)

    def load_tokenizer(self, model_path: str, chat_template: str | None = None) -> None:
        """The model's tokenizer (with `chat_template` in place of its own), the tokens that end a response and the
        pad token."""
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.tokenizer.chat_template = chat_template or self.tokenizer.chat_template
        self.eos_token_ids = eos_token_ids(model_path, self.tokenizer)
        self.pad_token_id = pad_token_id(self.tokenizer, self.eos_token_ids)

    @measured
    @torch.no_grad()
    def generate(self, data: DataProto, max_response_length: int, **sampling) -> DataProto:
        """Sample (or with do_sample False decode greedily) one response per left-padded prompt, each ending at EOS, at
        the token that completes one of `stop_strings` (padded after it) or after `max_response_length` tokens, as the
        engine's settings sample (EngineSettings.sampling); see rollout.response_batch for what returns."""
        prompts, prompt_mask = data["prompts"].to(self.device), data["prompt_mask"].to(self.device)
        with self.generating():
            self.engine.wake()
            try:
                responses, log_probs = self.engine.generate(
                    prompts, prompt_mask, max_response_length, **self.engine_settings.sampling(**sampling)
                )
            finally:
                self.engine.sleep()
        return response_batch(
            prompts, prompt_mask, responses, log_probs, max_response_length, self.eos_token_ids, self.pad_token_id
        )

    @contextmanager
    def generating(self):
        """The engine at work: its seconds counted in engine_seconds."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.engine_seconds += time.perf_counter() - start

    def open_turns(self) -> dict:
        """Take episodes' turns one by one (`turns`) until close_turns, from the policy as it is now. Plays may overlap
        (validation's episodes beside training's on engines apart): the engine opens for the first, closes after the
        last. Returns the engine's work so far (engine_work)."""
        if not callable(getattr(self.engine, "add_request", None)):
            raise TypeError(
                f"the rollout engine {type(self.engine).__name__} takes no requests one by one (add_request, "
                "finished_requests, forget), which episodes need (--env, --tools): see "
                "docs/rollout-engines.md, Adding an engine"
            )
        if self.plays == 0:
            self.engine.wake()
            self.under_way, self.ended = {}, []
        self.plays += 1
        return self.engine_work()

    @torch.no_grad()
    def turns(self, play: str, requests: list, **sampling) -> list[tuple[str, list[int], list[float], int | None, int]]:
        """Start `requests` (an episode's key, prefixed by its `play`'s; the tokens of its context; the most tokens to
        generate; the turn's seed) beside the turns under way, and return the turns of `play` that ended since the last
        call, after the engine's next steps if none had: each one's key, tokens (to its EOS or stop string), their
        log-probs, the weights' version they were generated from and the tokens of its context the engine computed (its
        cache had not kept them). `sampling`: what the turns' sampling changes of the engine's settings
        (EngineSettings.sampling)."""
        prefix, sampling = f"{play}/", self.engine_settings.sampling(**sampling)
        with self.generating():
            for key, tokens, max_tokens, seed in requests:
                self.engine.add_request(key, tokens, max_tokens, seed=seed, **sampling)
                self.under_way[key] = self.version
            if any(key.startswith(prefix) for key in self.under_way) and not any(t[0].startswith(prefix) for t in self.ended):
                self._step()
        ended = [turn for turn in self.ended if turn[0].startswith(prefix)]
        self.ended = [turn for turn in self.ended if not turn[0].startswith(prefix)]
        return ended

    def _step(self) -> None:
        """The engine's next steps, until a turn ends (or a short while passed: more may be waiting to start)."""
        for key, tokens, log_probs, computed in self.engine.finished_requests():
            self.ended.append((key, tokens, log_probs, self.under_way.pop(key), computed))

    def finish_turns(self) -> None:
        """End every turn under way (kept for the `turns` call that asks for them): before the weights change, so that
        a turn is generated from one version."""
        with self.generating():
            while self.plays and self.under_way:
                self._step()

    def close_turns(self, play: str) -> None:
        """The end of a play (open_turns): the engine forgets its episodes, and after the last play it sleeps."""
        self.plays -= 1
        self.engine.forget(f"{play}/")
        if self.plays == 0:
            self.engine.sleep()

    def engine_work(self) -> dict:
        """The seconds the engine spent generating and the context tokens it computed (prefilled: not taken from a
        cache), so far: a stretch's work is the difference of two reads."""
        return dict(seconds=self.engine_seconds, prefilled_tokens=getattr(self.engine, "prefilled_tokens", 0))


class PolicyWorker(FSDPWorker, EngineWorker):
    """The hybrid engine: trainable policy, rollout engine and reference in one process."""

    sequence_parallel_methods = (*FSDPWorker.sequence_parallel_methods, "probe_log_probs")

    trains = True  # else its rollout engine keeps the weights it loaded, never sent the model's
    weight_bucket_bytes = weight_sync.BUCKET_BYTES

    def _add_lora(self, model):
        return lora_model(model, *self.lora_settings, "CAUSAL_LM")

    def setup(
        self,
        master,
        model_path: str,
        engine: EngineSettings | None = EngineSettings(),
        generates: bool = True,
        use_reference: bool = True,
        log_prob_chunk_tokens: int = 0,
        chat_template: str | None = None,
        **settings,
    ) -> None:
        """The policy (see FSDPWorker.setup), the rollout engine `engine` names, which generates from it (none where it
        `generates` not, rollout workers of their own doing it, or `engine` is None), and the reference.
        `chat_template`: the run's (--chat-template), which the exported model's tokenizer keeps.

        Log-probs are those of the logits divided by the engine's temperature (1 without an engine), the distribution
        rollouts sample from, computed over the vocabulary `log_prob_chunk_tokens` response tokens at a time (see
        chunked_log_probs; 0: all at once).
        """
        super().setup(master, model_path, **settings)
        self.temperature = engine.temperature if engine is not None else 1.0
        self.log_prob_chunk_tokens = log_prob_chunk_tokens if head_outputs_pass_through(self.model, self.device) else None
        if self.rank == 0 and self.log_prob_chunk_tokens is None:
            print(f"{type(self).__name__}: log-probs from whole logits (this model changes its output layer's output)")
        self.load_tokenizer(model_path, chat_template)
        # The reference: with LoRA it is this same model with the adapter off.
        self.reference = None
        if use_reference and not self.lora:
            self.reference = self._shard(self._load(model_path).requires_grad_(False).eval(), offload=True)
        # FSDP2 initialises lazily on the root's first forward; generate needs that done.
        with torch.no_grad():
            self.model(input_ids=torch.zeros(1, 1, dtype=torch.long, device=self.device))
        self.engine = None
        if engine is not None and generates:
            self.build_engine(engine, master, model_path, self.model, self.optimizer, frozen=not self.trains)

    def _forward(self, model, micro: DataProto, with_entropy: bool):
        """Log-probs (and entropies) of the response tokens, 0 on padding."""
        response_mask = micro["attention_mask"][:, -micro["responses"].shape[1] :].bool()
        responses = micro["responses"][response_mask]
        if self.log_prob_chunk_tokens is None:
            logits = response_outputs(model, micro, self.layout, True, None, self.sequence_group, self.flex_from)
            log_probs, entropy = response_log_probs(logits, responses, self.temperature, with_entropy)
        else:
            chunked = functools.partial(
                chunked_log_probs,
                responses=responses,
                temperature=self.temperature,
                with_entropy=with_entropy,
                chunk_tokens=self.log_prob_chunk_tokens,
            )
            outputs = response_outputs(model, micro, self.layout, True, chunked, self.sequence_group, self.flex_from)
            log_probs, entropy = outputs[:, 0], outputs[:, -1]
        return rows_of(log_probs, response_mask), rows_of(entropy, response_mask) if with_entropy else None

    @torch.no_grad()
    def _log_probs(self, data: DataProto, model, with_entropy: bool):
        model.eval()
        return self._in_micro_batches(data, lambda micro: self._forward(model, micro, with_entropy))

    @measured
    def compute_log_prob(self, data: DataProto) -> DataProto:
        """Per-token log-probs and entropies of the responses under the current policy."""
        log_probs, entropy = self._log_probs(data, self.model, with_entropy=True)
        return DataProto.from_dict({"old_log_probs": log_probs, "entropy": entropy})

    @measured
    def compute_ref_log_prob(self, data: DataProto) -> DataProto:
        """Per-token log-probs under the reference: the base model (LoRA off) or the frozen copy."""
        reference = self.model if self.lora else self.reference
        with self.model.disable_adapter() if self.lora else nullcontext():
            log_probs, _ = self._log_probs(data, reference, with_entropy=False)
            # FSDP keeps the root's weights gathered after a forward; dropping them keeps the offloaded copy's off the
            # device, and PEFT, as it leaves, turns the adapter's gradients back on on the sharded parameters.
            reference.reshard()
        return DataProto.from_dict({"ref_log_probs": log_probs})

    def export(self, path: str, adapter_only: bool = False) -> None:
        """Write the policy as an ordinary HF model folder with its tokenizer (a collective: call every rank).

        With LoRA the adapter is merged into the base weights, or saved alone with `adapter_only`.
        """
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        self.model.reshard()
        state = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if self.rank != 0:
            return
        model = self._from_pretrained(self.model_path, dtype=torch.float32)
        dtype = model.config.dtype or torch.float32
        if self.lora:
            model = self._add_lora(model)
            # The base never trained: the file's own weights, not the copy replicated in the compute dtype.
            state = model.state_dict() | {name: state[name] for name, p in self.model.named_parameters() if p.requires_grad}
        model.load_state_dict(state)
        if self.lora and not adapter_only:
            model = model.merge_and_unload()
        scratch = f"{path}.partial"
        shutil.rmtree(scratch, ignore_errors=True)
        model.to(dtype).save_pretrained(scratch)
        self.tokenizer.save_pretrained(scratch)
        shutil.rmtree(path, ignore_errors=True)
        os.rename(scratch, path)

    @measured
    def update(self, data: DataProto, loss_fn) -> dict:
        """PPO-style update with the script's `loss_fn(micro_batch, (log_prob, entropy), ...)`."""
        return self._update(data, loss_fn, self._update_forward)

    def _update_forward(self, micro: DataProto):
        return self._forward(self.model, micro, with_entropy=True)

    def adapter_config(self):
        """The LoRA adapter's PEFT config, for a rollout worker that will serve it."""
        return self.model.peft_config[weight_sync.ADAPTER]

    def join_weight_group(self, address: tuple[str, int], size: int) -> None:
        """Rank 0 joins the rollout workers' weight group (see weight_sync.join_group); the others only gather."""
        from concurrent.futures import ThreadPoolExecutor

        if self.rank == 0:
            self.weight_group = weight_sync.join_group(address, 0, size, self.device, self.collective_timeout)
            self.sender, self.sending = ThreadPoolExecutor(max_workers=1), None

    @measured
    def send_weights(self, adapter: bool, dtype: str | None = None) -> None:
        """The policy as it is now, to every rollout worker: its LoRA adapter alone, or every weight (an adapter
        merged in) in `dtype`, the one the engines keep (None: the compute dtype), cast before it travels. A
        collective: every rank gathers, one FSDP unit at a time. Rank 0 packs what it gathers into buckets in CPU
        memory, which a thread sends (weight_sync.send_buckets) as each fills, to engines that join when they are done
        with what they are generating: the policy trains meanwhile. One version at a time: the next waits until the
        engines took this one."""
        if self.rank == 0 and self.sending is not None:
            self.sending.result()  # raises what went wrong in the thread
        if adapter:
            tensors = weight_sync.engine_adapter(self.model)
            if self.rank == 0:
                copy = [(name, tensor.to("cpu", copy=True)) for name, tensor in tensors.items()]
                send = weight_sync.send_tensors
                self.sending = self.sender.submit(send, self.weight_group, copy, self.device, self.weight_bucket_bytes)
            return
        dtype = getattr(torch, dtype) if dtype else self.compute_dtype
        weights = weight_sync.engine_weights(self.model, dtype)
        if self.rank != 0:
            for _ in weights:  # the gathers of every unit
                pass
            return
        layout = weight_sync.engine_layout(self.model, dtype)
        filled = queue.SimpleQueue()

        def buckets():
            while (bucket := filled.get()) is not None:
                yield bucket

        send = weight_sync.send_buckets
        self.sending = self.sender.submit(send, self.weight_group, layout, buckets(), self.device, self.weight_bucket_bytes)
        try:
            for bucket in weight_sync.packed_buckets(layout, weights, torch.device("cpu"), self.weight_bucket_bytes):
                filled.put(bucket)
        finally:
            filled.put(None)

    @torch.no_grad()
    def probe_log_probs(self, data: DataProto) -> DataProto:
        """compute_log_prob at temperature 1, as a vLLM engine scores a given sequence (see SplitEngines.send_weights)."""
        temperature, self.temperature = self.temperature, 1.0
        try:
            return self.compute_log_prob(data)
        finally:
            self.temperature = temperature


class JudgeWorker(PolicyWorker):
    """An LLM judge (common/judge.py): a language model sharded like the policy, with a rollout engine of its own
    (`generate`, for verdicts it writes out), that never trains and has no reference."""

    trains = False

    def setup(self, master, model_path: str, **settings) -> None:
        super().setup(master, model_path, use_reference=False, **settings)

    @measured
    @torch.no_grad()
    def verdict_log_probs(self, data: DataProto, yes_ids: list[int], no_ids: list[int]) -> DataProto:
        """For each question of `data` (with a one-token response, whose own token is not read): the log-probs of
        the next token being a Yes and a No (each summed over its ids) as `verdict_log_probs` [rows, 2], and the most
        likely next token as `top_tokens`."""
        self.model.eval()

        def forward(micro: DataProto):
            outputs = response_outputs(self.model, micro, self.layout, True, flex_from=self.flex_from)
            log_probs = torch.log_softmax(outputs.float(), -1)
            verdicts = [log_probs[:, yes_ids].logsumexp(-1), log_probs[:, no_ids].logsumexp(-1)]
            return torch.stack(verdicts, -1), log_probs.argmax(-1)

        verdicts, top_tokens = self._in_micro_batches(data, forward)
        return DataProto.from_dict({"verdict_log_probs": verdicts, "top_tokens": top_tokens})


class CriticWorker(FSDPWorker):
    """A value model: the policy's architecture with a scalar head over every token (see FSDPWorker.setup)."""

    language_model = False

    auto_model = "AutoModelForTokenClassification"
    model_kwargs = {"num_labels": 1}

    def _add_lora(self, model):
        # The value head is new: it trains in full beside the adapter.
        return lora_model(model, *self.lora_settings, "TOKEN_CLS", modules_to_save=["score"])

    def _forward(self, micro: DataProto) -> torch.Tensor:
        """The value of the state before each response token, 0 on padding."""
        response_mask = micro["attention_mask"][:, -micro["responses"].shape[1] :].bool()
        values = response_outputs(self.model, micro, self.layout, False, None, self.sequence_group, self.flex_from)[:, 0]
        return rows_of(values.float(), response_mask)

    @measured
    @torch.no_grad()
    def compute_values(self, data: DataProto) -> DataProto:
        self.model.eval()
        [values] = self._in_micro_batches(data, lambda micro: (self._forward(micro),))
        return DataProto.from_dict({"values": values})

    @measured
    def update(self, data: DataProto, loss_fn) -> dict:
        """Regress values with the script's `loss_fn(micro_batch, values, ...)`."""
        return self._update(data, loss_fn, self._update_forward)

    def _update_forward(self, micro: DataProto) -> torch.Tensor:
        return self._forward(micro)


class RewardModelWorker(FSDPWorker):
    """A reward model: a sequence-classification model with one label, sharded like the policy, that scores and never
    trains (see FSDPWorker.setup). Its score of a sequence is its head's output at the sequence's last token."""

    language_model = False
    packs = False  # it reads each sequence's last token from the padded rectangle

    auto_model = "AutoModelForSequenceClassification"

    def _checked(self, model, model_path: str):
        if model.config.num_labels != 1 or not isinstance(getattr(model, "score", None), torch.nn.Linear):
            raise ValueError(
                f"--reward-model {model_path}: a reward model is a ...ForSequenceClassification with one label and a "
                f"`score` head (as Llama, Qwen, Mistral and Gemma ones are); this one has {model.config.num_labels} "
                f"labels and {type(getattr(model, 'score', None)).__name__} as `score`"
            )
        return model

    @measured
    @torch.no_grad()
    def compute_rm_score(self, data: DataProto) -> DataProto:
        """`rm_scores`: one per right-padded sequence of `data` (`input_ids`, `attention_mask`, `position_ids`)."""
        self.model.eval()
        head_outputs = []
        # transformers pools at the last token that is not the pad token, which is the wrong one when the pad token is
        # also the end-of-turn token: read the head at every position and take the last real one here.
        handle = self.model.score.register_forward_hook(lambda module, args, output: head_outputs.append(output))

        def forward(micro: DataProto):
            head_outputs.clear()
            self.model(**{key: micro[key] for key in ("input_ids", "attention_mask", "position_ids")}, use_cache=False)
            last = micro["attention_mask"].sum(-1, keepdim=True) - 1
            return (head_outputs[0][..., 0].float().gather(1, last)[:, 0],)

        try:
            [scores] = self._in_micro_batches(data, forward)
        finally:
            handle.remove()
        return DataProto.from_dict({"rm_scores": scores})


class RolloutWorker(EngineWorker):
    """A rollout engine in a process of its own (split placement, --rollout-workers): it generates from the weights the
    policy last sent it (see PolicyWorker.send_weights) and tags every sample with their version, the number of
    updates they had had. The engines of a group form a torch.distributed group of their own, which vLLM's external
    launcher joins as the policy's engines join the policy's."""

    def __init__(self, rank: int, world_size: int, use_gpu: bool):
        super().__init__(rank, world_size, use_gpu)
        self.version, self.idle, self.idle_since = 0, 0.0, time.perf_counter()

    def setup(self, master, model_path: str, engine: EngineSettings = EngineSettings(), adapter_config=None) -> None:
        """The engine `engine` names, from `model_path`'s weights (vLLM in its dtype, transformers' generate in the compute
        dtype). `adapter_config`: the LoRA adapter it will be sent, which it then serves (with vLLM); without it, it
        receives every weight."""
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.join_process_group(master)
        torch.manual_seed(engine.seed + self.rank)
        self.adapter_config = adapter_config
        engine = dataclasses.replace(engine, lora_sync="adapter" if adapter_config is not None else "merged")
        self.build_engine(engine, master, model_path, adapter_config=adapter_config)

    def weight_dtype(self) -> str:
        """The dtype the engine keeps its weights in, which the policy sends them in."""
        return str(self.engine.dtype).removeprefix("torch.")

    def join_weight_group(self, address: tuple[str, int], size: int) -> None:
        """Join the policy's rank 0 in the weight group, as rank 1 and up (see weight_sync.join_group)."""
        self.weight_group = weight_sync.join_group(address, self.rank + 1, size, self.device, self.collective_timeout)

    @measured
    @torch.no_grad()
    def receive_weights(self, version: int, probe: list[int], answer_length: int) -> torch.Tensor:
        """Load what the policy's rank 0 sends (PolicyWorker.send_weights): from now on the engine generates from
        version `version`. Every weight the engine has must arrive, or it would generate from stale ones. Returns the
        log-probs at temperature 1 of the last `answer_length` tokens of `probe`, each after those before it, as the
        engine now computes them (see SplitEngines.send_weights). Episodes' turns under way end first, from the
        weights they began with."""
        self.idle += time.perf_counter() - self.idle_since
        self.finish_turns()
        weights = weight_sync.received_tensors(self.weight_group, self.device)
        if self.adapter_config is not None:
            self.engine.load_adapter(dict(weights), self.adapter_config)
        else:
            self.engine.load_weights(weights)
        self.version = version
        probe_log_probs = self.probe_log_probs(probe, answer_length)
        self.idle_since = time.perf_counter()
        return probe_log_probs

    @torch.no_grad()
    def probe_log_probs(self, tokens: list[int], answer_length: int) -> torch.Tensor:
        """The log-probs at temperature 1 of the last `answer_length` of `tokens`, each after those before it."""
        return self.engine.prompt_log_probs(tokens)[-answer_length:]

    def save(self, path: str) -> None:
        """The engine's randomness, once it generated every batch it was asked before (a checkpoint holds those
        batches): the resumed engine then samples what this one would have. Its weights need nothing: every weight
        sync replaces them all, and the resumed run's first step sends them."""
        os.makedirs(path, exist_ok=True)
        rng = {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()}
        if self.device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state()
        torch.save(rng, os.path.join(path, f"rng_rank{self.rank}.pt"))

    def load(self, path: str) -> None:
        """The randomness `save` kept (a checkpoint saved before it did has none: the engine keeps its seed's)."""
        file = os.path.join(path, f"rng_rank{self.rank}.pt")
        if not os.path.exists(file):
            return
        rng = torch.load(file, weights_only=False)
        torch.set_rng_state(rng["torch"])
        np.random.set_state(rng["numpy"])
        random.setstate(rng["python"])
        if "cuda" in rng:
            torch.cuda.set_rng_state(rng["cuda"])

    def generate(self, data: DataProto, max_response_length: int, **sampling) -> DataProto:
        """EngineWorker.generate, each sample tagged with its `weight_version` and the seconds the engine had waited,
        for prompts or weights, since its last batch (`engine_idle_s`)."""
        self.idle += time.perf_counter() - self.idle_since
        batch = super().generate(data, max_response_length, **sampling)
        batch["weight_version"] = torch.full((len(batch),), self.version)
        batch["engine_idle_s"], self.idle = torch.full((len(batch),), self.idle), 0.0
        self.idle_since = time.perf_counter()
        return batch
