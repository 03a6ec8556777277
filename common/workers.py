"""Ray worker groups and the workers that run on them.

A `WorkerGroup` is N Ray actors, one per accelerator (one per CPU slot on a
machine without one), that form one torch.distributed group. The driver calls
every rank at once: a collective inside a method deadlocks if ranks are called
one after another.

`PolicyWorker` is the hybrid engine: the FSDP2-sharded policy that trains is
also the model that generates rollouts and, with LoRA, the reference (adapter
disabled). `CriticWorker` is a value model sharded the same way. Neither
knows any algorithm: losses arrive from the script as plain functions.
"""

from __future__ import annotations

import math
import os
import resource
import shutil
import socket
from collections import defaultdict
from contextlib import contextmanager, nullcontext

import numpy as np
import ray
import torch
import torch.distributed as dist
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from common import weight_sync
from common.dataproto import DataProto


def init_ray() -> None:
    """Join the cluster named by RAY_ADDRESS (multi-node), else start a local one."""
    if ray.is_initialized():
        return
    env = {"env_vars": {"TOKENIZERS_PARALLELISM": "false"}}
    if os.environ.get("RAY_ADDRESS"):
        ray.init(address=os.environ["RAY_ADDRESS"], runtime_env=env)
    else:
        ray.init(include_dashboard=False, runtime_env=env)


class WorkerDied(RuntimeError):
    pass


class ResourcePool:
    """One placement-group bundle per worker: a GPU each, or a CPU each without GPUs.

    Worker groups that share a pool are colocated: rank i of each group lands
    in bundle i, on the same accelerator.
    """

    def __init__(self, num_workers: int, use_gpu: bool, max_colocated: int = 1):
        need = {"GPU" if use_gpu else "CPU": num_workers}
        have = ray.cluster_resources()
        for kind, count in need.items():
            if have.get(kind, 0) < count:
                raise ValueError(
                    f"--num-workers {num_workers} needs {count} {kind}s but the Ray cluster has "
                    f"{int(have.get(kind, 0))}; lower --num-workers or add nodes"
                )
        self.num_workers, self.use_gpu, self.max_colocated = num_workers, use_gpu, max_colocated
        bundle = {"GPU": 1, "CPU": 1} if use_gpu else {"CPU": 1}
        self.placement_group = placement_group([bundle] * num_workers, strategy="PACK")
        ray.get(self.placement_group.ready())

    def shutdown(self) -> None:
        remove_placement_group(self.placement_group)


class WorkerGroup:
    """N actors of `worker_cls` in one torch.distributed group, placed on `pool`."""

    def __init__(self, worker_cls, pool: ResourcePool, name: str, **setup_kwargs):
        self.name, self.world_size = name, pool.num_workers
        share = 1.0 / pool.max_colocated
        actor_cls = ray.remote(worker_cls)
        self.workers = [
            actor_cls.options(
                num_cpus=share,
                num_gpus=share if pool.use_gpu else 0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(pool.placement_group, placement_group_bundle_index=rank),
            ).remote(rank, self.world_size, pool.use_gpu)
            for rank in range(self.world_size)
        ]
        master = self.workers[0].master_address.remote()
        try:
            self.broadcast("setup", master, **setup_kwargs)
        except BaseException:
            self.shutdown()  # give their share of the placement group back
            raise

    def _get(self, refs, method: str) -> list:
        # Wait in completion order so that a dead rank is reported at once, not
        # after its peers time out inside a collective.
        rank_of = {ref: rank for rank, ref in enumerate(refs)}
        results, pending = [None] * len(refs), list(refs)
        while pending:
            [ready], pending = ray.wait(pending, num_returns=1)
            try:
                results[rank_of[ready]] = ray.get(ready)
            except ray.exceptions.RayActorError as error:
                raise WorkerDied(f"{self.name} worker rank {rank_of[ready]} died during '{method}'") from error
        return results

    def broadcast(self, method: str, *args, **kwargs) -> list:
        """Call `method` with the same arguments on every rank; one result per rank."""
        return self._get([getattr(w, method).remote(*args, **kwargs) for w in self.workers], method)

    def rank0(self, method: str, *args, **kwargs):
        """Call every rank (the method may hold collectives), return rank 0's answer."""
        return self.broadcast(method, *args, **kwargs)[0]

    def scatter(self, method: str, data: DataProto, **kwargs):
        """Split `data` across ranks (padding to a multiple of the world size), call all, reassemble.

        DataProto results are concatenated and unpadded; others come back as a list per rank.
        """
        padded, pad = data.pad_to_multiple(self.world_size)
        chunks = padded.chunk(self.world_size)
        results = self._get([getattr(w, method).remote(c, **kwargs) for w, c in zip(self.workers, chunks)], method)
        if isinstance(results[0], DataProto):
            return DataProto.concat(results).unpad(pad)
        return results

    def shutdown(self) -> None:
        """Kill every rank and wait until each is gone, so that the next group finds its memory free
        (a vLLM engine checks that free memory did not change while it measures its own)."""
        for worker in self.workers:
            ray.kill(worker)
        for worker in self.workers:
            try:
                ray.get(worker.__ray_ready__.remote())
            except ray.exceptions.RayActorError:
                pass


