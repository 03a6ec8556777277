"""The policy's worker, the hybrid engine: the FSDP2-sharded policy that trains (common/fsdp_worker.py), a rollout
engine that generates from it (common/rollout.py) and, with LoRA, the reference (adapter disabled). It knows no
algorithm: losses arrive from the script as plain functions."""

from __future__ import annotations

import functools
import os
import queue
import shutil
from contextlib import nullcontext

import torch

from common import weight_sync
from common.dataproto import DataProto
from common.engines import EngineContext, make_engine
from common.fsdp_worker import FSDPWorker, lora_model
from common.layouts import response_outputs, rows_of
from common.log_probs import chunked_log_probs, head_outputs_pass_through, response_log_probs
from common.memory import measured
from common.rollout import EngineWorker, eos_token_ids

LOG_PROB_INPUTS = ("input_ids", "attention_mask", "position_ids", "responses")
"""what the log-prob passes (compute_log_prob, compute_ref_log_prob, the critic's compute_values) read of a batch"""

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
        temperature: float = 1.0,
        use_reference: bool = True,
        rollout_engine: str | None = "hf",
        rollout_dtype: str = "bfloat16",
        rollout_gpu_memory_utilization: float = 0.5,
        max_model_len: int = 2048,
        lora_sync: str = "auto",
        offload: bool = False,
        log_prob_chunk_tokens: int = 0,
        chat_template: str | None = None,
        **settings,
    ) -> None:
        """The policy (see FSDPWorker.setup), its rollout engine (common/rollout.py; none: `rollout_engine` None), and
        the reference. `chat_template`: the run's (--chat-template), which the exported model's tokenizer keeps.

        Log-probs are those of the logits divided by `temperature`, the distribution rollouts sample from, computed
        over the vocabulary `log_prob_chunk_tokens` response tokens at a time (see chunked_log_probs; 0: all at once).
        """
        from transformers import AutoTokenizer

        super().setup(master, model_path, **settings)
        self.temperature = temperature
        self.log_prob_chunk_tokens = log_prob_chunk_tokens if head_outputs_pass_through(self.model, self.device) else None
        if self.rank == 0 and self.log_prob_chunk_tokens is None:
            print(f"{type(self).__name__}: log-probs from whole logits (this model changes its output layer's output)")
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.tokenizer.chat_template = chat_template or self.tokenizer.chat_template
        # The reference: with LoRA it is this same model with the adapter off.
        self.reference = None
        if use_reference and not self.lora:
            self.reference = self._shard(self._load(model_path).requires_grad_(False).eval(), offload=True)
        self.eos_token_ids = eos_token_ids(model_path, self.tokenizer)
        self.pad_token_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.eos_token_ids[0]
        # FSDP2 initialises lazily on the root's first forward; generate needs that done.
        with torch.no_grad():
            self.model(input_ids=torch.zeros(1, 1, dtype=torch.long, device=self.device))
        if rollout_engine is None:  # rollout workers of their own generate (split placement)
            self.rollout = None
            return
        context = EngineContext(
            self.model,
            self.optimizer,
            self.tokenizer,
            self.eos_token_ids,
            self.pad_token_id,
            model_path,
            self.device,
            self.engine_placement(master),
            seed=settings.get("seed", 1),
            rollout_dtype=rollout_dtype,
            compute_dtype=self.compute_dtype,
            gpu_memory_utilization=rollout_gpu_memory_utilization,
            max_model_len=max_model_len,
            lora_sync=lora_sync,
            offload=offload,
            frozen=not self.trains,
        )
        self.rollout = make_engine(rollout_engine, context)

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
