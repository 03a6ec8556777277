"""The rollout worker: a rollout engine in a process of its own (split placement, --rollout-workers), which the
policy's rank 0 sends its weights (common/rollout_workers.py drives a group of them)."""

from __future__ import annotations

import os
import random
import time

import numpy as np
import torch
import torch.distributed as dist

from common import weight_sync
from common.dataproto import DataProto
from common.engines import EngineContext, make_engine
from common.fsdp_worker import compute_dtype_for
from common.memory import measured
from common.rollout import EngineWorker, eos_token_ids


class RolloutWorker(EngineWorker):
    """A rollout engine in a process of its own (split placement, --rollout-workers): it generates from the weights the
    policy last sent it (see PolicyWorker.send_weights) and tags every sample with their version, the number of
    updates they had had. The engines of a group form a torch.distributed group of their own, which vLLM's external
    launcher joins as the policy's engines join the policy's."""

    def __init__(self, rank: int, world_size: int, use_gpu: bool):
        super().__init__(rank, world_size, use_gpu)
        self.version, self.idle, self.idle_since = 0, 0.0, time.perf_counter()

    def setup(
        self,
        master,
        model_path: str,
        temperature: float = 1.0,
        rollout_engine: str = "hf",
        rollout_dtype: str = "bfloat16",
        rollout_gpu_memory_utilization: float = 0.5,
        max_model_len: int = 2048,
        compute_dtype: str = "float32",
        seed: int = 1,
        adapter_config=None,
    ) -> None:
        """The engine, from `model_path`'s weights: vLLM in `rollout_dtype`, or transformers' generate in
        `compute_dtype`. `adapter_config` (with vLLM): the LoRA adapter it will be sent, which it then serves; without
        it, it receives every weight."""
        from transformers import AutoTokenizer

        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        addr, port = master
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        dist.init_process_group(
            backend, init_method=f"tcp://{addr}:{port}", rank=self.rank, world_size=self.world_size,
            timeout=self.collective_timeout,
        )  # fmt: skip
        torch.manual_seed(seed + self.rank)
        self.temperature, self.adapter_config = temperature, adapter_config
        tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.eos_token_ids = eos_token_ids(model_path, tokenizer)
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_token_ids[0]
        context = EngineContext(
            None,
            None,
            tokenizer,
            self.eos_token_ids,
            self.pad_token_id,
            model_path,
            self.device,
            self.engine_placement(master),
            seed=seed,
            rollout_dtype=rollout_dtype,
            compute_dtype=compute_dtype_for(compute_dtype, self.device),
            gpu_memory_utilization=rollout_gpu_memory_utilization,
            max_model_len=max_model_len,
            lora_sync="adapter" if adapter_config is not None else "merged",
            adapter_config=adapter_config,
        )
        self.rollout = make_engine(rollout_engine, context)

    def weight_dtype(self) -> str:
        """The dtype the engine keeps its weights in, which the policy sends them in."""
        return str(self.rollout.dtype).removeprefix("torch.")

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
            self.rollout.load_adapter(dict(weights), self.adapter_config)
        else:
            self.rollout.load_weights(weights)
        self.version = version
        probe_log_probs = self.probe_log_probs(probe, answer_length)
        self.idle_since = time.perf_counter()
        return probe_log_probs

    @torch.no_grad()
    def probe_log_probs(self, tokens: list[int], answer_length: int) -> torch.Tensor:
        """The log-probs at temperature 1 of the last `answer_length` of `tokens`, each after those before it."""
        return self.rollout.prompt_log_probs(tokens)[-answer_length:]

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