# --------------------------------------------------------------------------- FSDP2 workers


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _fsdp_modules(model):
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


@contextmanager
def unsharded(model):
    """Gather every shard once for the duration, so forwards need no collective.

    `generate` runs a different number of forwards on each rank (each stops at
    its own EOS): with sharded layers those forwards would all-gather and hang.
    """
    modules = _fsdp_modules(model)
    model.set_reshard_after_forward(False)
    for module in modules:
        module.unshard()
    try:
        yield
    finally:
        for module in modules:
            module.reshard()
        for module in modules[1:]:
            module.set_reshard_after_forward(True, recurse=False)


class FSDPWorker:
    """What the policy and the critic share: distributed setup, FSDP2 sharding, optimisation."""

    def __init__(self, rank: int, world_size: int, use_gpu: bool):
        # The pool decides, not torch.cuda.is_available(): recent Ray no longer hides the GPUs from CPU-only actors.
        self.rank, self.world_size = rank, world_size
        self.device = torch.device("cuda", 0) if use_gpu else torch.device("cpu")

    def master_address(self) -> tuple[str, int]:
        return ray.util.get_node_ip_address(), _free_port()

    def setup(
        self,
        master,
        model_path: str,
        seed: int = 1,
        lr: float = 1e-6,
        weight_decay: float = 0.0,
        lr_warmup_steps: int = 0,
        max_grad_norm: float = 1.0,
        gradient_checkpointing: bool = False,
        lora_rank: int = 0,
        lora_alpha: int = 16,
        lora_target_modules: str = "all-linear",
    ) -> None:
        """Join the process group, load the model (with a LoRA adapter if asked), shard it, build its optimiser."""
        self._init_distributed(master, seed)
        self.model_path, self.max_grad_norm, self.lora = model_path, max_grad_norm, lora_rank > 0
        self.lora_settings = (lora_rank, lora_alpha, lora_target_modules)
        model = self._load(model_path)
        self.layer_classes = set(getattr(model, "_no_split_modules", None) or [])
        if gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if self.lora:
            model = self._add_lora(model)
        self.model = self._shard(model)
        self._build_optimizer(lr, weight_decay, lr_warmup_steps)
        if self.rank == 0:
            print(f"{type(self).__name__}: {self.world_size} x {self.device.type}, attention: {self.attention}")

    def _init_distributed(self, master: tuple[str, int], seed: int) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
            if not torch.cuda.is_bf16_supported():
                raise ValueError(f"{torch.cuda.get_device_name()} has no bf16, which training and the vllm engine compute in")
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        addr, port = master
        if not dist.is_initialized():
            dist.init_process_group(backend, init_method=f"tcp://{addr}:{port}", rank=self.rank, world_size=self.world_size)
        self.mesh = init_device_mesh(self.device.type, (self.world_size,))
        self.attention = attention_implementation(self.device)
        torch.manual_seed(seed + self.rank)
        np.random.seed(seed + self.rank)

    def _load(self, model_path: str):
        # fp32 master weights: on a GPU, FSDP2 computes in bf16, which flash-attention needs.
        model = self._from_pretrained(model_path, dtype=torch.float32, attn_implementation=self.attention)
        # RL compares log-probs of the same tokens across passes: dropout would make
        # the first importance ratio differ from 1.
        for module in model.modules():
            if isinstance(module, torch.nn.Dropout):
                module.p = 0.0
        return model

    def _shard(self, model, offload: bool = False):
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

        on_gpu = self.device.type == "cuda"
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if on_gpu else MixedPrecisionPolicy()
        options = dict(mesh=self.mesh, mp_policy=mp, offload_policy=CPUOffloadPolicy() if offload and on_gpu else OffloadPolicy())
        for module in list(model.modules()):
            if type(module).__name__ in self.layer_classes:
                fully_shard(module, **options)
        fully_shard(model, **options)
        return model

    def _build_optimizer(self, lr: float, weight_decay: float, warmup_steps: int) -> None:
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: min(1.0, (step + 1) / warmup_steps) if warmup_steps else 1.0
        )

    def _all_reduce_sum(self, values: list[float]) -> list[float]:
        tensor = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(tensor)
        return tensor.tolist()

    def _update(self, data: DataProto, loss_fn, forward, epochs: int, mini_batch_size: int, micro_batch_size: int) -> dict:
        """Epochs x mini-batches x micro-batches; one optimiser step per mini-batch.

        `loss_fn(micro_batch, outputs, minibatch_tokens=..., minibatch_seqs=...)` returns
        (loss, metrics) as this micro-batch's share of the mini-batch value: it
        divides by the token and sequence counts of the whole mini-batch, over
        all ranks, which it is given. Summing shares over micro-batches and ranks
        then gives exactly the mini-batch loss, and the same for every metric.
        """
        self.model.train()
        per_rank = mini_batch_size // self.world_size
        history = defaultdict(list)
        for _ in range(epochs):
            for mini in data.split(per_rank):
                tokens, seqs = self._all_reduce_sum([mini.batch["response_mask"].sum().item(), len(mini)])
                shares = defaultdict(float)
                for micro in mini.split(micro_batch_size):
                    micro = micro.to(self.device)
                    loss, metrics = loss_fn(micro.batch, forward(micro), minibatch_tokens=tokens, minibatch_seqs=seqs)
                    # FSDP averages gradients over ranks; the loss shares add up instead.
                    (loss * self.world_size).backward()
                    shares["loss"] += loss.item()
                    for key, value in metrics.items():
                        shares[key] += float(value)
                grad_norm = self._clip_grad_norm()
                if math.isfinite(grad_norm):
                    self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)
                keys = sorted(shares)
                for key, value in zip(keys, self._all_reduce_sum([shares[k] for k in keys])):
                    history[key].append(value)
                history["grad_norm"].append(grad_norm)
                history["skipped_updates"].append(float(not math.isfinite(grad_norm)))
        self.scheduler.step()
        metrics = {key: float(np.mean(values)) for key, values in history.items()}
        metrics["skipped_updates"] = float(np.sum(history["skipped_updates"]))
        metrics["lr"] = self.scheduler.get_last_lr()[0]
        metrics["peak_memory_gb"] = self._all_reduce_max(self.peak_memory_gb())
        return metrics

    def peak_memory_gb(self) -> float:
        """Peak accelerator memory on a GPU, peak resident memory of the process on a CPU."""
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated() / 2**30
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20

    def _all_reduce_max(self, value: float) -> float:
        tensor = torch.tensor([value], dtype=torch.float64, device=self.device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        return tensor.item()

    def _clip_grad_norm(self) -> float:
        params = [p for p in self.model.parameters() if p.requires_grad]
        norm = torch.nn.utils.clip_grad_norm_(params, self.max_grad_norm)
        if hasattr(norm, "full_tensor"):
            norm = norm.full_tensor()
        return norm.item()

    def save(self, path: str) -> None:
        """Sharded weights, optimiser, schedule and RNG of every rank, for a later resume."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict

        self.model.reshard()
        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        dcp.save({"model": model_state, "optimizer": optim_state, "scheduler": self.scheduler.state_dict()}, checkpoint_id=path)
        rng = {"torch": torch.get_rng_state(), "numpy": np.random.get_state()}
        if self.device.type == "cuda":
            rng["cuda"] = torch.cuda.get_rng_state()
        torch.save(rng, os.path.join(path, f"rng_rank{self.rank}.pt"))

    def load(self, path: str) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        state = {"model": model_state, "optimizer": optim_state, "scheduler": self.scheduler.state_dict()}
        dcp.load(state, checkpoint_id=path)
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        rng = torch.load(os.path.join(path, f"rng_rank{self.rank}.pt"), weights_only=False)
        torch.set_rng_state(rng["torch"])
        np.random.set_state(rng["numpy"])
        if "cuda" in rng:
            torch.cuda.set_rng_state(rng["cuda"])

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter gathered whole, on the CPU (a collective: call every rank)."""
        self.model.reshard()  # FSDP2 keeps the root unsharded after a forward
        return {name: p.full_tensor().cpu() for name, p in self.model.named_parameters()}


def attention_implementation(device: torch.device) -> str:
    """flash-attention 2 where its kernel loads and the GPU runs it (Ampere or newer), SDPA otherwise."""
    from transformers.utils import is_flash_attn_2_available

    if device.type != "cuda" or torch.cuda.get_device_capability(device)[0] < 8 or not is_flash_attn_2_available():
        return "sdpa"
    try:  # the compiled kernel: a build against another torch fails to load here, not at install
        import flash_attn_2_cuda  # noqa: F401
    except ImportError:
        return "sdpa"
    return "flash_attention_2"


def _lora(model, rank: int, alpha: int, target_modules: str, task_type: str, modules_to_save: list[str] | None = None):
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=rank, lora_alpha=alpha, target_modules=target_modules, lora_dropout=0.0, task_type=task_type, modules_to_save=modules_to_save
    )
    return get_peft_model(model, config)


def _response_log_probs(logits: torch.Tensor, responses: torch.Tensor, temperature: float, with_entropy: bool):
    logits = logits.float() / temperature
    log_probs = torch.log_softmax(logits, dim=-1)
    token_log_probs = log_probs.gather(-1, responses.unsqueeze(-1)).squeeze(-1)
    entropy = -(log_probs.exp() * log_probs).sum(-1) if with_entropy else None
    return token_log_probs, entropy


class SampledLogProbs:
    """A logits processor that records log p(token) of each sampled token, one step at a time.

    Placed before generate's own temperature warper, it sees the model's logits
    and applies the temperature itself, as the trainer does. Holding only the
    last step's distribution keeps memory at [batch, vocab], not [batch, steps, vocab].
    """

    def __init__(self, temperature: float):
        self.temperature, self.last, self.taken = temperature, None, []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.last is not None:  # the last column of input_ids was sampled from the last distribution
            self.taken.append(self.last.gather(-1, input_ids[:, -1:]).squeeze(-1))
        self.last = torch.log_softmax(scores.float() / self.temperature, dim=-1)
        return scores

    def log_probs(self, responses: torch.Tensor) -> torch.Tensor:
        """[batch, steps] log-probs of `responses` (generate's new tokens)."""
        taken = self.taken + [self.last.gather(-1, responses[:, -1:]).squeeze(-1)]
        return torch.stack(taken, dim=1)


class PolicyWorker(FSDPWorker):
    """The hybrid engine: trainable policy, rollout engine and reference in one process."""

    def _from_pretrained(self, model_path: str, **kwargs):
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(model_path, **kwargs)

    def _add_lora(self, model):
        return _lora(model, *self.lora_settings, "CAUSAL_LM")

    def setup(
        self,
        master,
        model_path: str,
        use_reference: bool = True,
        rollout_engine: str = "hf",
        rollout_dtype: str = "bfloat16",
        rollout_gpu_memory_utilization: float = 0.5,
        max_model_len: int = 2048,
        lora_merge: bool = False,
        offload: bool = False,
        **settings,
    ) -> None:
        """The policy (see FSDPWorker.setup), its rollout engine, and the reference.

        With `rollout_engine="vllm"` a vLLM engine generates, computing in `rollout_dtype`; it gets the
        policy's weights before each generation, the adapter alone with LoRA unless `lora_merge`.
        `offload` moves the policy's weights and optimiser state to the CPU while vLLM generates.
        """
        from transformers import AutoTokenizer

        if rollout_engine not in ("hf", "vllm"):
            raise ValueError(f"rollout engine '{rollout_engine}' is not available; use 'hf' or 'vllm'")
        if rollout_engine == "hf" and (offload or lora_merge):
            raise ValueError("--offload and --lora-merge act on the vllm engine only; drop them, or add --rollout-engine vllm")
        if offload and self.device.type == "cpu":
            raise ValueError("--offload frees GPU memory for the vllm engine; drop it on CPUs")
        super().setup(master, model_path, **settings)
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        # The reference: with LoRA it is this same model with the adapter off.
        self.reference = None
        if use_reference and not self.lora:
            self.reference = self._shard(self._load(model_path).requires_grad_(False).eval(), offload=True)
        self.eos_token_ids = self._eos_token_ids()
        self.pad_token_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.eos_token_ids[0]
        # FSDP2 initialises lazily on the root's first forward; generate needs that done.
        with torch.no_grad():
            self.model(input_ids=torch.zeros(1, 1, dtype=torch.long, device=self.device))
        self.lora_merge, self.offload, self.vllm = lora_merge, offload, None
        if rollout_engine == "vllm":
            from common.vllm_rollout import VLLMRollout

            adapter_rank = self.lora_settings[0] if self.lora and not lora_merge else 0
            self.vllm = VLLMRollout(
                model_path,
                self.rank,
                self.world_size,
                master,
                seed=settings.get("seed", 1),
                on_gpu=self.device.type == "cuda",
                dtype=getattr(torch, rollout_dtype),
                gpu_memory_utilization=rollout_gpu_memory_utilization,
                max_model_len=max_model_len,
                lora_rank=adapter_rank,
            )

    def _eos_token_ids(self) -> list[int]:
        config = getattr(self.model, "generation_config", None)
        eos = config.eos_token_id if config is not None and config.eos_token_id is not None else self.tokenizer.eos_token_id
        return list(eos) if isinstance(eos, (list, tuple)) else [eos]

    @torch.no_grad()
    def generate(self, data: DataProto, max_response_length: int, do_sample: bool = True, temperature: float = 1.0, top_p: float = 1.0, top_k: int = 0) -> DataProto:
        """Sample (or greedily decode) one response per left-padded prompt.

        Returns `responses` and `response_mask` (padded to `max_response_length`,
        the mask covering tokens up to and including the first EOS), the
        engine's own log-prob of each sampled token as `rollout_log_probs`, and
        the full sequences as `input_ids`, `attention_mask` and `position_ids`.
        """
        prompts = data.batch["prompts"].to(self.device)
        prompt_mask = data.batch["prompt_mask"].to(self.device)
        sampling = dict(do_sample=do_sample, temperature=temperature, top_p=top_p, top_k=top_k)
        if self.vllm is None:
            responses, rollout_log_probs = self._generate_hf(prompts, prompt_mask, max_response_length, **sampling)
        else:
            responses, rollout_log_probs = self._generate_vllm(prompts, prompt_mask, max_response_length, **sampling)
        pad = (0, max_response_length - responses.shape[1])
        responses = torch.nn.functional.pad(responses, pad, value=self.pad_token_id)
        rollout_log_probs = torch.nn.functional.pad(rollout_log_probs, pad)
        is_eos = torch.isin(responses, torch.tensor(self.eos_token_ids, device=self.device))
        response_mask = (is_eos.cumsum(-1) - is_eos.long()) == 0
        responses = responses.masked_fill(~response_mask, self.pad_token_id)
        attention_mask = torch.cat([prompt_mask, response_mask.long()], dim=-1)
        return DataProto.from_dict(
            {
                "responses": responses,
                "response_mask": response_mask.float(),
                "rollout_log_probs": rollout_log_probs * response_mask,
                "input_ids": torch.cat([prompts, responses], dim=-1),
                "attention_mask": attention_mask,
                "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0),
            }
        ).to("cpu")

    def _generate_hf(self, prompts, prompt_mask, max_response_length, do_sample, temperature, top_p, top_k):
        """transformers' generate on the training policy itself, every FSDP unit gathered once."""
        from transformers import GenerationConfig, LogitsProcessorList

        self.model.eval()
        sampling = dict(do_sample=True, temperature=temperature, top_p=top_p, top_k=top_k) if do_sample else dict(do_sample=False)
        config = GenerationConfig(max_new_tokens=max_response_length, eos_token_id=self.eos_token_ids, pad_token_id=self.pad_token_id, **sampling)
        recorder = SampledLogProbs(temperature if do_sample else 1.0)
        with unsharded(self.model):
            output = self.model.generate(
                input_ids=prompts, attention_mask=prompt_mask, generation_config=config, logits_processor=LogitsProcessorList([recorder])
            )
        responses = output[:, prompts.shape[1] :]
        return responses, recorder.log_probs(responses)

    def _generate_vllm(self, prompts, prompt_mask, max_response_length, **sampling):
        """vLLM, woken for the call with the policy's current weights, asleep again after it."""
        self.vllm.wake_weights()
        self._sync_weights()
        if self.offload:
            self._move_policy("cpu")
        self.vllm.wake_kv_cache()
        token_lists = [row[mask.bool()].tolist() for row, mask in zip(prompts, prompt_mask)]
        tokens, log_probs = self.vllm.generate(token_lists, max_response_length, self.eos_token_ids, **sampling)
        self.vllm.sleep()
        if self.offload:
            self._move_policy(self.device)
        longest = max(1, max(len(t) for t in tokens))
        responses = torch.full((len(tokens), longest), self.pad_token_id, dtype=torch.long)
        rollout_log_probs = torch.zeros(len(tokens), longest)
        for i, (ids, values) in enumerate(zip(tokens, log_probs)):
            responses[i, : len(ids)] = torch.tensor(ids, dtype=torch.long)
            rollout_log_probs[i, : len(values)] = torch.tensor(values)
        return responses.to(self.device), rollout_log_probs.to(self.device)

    def _sync_weights(self) -> None:
        """Send the engine the policy as it is now: the adapter alone, or every weight, one FSDP unit at a time."""
        if self.lora and not self.lora_merge:
            self.vllm.load_adapter(self._engine_adapter(), self.model.peft_config[weight_sync.ADAPTER])
        else:
            self.vllm.load_weights(self._engine_weights())

    def _engine_adapter(self) -> dict[str, torch.Tensor]:
        """The LoRA adapter, whole, named as PEFT saves it (a collective: call every rank)."""
        self.model.reshard()
        adapter = {n: p.full_tensor() for n, p in self.model.named_parameters() if weight_sync.is_adapter(n)}
        return weight_sync.adapter_weights(adapter)

    def _engine_weights(self):
        """(checkpoint name, tensor) of every weight, LoRA merged in, gathered one FSDP unit at a time (a collective)."""
        scaling = weight_sync.lora_scaling(self.model) if self.lora else {}
        for unit in weight_sync.gathered_units(self.model):
            yield from (weight_sync.merged_weights(unit, scaling) if self.lora else weight_sync.base_weights(unit)).items()

    def _move_policy(self, device) -> None:
        """The policy's shards and optimiser state to `device`, freeing the GPU for the engine's KV cache."""
        self.model.to(device)  # FSDP2 reshards before it moves
        for state in self.optimizer.state.values():
            for key, value in state.items():
                if torch.is_tensor(value) and key != "step":
                    state[key] = value.to(device)
        if device == "cpu":
            torch.cuda.empty_cache()

    def _forward(self, model, micro: DataProto, temperature: float, with_entropy: bool):
        responses = micro.batch["responses"]
        output = model(
            input_ids=micro.batch["input_ids"],
            attention_mask=micro.batch["attention_mask"],
            position_ids=micro.batch["position_ids"],
            logits_to_keep=responses.shape[1] + 1,
            use_cache=False,
        )
        return _response_log_probs(output.logits[:, :-1], responses, temperature, with_entropy)

    @torch.no_grad()
    def _log_probs(self, data: DataProto, model, temperature: float, micro_batch_size: int, with_entropy: bool):
        model.eval()
        log_probs, entropies = [], []
        for micro in data.split(micro_batch_size):
            log_prob, entropy = self._forward(model, micro.to(self.device), temperature, with_entropy)
            log_probs.append(log_prob.cpu())
            entropies.append(entropy.cpu() if with_entropy else None)
        return torch.cat(log_probs), torch.cat(entropies) if with_entropy else None

    def compute_log_prob(self, data: DataProto, temperature: float, micro_batch_size: int) -> DataProto:
        """Per-token log-probs and entropies of the responses under the current policy."""
        log_probs, entropy = self._log_probs(data, self.model, temperature, micro_batch_size, with_entropy=True)
        return DataProto.from_dict({"old_log_probs": log_probs, "entropy": entropy})

    def compute_ref_log_prob(self, data: DataProto, temperature: float, micro_batch_size: int) -> DataProto:
        """Per-token log-probs under the reference: the base model (LoRA off) or the frozen copy."""
        with self.model.disable_adapter() if self.lora else nullcontext():
            model = self.model if self.lora else self.reference
            log_probs, _ = self._log_probs(data, model, temperature, micro_batch_size, with_entropy=False)
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
        model.load_state_dict(state)
        if self.lora and not adapter_only:
            model = model.merge_and_unload()
        scratch = f"{path}.partial"
        shutil.rmtree(scratch, ignore_errors=True)
        model.to(dtype).save_pretrained(scratch)
        self.tokenizer.save_pretrained(scratch)
        shutil.rmtree(path, ignore_errors=True)
        os.rename(scratch, path)

    def update(self, data: DataProto, loss_fn, temperature: float, epochs: int, mini_batch_size: int, micro_batch_size: int) -> dict:
        """PPO-style update with the script's `loss_fn(micro_batch, (log_prob, entropy), ...)`."""

        def forward(micro):
            return self._forward(self.model, micro, temperature, with_entropy=True)

        return self._update(data, loss_fn, forward, epochs, mini_batch_size, micro_batch_size)


class CriticWorker(FSDPWorker):
    """A value model: the policy's architecture with a scalar head over every token (see FSDPWorker.setup)."""

    def _from_pretrained(self, model_path: str, **kwargs):
        from transformers import AutoModelForTokenClassification

        return AutoModelForTokenClassification.from_pretrained(model_path, num_labels=1, **kwargs)

    def _add_lora(self, model):
        # The value head is new: it trains in full beside the adapter.
        return _lora(model, *self.lora_settings, "TOKEN_CLS", modules_to_save=["score"])

    def _forward(self, micro: DataProto) -> torch.Tensor:
        """The value of the state before each response token."""
        output = self.model(
            input_ids=micro.batch["input_ids"], attention_mask=micro.batch["attention_mask"], position_ids=micro.batch["position_ids"], use_cache=False
        )
        response_length = micro.batch["responses"].shape[1]
        return output.logits[:, -response_length - 1 : -1, 0].float()

    @torch.no_grad()
    def compute_values(self, data: DataProto, micro_batch_size: int) -> DataProto:
        self.model.eval()
        values = [self._forward(micro.to(self.device)).cpu() for micro in data.split(micro_batch_size)]
        return DataProto.from_dict({"values": torch.cat(values)})

    def update(self, data: DataProto, loss_fn, epochs: int, mini_batch_size: int, micro_batch_size: int) -> dict:
        """Regress values with the script's `loss_fn(micro_batch, values, ...)`."""
        return self._update(data, loss_fn, self._forward, epochs, mini_batch_size, micro_batch_size)


def rollout_logprob_gap(batch: DataProto, bound: float) -> dict:
    """How far the engine's log-probs of its own samples are from the trainer's, per token: mean and max.

    Float rounding and the engine's other kernels explain a small gap. A mean gap above `bound`
    (0: no bound) means the engine samples from other weights than the policy's, stale or never
    loaded, and stops the run before it trains on those samples.
    """
    gap = (batch.batch["old_log_probs"] - batch.batch["rollout_log_probs"]).abs()[batch.batch["response_mask"].bool()]
    mean = gap.mean().item()
    if bound and mean > bound:
        raise RuntimeError(
            f"the rollout engine does not hold the policy's weights: its log-probs of its own samples differ from the "
            f"trainer's by {mean:.3g} per token on average, beyond --max-rollout-logprob-diff {bound}. Look in the workers' "
            "log for weights the engine did not receive; with LoRA, check that the engine serves the adapter, or send "
            "merged weights with --lora-merge. Raise the bound only for an engine that computes in lower precision."
        )
    return {"rollout/logprob_diff_mean": mean, "rollout/logprob_diff_max": gap.max().item()}
