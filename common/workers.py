"""Ray worker groups and the workers that run on them.

A `WorkerGroup` is N Ray actors, one per accelerator (one per CPU slot on a
machine without one), that form one torch.distributed group. The driver calls
every rank at once: a collective inside a method deadlocks if ranks are called
one after another. Without a pool, the group is one worker inside the
driver's own process (no Ray): `breakpoint()` anywhere then stops in the
user's terminal.

`PolicyWorker` is the hybrid engine: the FSDP2-sharded policy that trains,
plus a rollout engine that generates from it (common/rollout.py) and, with
LoRA, the reference (adapter disabled). `CriticWorker` is a value model
sharded the same way. Neither knows any algorithm: losses arrive from the
script as plain functions. `RolloutWorker` is a rollout engine in a process
of its own (split placement, see common/rollout_workers.py), which the
policy's rank 0 sends its weights.
"""

from __future__ import annotations

import functools
import math
import os
import resource
import shutil
import socket
import time
from collections import defaultdict
from contextlib import contextmanager, nullcontext
from typing import Literal

import numpy as np
import ray
import torch
import torch.distributed as dist
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from common import weight_sync
from common.dataproto import DataProto
from common.rollout import HFRollout, VLLMRollout, eos_token_ids, machine_memory_bytes, response_batch
from common.sequence_parallel import SequenceParallel, full_attention, gather_tokens
from common.sequence_parallel import register as register_sequence_parallel
from common.update_metrics import MAX, MIN, accumulate


class WorkerDied(RuntimeError):
    pass


DIED = (ray.exceptions.RayActorError, ray.exceptions.OutOfMemoryError)  # a rank gone, or stopped by Ray's memory monitor


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
    """N actors of `worker_cls` in one torch.distributed group, placed on `pool`; or, with no pool, one
    `worker_cls` in this process."""

    def __init__(self, worker_cls, pool: ResourcePool | None, name: str, **setup_kwargs):
        self.name, self.in_process = name, pool is None
        self.sequence_parallel = setup_kwargs.get("sequence_parallel", 1)
        self.sequence_parallel_methods = worker_cls.sequence_parallel_methods
        if self.in_process:
            self.world_size = 1
            self.workers = [worker_cls(0, 1, torch.cuda.is_available())]
        else:
            self.world_size, share = pool.num_workers, 1.0 / pool.max_colocated
            self.workers = [
                ray.remote(worker_cls)
                .options(
                    num_cpus=share,
                    num_gpus=share if pool.use_gpu else 0,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        pool.placement_group, placement_group_bundle_index=rank
                    ),
                )
                .remote(rank, self.world_size, pool.use_gpu)
                for rank in range(self.world_size)
            ]
        try:
            [master] = self._get([self._call(self.workers[0], "master_address")], "setup")
            self.broadcast("setup", master, **setup_kwargs)
        except BaseException:
            self.shutdown()  # give their share of the placement group back
            raise

    def _call(self, worker, method: str, *args, **kwargs):
        """A Ray object ref to the result; in process, the result itself."""
        if self.in_process:
            return getattr(worker, method)(*args, **kwargs)
        return getattr(worker, method).remote(*args, **kwargs)

    def _get(self, refs, method: str) -> list:
        if self.in_process:
            return refs
        # Wait in completion order so that a dead rank is reported at once, not
        # after its peers time out inside a collective.
        rank_of = {ref: rank for rank, ref in enumerate(refs)}
        results, pending = [None] * len(refs), list(refs)
        while pending:
            [ready], pending = ray.wait(pending, num_returns=1)
            try:
                results[rank_of[ready]] = ray.get(ready)
            except DIED as error:
                raise WorkerDied(f"{self.name} worker rank {rank_of[ready]} died during '{method}'") from error
        return results

    def broadcast(self, method: str, *args, **kwargs) -> list:
        """Call `method` with the same arguments on every rank; one result per rank."""
        return self.submit(method, *args, **kwargs).result()

    def submit(self, method: str, *args, **kwargs) -> Pending:
        """broadcast without waiting for it: the ranks start now (in process, the call has already run)."""
        return Pending(self, [self._call(w, method, *args, **kwargs) for w in self.workers], method)

    def scatter(self, method: str, data: DataProto, **kwargs):
        """Split `data` across ranks (padding to a multiple of the world size), call all, reassemble.

        Sequences (rows with an `attention_mask`) are dealt so that every rank gets as many rows and near-equal tokens
        (balanced_parts): the rank with the long answers would otherwise set the pace. The samples of one prompt go to
        one rank where they fit, to share the prompt's tokens there (see shared_prompt_places). With sequence
        parallelism, the ranks of a sequence-parallel group all get the same part, for the methods that split its
        tokens among them (the worker's `sequence_parallel_methods`). DataProto results come back in `data`'s order,
        unpadded; others as a list per part.
        """
        return self.submit_scatter(method, data, **kwargs).result()

    def submit_scatter(self, method: str, data: DataProto, **kwargs) -> Pending:
        """scatter without waiting for it: the ranks start now, and the result is reassembled when asked for."""
        copies = self.sequence_parallel if method in self.sequence_parallel_methods else 1
        count = self.world_size // copies
        padded, pad = data.pad_to_multiple(count)
        if "attention_mask" in padded:
            groups = None
            if "responses" in padded:
                groups = same_prompts(padded["input_ids"], padded["attention_mask"], padded["responses"].shape[1])
            parts = balanced_parts(padded["attention_mask"].sum(-1).tolist(), count, equal_size=True, groups=groups)
        else:
            parts = np.array_split(np.arange(len(padded)), count)
        refs = [self._call(w, method, padded[parts[rank // copies]], **kwargs) for rank, w in enumerate(self.workers)]

        def reassemble(results: list):
            results = results[::copies]  # a sequence-parallel group's ranks return the same
            if isinstance(results[0], DataProto):
                return DataProto.concat(results)[np.argsort(np.concatenate(parts))].unpad(pad)
            return results

        return Pending(self, refs, method, reassemble)

    def shutdown(self) -> None:
        """Kill every rank and wait until each is gone, so that the next group finds its memory free
        (a vLLM engine checks that free memory did not change while it measures its own)."""
        if self.in_process:
            self.workers.clear()
            return
        for worker in self.workers:
            ray.kill(worker)
        for worker in self.workers:
            try:
                ray.get(worker.__ray_ready__.remote())
            except DIED:  # already
                pass


class Pending:
    """A method under way on every rank of a group (WorkerGroup.submit, submit_scatter)."""

    def __init__(self, group: WorkerGroup, refs: list, method: str, reassemble=lambda results: results):
        self.group, self.refs, self.method, self.reassemble = group, refs, method, reassemble

    def result(self):
        """Wait for every rank; the group's result (a rank that died: WorkerDied)."""
        return self.reassemble(self.group._get(self.refs, self.method))


def wait_all(*calls: Pending) -> list:
    """The results of methods under way on several groups whose ranks meet in one collective (the policy sending
    weights, the rollout workers receiving them): a rank that dies in either group is reported at once, not after
    the others time out waiting for it."""
    pending = [ref for call in calls if not call.group.in_process for ref in call.refs]
    while pending:
        [ready], pending = ray.wait(pending, num_returns=1)
        call = next(call for call in calls if ready in call.refs)
        try:
            ray.get(ready)
        except DIED as error:
            rank = call.refs.index(ready)
            raise WorkerDied(f"{call.group.name} worker rank {rank} died during '{call.method}'") from error
    return [call.result() for call in calls]


def balanced_parts(
    weights: list[float], parts: int, equal_size: bool = False, groups: list[int] | None = None
) -> list[np.ndarray]:
    """Indices of `weights` in `parts` parts of near-equal total weight (greedy number partitioning: the heaviest
    item goes to the lightest part), each part in ascending order. With `equal_size`, each part takes
    len(weights) / parts items. With `groups` (one per item), the items of a group go together, the heaviest group
    first, to the lightest part with room; those that do not fit there go on to the next."""
    if equal_size and len(weights) % parts:
        raise ValueError(f"{len(weights)} items do not split into {parts} parts of equal size")
    room = len(weights) // parts if equal_size else len(weights)
    items_of = defaultdict(list)
    for i, group in enumerate(range(len(weights)) if groups is None else groups):
        items_of[group].append(i)
    members, loads = [[] for _ in range(parts)], [0.0] * parts
    for items in sorted(items_of.values(), key=lambda items: -sum(weights[i] for i in items)):
        while items:
            part = min((p for p in range(parts) if len(members[p]) < room), key=lambda p: loads[p])
            taken, items = items[: room - len(members[part])], items[room - len(members[part]) :]
            members[part] += taken
            loads[part] += sum(weights[i] for i in taken)
    return [np.array(sorted(m), dtype=np.int64) for m in members]


def part_loads(weights: list[float], parts: list[np.ndarray]) -> list[float]:
    return [sum(weights[i] for i in part) for part in parts]


# --------------------------------------------------------------------------- FSDP2 workers


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def lr_factor(update: int, warmup_steps: int, decay_steps: int) -> float:
    """The learning rate of the update numbered `update` (from 0), as a share of the peak: a linear rise over
    `warmup_steps` updates, then a cosine from 1 to 0 over `decay_steps` updates (constant 1 without them)."""
    if update < warmup_steps:
        return (update + 1) / warmup_steps
    if not decay_steps:
        return 1.0
    progress = min(1.0, (update - warmup_steps) / decay_steps)
    return 0.5 * (1 + math.cos(math.pi * progress))


class FSDPWorker:
    """What the policy and the critic share: distributed setup, FSDP2 sharding, optimisation."""

    language_model = True  # its output is logits over the vocabulary (see response_outputs)
    packs = True  # its micro-batches may be packed (response_outputs), where the model keeps packed sequences apart
    # FSDP gathers each unit's parameters before its forward and backward and scatters its gradients after: a unit per
    # decoder layer keeps one layer whole at a time. A collective of under a million parameters (4 MB in fp32) costs its
    # latency, not its size, so consecutive layers smaller than that share a unit until it holds that many.
    min_unit_params = 1_000_000
    # What a sequence-parallel group's ranks run together, each on a share of the same micro-batches' tokens.
    sequence_parallel_methods = ("compute_log_prob", "compute_ref_log_prob", "compute_values", "update")

    def __init__(self, rank: int, world_size: int, use_gpu: bool):
        # The pool decides, not torch.cuda.is_available(): recent Ray no longer hides the GPUs from CPU-only actors.
        self.rank, self.world_size = rank, world_size
        self.device = torch.device("cuda", 0) if use_gpu else torch.device("cpu")
        self.phase_peaks: dict[str, float] = {}

    def master_address(self) -> tuple[str, int]:
        return (ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"), _free_port()

    def setup(
        self,
        master,
        model_path: str,
        epochs: int = 1,
        mini_batch_size: int | None = None,
        micro_batch_size: int = 8,
        micro_batch_tokens: int = 0,
        seed: int = 1,
        lr: float = 1e-6,
        weight_decay: float = 0.0,
        lr_warmup_steps: int = 0,
        lr_decay_steps: int = 0,
        max_grad_norm: float = 1.0,
        gradient_checkpointing: bool = False,
        lora_rank: int = 0,
        lora_alpha: int = 16,
        lora_target_modules: str = "all-linear",
        compute_dtype: str = "float32",
        replicate_frozen: bool | None = None,
        sequence_parallel: int = 1,
    ) -> None:
        """Join the process group, load the model (with a LoRA adapter if asked), shard it, build its optimiser.

        Forwards and backwards compute in `compute_dtype` over fp32 master weights (see compute_dtype_for). With LoRA
        the frozen base weights are whole on every rank, in the compute dtype, when `replicate_frozen` (default: when
        they fit, see frozen_weights_fit): they never change, so there is nothing to gather before each forward and
        backward nor to scatter after it.

        An update makes `epochs` passes over its batch, one optimiser step per `mini_batch_size` sequences (over all
        ranks; default the whole batch); every forward and backward takes at most `micro_batch_size` sequences, or with
        `micro_batch_tokens` as many sequences as fit in that many tokens (see micro_batches). The learning rate rises
        linearly over `lr_warmup_steps` updates, then (with `lr_decay_steps`) falls to 0 along a cosine over that many
        more. With `sequence_parallel` N, each N ranks in a row split the same micro-batches' tokens among them (see
        common/sequence_parallel.py), and `mini_batch_size` counts over the world size / N data-parallel groups."""
        self.compute_dtype = compute_dtype_for(compute_dtype, self.device)
        self._init_distributed(master, seed, sequence_parallel)
        self.model_path, self.max_grad_norm, self.lora = model_path, max_grad_norm, lora_rank > 0
        self.epochs, self.mini_batch_size, self.micro_batch_size = epochs, mini_batch_size, micro_batch_size
        self.micro_batch_tokens = micro_batch_tokens
        self.lora_settings = (lora_rank, lora_alpha, lora_target_modules)
        model = self._load(model_path)
        self.layer_classes = set(getattr(model, "_no_split_modules", None) or [])
        if gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if self.lora:
            model = self._add_lora(model)
        frozen = {p for p in model.parameters() if not p.requires_grad} if self.lora else set()
        if replicate_frozen is None:
            replicate_frozen = frozen_weights_fit(frozen, self.compute_dtype, self.device, self.world_size)
        self.model = self._shard(model, replicated=frozen if replicate_frozen else set())
        self._build_optimizer(lr, weight_decay, lr_warmup_steps, lr_decay_steps)
        packings = ["one row"] if self.attention == "flash_attention_2" else ["shared prompts", "rows"]
        self.layout = next((packing for packing in packings if self.packs and self._packs_exactly(packing)), "padded")
        if self.rank == 0:
            packs = self.layout != "padded" or not self.packs
            layout = "" if packs else " (this model's attention lets packed sequences see each other)"
            frozen_layout = f", frozen weights: {'replicated' if replicate_frozen else 'sharded'}" if self.lora else ""
            split = f", sequence parallel: {self.sequence_parallel}" if self.sequence_group is not None else ""
            print(
                f"{type(self).__name__}: {self.world_size} x {self.device.type}, compute: {self.compute_dtype}, "
                f"attention: {self.attention}, "
                f"micro-batches: {self.layout}{layout}{frozen_layout}{split}"
            )

    def _init_distributed(self, master: tuple[str, int], seed: int, sequence_parallel: int = 1) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
            if self.compute_dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
                raise ValueError(f"{torch.cuda.get_device_name()} has no bf16: pass --compute-dtype float32")
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        addr, port = master
        if not dist.is_initialized():
            dist.init_process_group(backend, init_method=f"tcp://{addr}:{port}", rank=self.rank, world_size=self.world_size)
        self.mesh = init_device_mesh(self.device.type, (self.world_size,))  # FSDP shards over every rank
        self.attention = attention_implementation(self.device) if self.compute_dtype == torch.bfloat16 else "sdpa"
        self.sequence_parallel, self.sequence_group = sequence_parallel, None
        if sequence_parallel > 1:
            if self.world_size % sequence_parallel:
                raise ValueError(f"{self.world_size} ranks do not split into sequence-parallel groups of {sequence_parallel}")
            # The ranks as a grid: a row is a sequence-parallel group, a column a data-parallel one.
            shape = (self.world_size // sequence_parallel, sequence_parallel)
            grid = init_device_mesh(self.device.type, shape, mesh_dim_names=("data", "sequence"))
            self.sequence_group, self.attention = grid["sequence"].get_group(), register_sequence_parallel()
        torch.manual_seed(seed + self.rank)
        np.random.seed(seed + self.rank)

    def _load(self, model_path: str):
        # fp32 master weights; FSDP2 casts them to the compute dtype as it gathers them.
        model = self._from_pretrained(model_path, dtype=torch.float32, attn_implementation=self.attention)
        # RL compares log-probs of the same tokens across passes: dropout would make
        # the first importance ratio differ from 1.
        for module in model.modules():
            if isinstance(module, torch.nn.Dropout):
                module.p = 0.0
        return model

    def _shard(self, model, offload: bool = False, replicated: set[torch.nn.Parameter] = frozenset()):
        """FSDP2 over the worker group's ranks, a unit per decoder layer (or several small ones), the rest in the root.
        The `replicated` parameters (frozen) stay whole on every rank, in the compute dtype, outside FSDP."""
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

        on_gpu = self.device.type == "cuda"
        for param in replicated:
            param.data = param.data.to(self.device, self.compute_dtype)
        mp = MixedPrecisionPolicy(param_dtype=self.compute_dtype, reduce_dtype=torch.float32)
        options = dict(
            mesh=self.mesh,
            mp_policy=mp,
            offload_policy=CPUOffloadPolicy() if offload and on_gpu else OffloadPolicy(),
            ignored_params=set(replicated),
        )
        layers, size = [], 0
        for module in list(model.modules()):
            if type(module).__name__ in self.layer_classes:
                layers.append(module)
                size += sum(p.numel() for p in module.parameters())
                if size >= self.min_unit_params:
                    fully_shard(layers, **options)
                    layers, size = [], 0
        fully_shard(model, **options)  # the root: embeddings, norm and head, with the layers left over
        return model

    def _build_optimizer(self, lr: float, weight_decay: float, warmup_steps: int, decay_steps: int) -> None:
        params = [p for p in self.model.parameters() if p.requires_grad]
        # foreach: one call per step for all parameters; on the CPU torch would loop over them, each op a DTensor's
        self.optimizer = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, foreach=True)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: lr_factor(step, warmup_steps, decay_steps)
        )

    def _all_reduce_sum(self, values: list[float]) -> list[float]:
        """The sum over data-parallel groups of each of `values` (the ranks of a sequence-parallel group hold the same)."""
        tensor = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(tensor)
        return (tensor / self.sequence_parallel).tolist()

    @torch.no_grad()
    def _packs_exactly(self, packing: Layout) -> bool:
        """Whether packed micro-batches give this model's padded outputs (transformers keeps packed sequences apart
        for most models): three made-up sequences that share a packed row, two of them a prompt, both ways, in the
        precision it trains in."""
        self.model.eval()
        ids = torch.randint(self.model.config.vocab_size, (3, 12), generator=torch.Generator().manual_seed(0))
        ids[2, :6] = ids[0, :6]
        attention_mask = torch.tensor([[0] * 4 + [1] * 5 + [0] * 3, [0] * 3 + [1] * 6 + [0] * 3, [0] * 4 + [1] * 7 + [0]])
        micro = DataProto.from_dict(
            {
                "input_ids": ids * attention_mask,
                "attention_mask": attention_mask,
                "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0),
                "responses": ids[:, 6:],
            }
        ).to(self.device)
        padded, packed = (
            response_outputs(self.model, micro, p, self.language_model, sequence_group=self.sequence_group).float()
            for p in ("padded", packing)
        )
        if self.language_model:
            padded, packed = torch.log_softmax(padded, -1), torch.log_softmax(packed, -1)
        return (padded - packed).abs().max().item() <= (1e-4 if self.compute_dtype == torch.float32 else 5e-2)

    def micro_batches(self, data: DataProto) -> list[np.ndarray]:
        """The rows of each micro-batch of `data`: `micro_batch_size` rows at a time, or with `micro_batch_tokens`, the
        fewest micro-batches of at most that many tokens each, balanced by tokens (balanced_parts). Every rank takes
        as many micro-batches as the rank that needs most: FSDP's collectives run once per forward on every rank."""
        if not self.micro_batch_tokens:
            return [
                np.arange(i, min(i + self.micro_batch_size, len(data))) for i in range(0, len(data), self.micro_batch_size)
            ]
        lengths = data["attention_mask"].sum(-1).tolist()
        count = math.ceil(sum(lengths) / self.micro_batch_tokens)
        while count < len(lengths) and max(part_loads(lengths, balanced_parts(lengths, count))) > self.micro_batch_tokens:
            count += 1
        return balanced_parts(lengths, int(self._all_reduce_max(count)))

    def _in_micro_batches(self, data: DataProto, forward) -> list[torch.Tensor | None]:
        """`forward(micro_batch)`'s tensors (or Nones) for each micro-batch of `data`, each put together on the CPU in
        the rows' order (micro_batches deals them out of it)."""
        parts = self.micro_batches(data)
        outputs = [forward(data[rows].to(self.device)) for rows in parts]
        order = np.argsort(np.concatenate(parts))
        return [None if pieces[0] is None else torch.cat([piece.cpu() for piece in pieces])[order] for pieces in zip(*outputs)]

    def _update(self, data: DataProto, loss_fn, forward) -> dict:
        """Epochs x mini-batches x micro-batches; one optimiser step per mini-batch.

        `loss_fn(micro_batch, outputs, minibatch_tokens=..., minibatch_seqs=...)` returns (loss, metrics) as this
        micro-batch's share of the mini-batch (the contract is `agg_loss`'s, in the scripts): this only sums the
        shares, all-reduces them over ranks and steps.
        """
        self.model.train()
        per_rank = self.mini_batch_size * self.sequence_parallel // self.world_size if self.mini_batch_size else len(data)
        minis = data.split(per_rank)
        # Every mini-batch's counts over all ranks in one collective: on the CPU each one costs as much as a forward. A
        # sequence the script's rejection masked out whole counts as none, as its tokens do.
        sizes = [(mini["response_mask"].sum().item(), mini["response_mask"].any(-1).sum().item()) for mini in minis]
        counts = self._all_reduce_sum([c for size in sizes for c in size])
        history, all_shares = defaultdict(list), []
        for _ in range(self.epochs):
            for mini, tokens, seqs in zip(minis, counts[::2], counts[1::2]):
                shares = {"loss": 0.0}
                for rows in self.micro_batches(mini):
                    micro = mini[rows].to(self.device)
                    loss, metrics = loss_fn(micro, forward(micro), minibatch_tokens=tokens, minibatch_seqs=seqs)
                    # FSDP averages gradients over ranks; the loss shares add up instead. (The ranks of a
                    # sequence-parallel group compute the same loss, each backward through its own tokens only.)
                    (loss * self.world_size).backward()
                    shares["loss"] += loss.item()
                    for key, value in metrics.items():
                        accumulate(shares, key, float(value))
                all_shares.append(shares)
                grad_norm = self._clip_grad_norm()
                if math.isfinite(grad_norm):
                    self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)
                history["grad_norm"].append(grad_norm)
                history["skipped_updates"].append(float(not math.isfinite(grad_norm)))
        self.scheduler.step()
        keys = sorted(all_shares[0])
        summed = self._all_reduce_sum([shares[key] for shares in all_shares for key in keys])  # each mini-batch's sums
        for i, key in enumerate(keys):
            history[key] = summed[i :: len(keys)]
        metrics = {key: float(np.mean(values)) for key, values in history.items()}
        # Figures named *_max or *_min are extremes: over every micro-batch, mini-batch and rank, in one collective.
        extremes = [(key, 1.0 if key.endswith(MAX) else -1.0) for key in keys if key.endswith((MAX, MIN))]
        if extremes:
            signed = [max(sign * shares[key] for shares in all_shares) for key, sign in extremes]
            tensor = torch.tensor(signed, dtype=torch.float64, device=self.device)
            dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
            metrics |= {key: sign * peak for (key, sign), peak in zip(extremes, tensor.tolist())}
        metrics["skipped_updates"] = float(np.sum(history["skipped_updates"]))
        metrics["lr"] = self.scheduler.get_last_lr()[0]
        return metrics

    def phase_peak_memory(self) -> dict[str, float]:
        """The peak memory (GB) of each method measured since the last call, by name (see `measured`)."""
        peaks, self.phase_peaks = self.phase_peaks, {}
        return peaks

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
        dcp.save(
            {"model": model_state, "optimizer": optim_state, "scheduler": self.scheduler.state_dict()}, checkpoint_id=path
        )
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


def measured(method):
    """A worker method whose peak memory is kept under its name until phase_peak_memory reads it: from its own
    start on a GPU and on Linux, where the high-water mark can be reset (on the CPU the resident set then holds what
    the C allocator kept of the last phase's freed tensors, to reuse: it counts); elsewhere the process's peak so far."""

    @functools.wraps(method)
    def call(self, *args, **kwargs):
        reset_peak_memory(self.device)
        try:
            return method(self, *args, **kwargs)
        finally:
            self.phase_peaks[method.__name__] = max(self.phase_peaks.get(method.__name__, 0.0), peak_memory_gb(self.device))

    return call


def record_peak_memory(metrics: dict, group: str, ranks: list[dict[str, float]]) -> None:
    """Put the peaks that `group`'s ranks returned from phase_peak_memory in `metrics`, as
    `perf/peak_memory_gb/<group>/<method>`: the largest over the ranks and over what `metrics` already holds."""
    for rank in ranks:
        for method, peak in rank.items():
            key = f"perf/peak_memory_gb/{group}/{method}"
            metrics[key] = max(metrics.get(key, 0.0), peak)


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    elif os.path.exists("/proc/self/clear_refs"):
        with open("/proc/self/clear_refs", "w") as clear:
            clear.write("5")  # resets the resident set's high-water mark (VmHWM)


def peak_memory_gb(device: torch.device) -> float:
    """Peak accelerator memory on a GPU, peak resident memory of the process on a CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    if os.path.exists("/proc/self/status"):
        with open("/proc/self/status") as status:
            [kilobytes] = [line.split()[1] for line in status if line.startswith("VmHWM:")]
        return int(kilobytes) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**30  # bytes on macOS


def compute_dtype_for(name: str, device: torch.device) -> torch.dtype:
    """`name` as a dtype; "auto": bf16 where the hardware computes it natively (GPUs, CPUs with AVX512-BF16 or AMX),
    and fp32 elsewhere, where bf16 is emulated."""
    if name != "auto":
        return getattr(torch, name)
    if device.type == "cuda":
        return torch.bfloat16
    native = getattr(torch.cpu, "_is_avx512_bf16_supported", bool)() or getattr(torch.cpu, "_is_amx_tile_supported", bool)()
    return torch.bfloat16 if native else torch.float32


def frozen_weights_fit(frozen: set[torch.nn.Parameter], dtype: torch.dtype, device: torch.device, workers: int) -> bool:
    """Whether whole copies of the frozen weights take at most a quarter of the memory: a GPU's own, or on the CPU
    the machine's, shared by its `workers`. The rest is for the engine, activations, the optimiser and the driver."""
    size = sum(p.numel() for p in frozen) * dtype.itemsize
    if device.type == "cuda":
        return size <= torch.cuda.get_device_properties(device).total_memory / 4
    return size * workers <= machine_memory_bytes() / 4


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
        r=rank,
        lora_alpha=alpha,
        target_modules=target_modules,
        lora_dropout=0.0,
        task_type=task_type,
        modules_to_save=modules_to_save,
    )
    return get_peft_model(model, config)


def pack_rows(lengths: list[int], width: int) -> tuple[list[int], list[int]]:
    """The row and the offset of each sequence in rows of `width` tokens (first-fit decreasing bin packing)."""
    row_of, offset_of, rows, open_rows, shortest = [0] * len(lengths), [0] * len(lengths), 0, [], min(lengths)
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        row = next((row for row in open_rows if row[1] + lengths[i] <= width), None)
        if row is None:
            row, rows = [rows, 0], rows + 1
            open_rows.append(row)
        row_of[i], offset_of[i] = row
        row[1] += lengths[i]
        if width - row[1] < shortest:  # no sequence fits in what is left: stop looking at this row
            open_rows.remove(row)
    return row_of, offset_of


Layout = Literal["padded", "one row", "rows", "shared prompts"]


def response_outputs(
    model, micro: DataProto, layout: Layout, language_model: bool, head_outputs=None, sequence_group=None
) -> torch.Tensor:
    """The model's output (a language model's logits, a critic's values) at the position before each real response
    token: one row per token where `attention_mask`'s response part is 1, the micro-batch's rows one after another.

    "padded": the model runs over the micro-batch's rectangle, padding included. Packed, the sequences' tokens are
    laid end to end with positions restarting per sequence, from which transformers builds attention that never
    crosses a sequence: "one row" holds them all, for flash-attention's variable-length kernel; "rows" fills rows as
    wide as the micro-batch, for kernels that take a dense mask (SDPA), whose cost grows with the square of a row's
    width. "shared prompts" also takes a dense mask, and runs a prompt's tokens once for all its samples in the
    micro-batch (see shared_prompt_places); where no two of them share one, it packs as "rows" (which leaves a row
    that holds one sequence to the causal kernel, with no mask at all). A language model projects to the vocabulary
    only the positions read (see output_layer_at), or gives `head_outputs`' instead of logits. With a
    `sequence_group`, its ranks split the rows' tokens among them (see sequence_parallel_outputs).
    """
    attention_mask = micro["attention_mask"].bool()
    response_length = micro["responses"].shape[1]
    response_mask = attention_mask[:, -response_length:]
    if layout == "padded":
        inputs = {key: micro[key] for key in ("input_ids", "attention_mask", "position_ids")}
        place = torch.arange(attention_mask.numel(), device=attention_mask.device).view(attention_mask.shape)
        causal = False
    else:
        prompts = same_prompts(micro["input_ids"], attention_mask, response_length) if layout == "shared prompts" else []
        if len(set(prompts)) < len(prompts):
            place, width, rows, attention = shared_prompt_places(prompts, attention_mask, response_length)
            causal = False
        else:
            lengths = attention_mask.sum(-1)
            width = int(lengths.sum()) if layout == "one row" else attention_mask.shape[1]
            row_of, offset_of = pack_rows(lengths.tolist(), width)
            start = torch.tensor(row_of, device=lengths.device) * width + torch.tensor(offset_of, device=lengths.device)
            place, rows, attention = start[:, None] + attention_mask.cumsum(-1) - 1, max(row_of) + 1, {}
            causal = max(offset_of) == 0  # each row holds one sequence from its first place, then padding
        tokens = place[attention_mask]  # each token's place in the packed rows, read flat
        inputs = attention | {
            key: micro[key].new_zeros(rows * width).index_put_((tokens,), micro[key][attention_mask]).view(-1, width)
            for key in ("input_ids", "position_ids")  # padding at a row's end sits at position 0: a sequence of its own
        }
    read = place[:, -response_length - 1 : -1][response_mask]
    if sequence_group is not None:
        mask = None if causal else full_attention(inputs)
        return sequence_parallel_outputs(model, inputs, read, mask, language_model, head_outputs, sequence_group)
    if language_model:
        with output_layer_at(model, read, head_outputs):
            return model(**inputs, use_cache=False).logits[0]
    return model(**inputs, use_cache=False).logits.flatten(0, 1)[read]


def sequence_parallel_outputs(model, inputs: dict, read: torch.Tensor, mask, language_model: bool, head_outputs, group):
    """response_outputs' outputs, the rows' tokens split among the ranks of `group` (Ulysses; see
    common/sequence_parallel.py): rank r runs the r-th of as many equal shares of each row's columns (the rows padded
    to a multiple of the ranks), reads the outputs at its own read positions, and every rank gets them all back in
    `read`'s order. `mask`: whom each token of the whole rows sees (None: causal). With `head_outputs`, it is called
    with `tokens=`, the indices of the response tokens (in `read`'s order) whose hidden states it gets."""
    ranks, rank = dist.get_world_size(group), dist.get_rank(group)
    rows, width = inputs["input_ids"].shape
    share = -(-width // ranks)
    pad = share * ranks - width
    if mask is not None and pad:  # a padding token sees itself only
        eye = torch.eye(share * ranks, dtype=torch.bool, device=mask.device)
        mask = torch.nn.functional.pad(mask, (0, pad, 0, pad)) | eye
    columns = slice(rank * share, (rank + 1) * share)
    local = {key: torch.nn.functional.pad(inputs[key], (0, pad))[:, columns] for key in ("input_ids", "position_ids")}
    row, column = read // width, read % width
    owner = column // share
    counts = torch.bincount(owner, minlength=ranks).tolist()
    mine = (owner == rank).nonzero()[:, 0]
    local_read = row[mine] * share + column[mine] - rank * share
    forward = dict(use_cache=False, sequence_parallel=SequenceParallel(group, mask))
    if language_model:
        local_head = None if head_outputs is None else functools.partial(head_outputs, tokens=mine)
        with output_layer_at(model, local_read, local_head):
            outputs = model(**local, **forward).logits[0]
    else:
        outputs = model(**local, **forward).logits.flatten(0, 1)[local_read]
    order = torch.argsort(owner, stable=True)  # the gathered outputs come rank after rank, each in `read`'s order
    return gather_tokens(outputs, counts, group)[torch.argsort(order)]


# Segments of shared prompts may grow this wide (see shared_prompt_places): a token's attention scores, one per
# head and token it sees, then take less memory than its other activations (some fifteen times the hidden size).
SEGMENT_TOKENS = 1024


def same_prompts(input_ids: torch.Tensor, attention_mask: torch.Tensor, response_length: int) -> list[int]:
    """A group per row: rows with the same prompt (the tokens before the last `response_length`) share one."""
    prompt_mask = attention_mask[:, :-response_length]
    prompts = torch.cat([input_ids[:, :-response_length] * prompt_mask, prompt_mask], -1)
    return torch.unique(prompts, dim=0, return_inverse=True)[1].tolist()


def shared_prompt_places(same_prompt: list[int], attention_mask: torch.Tensor, response_length: int):
    """Where each token of a micro-batch goes when the samples of one prompt share its tokens (Liu et al. 2025,
    "Prefix Grouper"): a segment holds a prompt once, then its samples' responses one after another, each response
    attending to the prompt and to itself only, at the positions it has after the prompt. The prompt's last output
    predicts every response's first token. Segments are packed into rows; none grows wider than SEGMENT_TOKENS or, if
    more, than keeps the rows' attention scores (rows x width squared) about those of the padded rectangle.

    `same_prompt`: each row's prompt, as same_prompts gives it. Returns each token's flat place ([rows, width] read
    flat), the width, the number of rows and the model's attention mask, [rows, 1, width, width] (True: may attend),
    as a keyword argument.
    """
    prompt_length = attention_mask.shape[1] - response_length
    prompt_mask, response_mask = attention_mask[:, :prompt_length], attention_mask[:, prompt_length:]
    prompt_lengths, response_lengths = prompt_mask.sum(-1).tolist(), response_mask.sum(-1).tolist()
    # Segments of at most max_width tokens, in rows as wide, hold about as many attention scores as the padded
    # rectangle does when their tokens (each prompt once) fill max_width x rows: shared_tokens x max_width. Up to
    # SEGMENT_TOKENS wide, a token's scores (one per head and token it sees) take less than its other activations.
    shared_tokens = sum(response_lengths) + sum(dict(zip(same_prompt, prompt_lengths)).values())
    padded_width = attention_mask.shape[1]
    max_width = max(padded_width, SEGMENT_TOKENS, attention_mask.numel() * padded_width // shared_tokens)
    segments, open_segment = [], {}  # segments: [rows sharing a prompt]; open_segment: a prompt's last one, its length
    for row, prompt in enumerate(same_prompt):
        members, length = open_segment.get(prompt, (None, 0))
        if members is None or length + response_lengths[row] > max_width:
            members, length = [], prompt_lengths[row]
            segments.append(members)
        members.append(row)
        open_segment[prompt] = (members, length + response_lengths[row])
    lengths = [prompt_lengths[members[0]] + sum(response_lengths[row] for row in members) for members in segments]
    width = max(lengths)
    row_of, offset_of = pack_rows(lengths, width)
    prompt_start, response_start = [0] * len(same_prompt), [0] * len(same_prompt)
    segment_of, part_of = [-1] * len(same_prompt), [0] * len(same_prompt)
    for segment, members in enumerate(segments):
        start = row_of[segment] * width + offset_of[segment]
        end = start + prompt_lengths[members[0]]
        for row in members:
            prompt_start[row], response_start[row], segment_of[row], part_of[row] = start, end, segment, row + 1
            end += response_lengths[row]
    prompt_start, response_start, segment_of, part_of = (
        torch.tensor(v, device=attention_mask.device)[:, None] for v in (prompt_start, response_start, segment_of, part_of)
    )
    place = torch.cat([prompt_start + prompt_mask.cumsum(-1) - 1, response_start + response_mask.cumsum(-1) - 1], -1)
    tokens, size = place[attention_mask], (max(row_of) + 1) * width
    # Each place's segment and part (0: the prompt, else 1 + the response's row); a padding place is a segment alone.
    segment_at = -1 - torch.arange(size, device=attention_mask.device)
    segment_at[tokens] = segment_of.expand_as(attention_mask)[attention_mask]
    part_at = torch.zeros_like(segment_at)
    part_at[place[:, prompt_length:][response_mask]] = part_of.expand_as(response_mask)[response_mask]
    segment_at, part_at = segment_at.view(-1, width), part_at.view(-1, width)
    same_segment = segment_at[:, :, None] == segment_at[:, None, :]
    prompt_or_same_part = (part_at[:, None, :] == 0) | (part_at[:, :, None] == part_at[:, None, :])
    causal = torch.ones(width, width, dtype=torch.bool, device=attention_mask.device).tril()
    mask = same_segment & prompt_or_same_part & causal
    return place, width, max(row_of) + 1, {"attention_mask": mask[:, None]}


@contextmanager
def output_layer_at(model, read: torch.Tensor, head_outputs=None):
    """Apply a language model's output layer only at the flat positions `read` of its [rows, width] hidden states.

    Logits over the whole vocabulary at every position are a pass's largest tensor (a 49k vocabulary makes 196 kB per
    token in fp32, against 2 kB of hidden state for a 576-wide model), yet only the tokens before a response's are read:
    the rest, prompts and padding, would cost compute and memory for nothing. The logits come back as one row; with
    `head_outputs(hidden, output_layer)`, what it returns for those positions' hidden states comes back in their place
    (see chunked_log_probs).
    """
    head = model.get_output_embeddings()
    output_layer = head.forward

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        hidden = hidden.flatten(0, 1)[read]
        return (output_layer(hidden) if head_outputs is None else head_outputs(hidden, output_layer))[None]

    head.forward = forward
    try:
        yield
    finally:
        del head.forward  # the class's own again


def chunked_log_probs(
    hidden: torch.Tensor,
    output_layer,
    responses: torch.Tensor,
    temperature: float,
    with_entropy: bool,
    chunk_tokens: int,
    tokens: torch.Tensor | None = None,
) -> torch.Tensor:
    """Log-probs of `responses` (and entropies), [tokens, 2 or 1], from the hidden states before them: the logits over
    the vocabulary for `chunk_tokens` tokens at a time (all at once with 0). With gradients and more than one chunk,
    backward computes each chunk's logits again (activation checkpointing) instead of keeping them: at most one
    chunk's logits exist at any time, not [tokens, vocabulary] in fp32, a response of 16k tokens' 3 GB per copy for a
    49k vocabulary. `tokens`: which of `responses` the hidden states are before (default: all)."""
    from torch.utils.checkpoint import checkpoint

    def log_probs_of(hidden: torch.Tensor, responses: torch.Tensor) -> torch.Tensor:
        log_probs, entropy = _response_log_probs(output_layer(hidden), responses, temperature, with_entropy)
        return torch.stack([log_probs, entropy], -1) if with_entropy else log_probs[:, None]

    responses = responses if tokens is None else responses[tokens]
    size = chunk_tokens or max(len(hidden), 1)
    chunks = [slice(start, start + size) for start in range(0, max(len(hidden), 1), size)]  # one, empty, for no tokens
    if torch.is_grad_enabled() and len(chunks) > 1:
        return torch.cat([checkpoint(log_probs_of, hidden[c], responses[c], use_reentrant=False) for c in chunks])
    return torch.cat([log_probs_of(hidden[c], responses[c]) for c in chunks])


@torch.no_grad()
def head_outputs_pass_through(model, device: torch.device) -> bool:
    """Whether what the output layer returns is the model's output unchanged (chunked_log_probs takes its place):
    not so where the model changes its logits after the layer (Gemma 2's soft-capping, Granite's scaling)."""
    read = torch.arange(3, device=device)
    marks = torch.arange(1.0, 4.0, device=device)[:, None]
    with output_layer_at(model, read, lambda hidden, output_layer: marks):
        outputs = model(input_ids=torch.ones(1, 3, dtype=torch.long, device=device), use_cache=False).logits[0]
    return torch.equal(outputs.float(), marks)


def rows_of(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """`values`, one per true entry of `mask`, back in `mask`'s shape with 0 elsewhere."""
    return values.new_zeros(mask.shape).masked_scatter(mask, values)


def _response_log_probs(logits: torch.Tensor, responses: torch.Tensor, temperature: float, with_entropy: bool):
    logits = logits.float() / temperature
    log_probs = torch.log_softmax(logits, dim=-1)
    token_log_probs = log_probs.gather(-1, responses.unsqueeze(-1)).squeeze(-1)
    entropy = -(log_probs.exp() * log_probs).sum(-1) if with_entropy else None
    return token_log_probs, entropy


def engine_placement(worker, master) -> dict:
    """Where a worker's vLLM engine sits: its rank in the worker's group, whose rendezvous is `master`, and its device."""
    return dict(rank=worker.rank, world_size=worker.world_size, master=master, on_gpu=worker.device.type == "cuda")


class PolicyWorker(FSDPWorker):
    """The hybrid engine: trainable policy, rollout engine and reference in one process."""

    sequence_parallel_methods = (*FSDPWorker.sequence_parallel_methods, "probe_log_probs")

    trains = True  # else its rollout engine keeps the weights it loaded, never sent the model's

    def _from_pretrained(self, model_path: str, **kwargs):
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_pretrained(model_path, **kwargs)

    def _add_lora(self, model):
        return _lora(model, *self.lora_settings, "CAUSAL_LM")

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
        **settings,
    ) -> None:
        """The policy (see FSDPWorker.setup), its rollout engine (common/rollout.py; none: `rollout_engine` None), and
        the reference.

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
        elif rollout_engine == "hf":
            self.rollout = HFRollout(self.model, self.tokenizer, self.eos_token_ids, self.pad_token_id)
        else:
            self.rollout = VLLMRollout(
                self.model,
                self.optimizer,
                self.eos_token_ids,
                self.pad_token_id,
                model_path=model_path,
                **engine_placement(self, master),
                seed=settings.get("seed", 1),
                dtype=getattr(torch, rollout_dtype),
                gpu_memory_utilization=rollout_gpu_memory_utilization,
                max_model_len=max_model_len,
                lora_sync=lora_sync,
                offload=offload,
                frozen=not self.trains,
            )

    @measured
    @torch.no_grad()
    def generate(
        self,
        data: DataProto,
        max_response_length: int,
        do_sample: bool = True,
        top_p: float = 1.0,
        top_k: int = 0,
        stop_strings: list[str] | None = None,
    ) -> DataProto:
        """Sample (or greedily decode) one response per left-padded prompt, each ending at EOS, at the token that
        completes one of `stop_strings` (padded after it) or after `max_response_length` tokens; see
        rollout.response_batch for what returns."""
        prompts, prompt_mask = data["prompts"].to(self.device), data["prompt_mask"].to(self.device)
        sampling = dict(do_sample=do_sample, temperature=self.temperature, top_p=top_p, top_k=top_k, stop_strings=stop_strings)
        responses, log_probs = self.rollout.generate(prompts, prompt_mask, max_response_length, **sampling)
        return response_batch(
            prompts, prompt_mask, responses, log_probs, max_response_length, self.eos_token_ids, self.pad_token_id
        )

    def _forward(self, model, micro: DataProto, with_entropy: bool):
        """Log-probs (and entropies) of the response tokens, 0 on padding."""
        response_mask = micro["attention_mask"][:, -micro["responses"].shape[1] :].bool()
        responses = micro["responses"][response_mask]
        if self.log_prob_chunk_tokens is None:
            logits = response_outputs(model, micro, self.layout, True, sequence_group=self.sequence_group)
            log_probs, entropy = _response_log_probs(logits, responses, self.temperature, with_entropy)
        else:
            chunked = functools.partial(
                chunked_log_probs,
                responses=responses,
                temperature=self.temperature,
                with_entropy=with_entropy,
                chunk_tokens=self.log_prob_chunk_tokens,
            )
            outputs = response_outputs(model, micro, self.layout, True, chunked, self.sequence_group)
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
        with self.model.disable_adapter() if self.lora else nullcontext():
            log_probs, _ = self._log_probs(data, self.model if self.lora else self.reference, with_entropy=False)
            # PEFT turns the adapter's gradients back on as it leaves: on the sharded parameters, not on the whole
            # ones a unit holds after its forward (the root's), which FSDP drops at the next reshard.
            self.model.reshard()
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
        return self._update(data, loss_fn, lambda micro: self._forward(self.model, micro, with_entropy=True))

    def adapter_config(self):
        """The LoRA adapter's PEFT config, for a rollout worker that will serve it."""
        return self.model.peft_config[weight_sync.ADAPTER]

    def join_weight_group(self, address: tuple[str, int], size: int) -> None:
        """Rank 0 joins the rollout workers' weight group (see weight_sync.join_group); the others only gather."""
        from concurrent.futures import ThreadPoolExecutor

        if self.rank == 0:
            self.weight_group = weight_sync.join_group(address, 0, size, self.device)
            self.sender, self.sending = ThreadPoolExecutor(max_workers=1), None

    @measured
    def send_weights(self, adapter: bool) -> None:
        """The policy as it is now, to every rollout worker: its LoRA adapter alone, or every weight (an adapter
        merged in). A collective: every rank gathers. Rank 0 copies them to CPU memory and sends the copy from a
        thread, which the engines join when they are done with what they are generating: the policy trains meanwhile.
        One version at a time: the next waits until the engines took this one."""
        weights = weight_sync.engine_adapter(self.model).items() if adapter else weight_sync.engine_weights(self.model)
        if self.rank != 0:
            for _ in weights:  # the gathers of every unit
                pass
            return
        if self.sending is not None:
            self.sending.result()  # raises what went wrong in the thread
        copy = [(name, tensor.to("cpu", copy=True)) for name, tensor in weights]
        self.sending = self.sender.submit(weight_sync.send_tensors, self.weight_group, copy, self.device)

    @torch.no_grad()
    def probe_log_probs(self, data: DataProto) -> DataProto:
        """compute_log_prob at temperature 1, as a vLLM engine scores a given sequence (see Run._send_weights)."""
        temperature, self.temperature = self.temperature, 1.0
        try:
            return self.compute_log_prob(data)
        finally:
            self.temperature = temperature


class CriticWorker(FSDPWorker):
    """A value model: the policy's architecture with a scalar head over every token (see FSDPWorker.setup)."""

    language_model = False

    def _from_pretrained(self, model_path: str, **kwargs):
        from transformers import AutoModelForTokenClassification

        return AutoModelForTokenClassification.from_pretrained(model_path, num_labels=1, **kwargs)

    def _add_lora(self, model):
        # The value head is new: it trains in full beside the adapter.
        return _lora(model, *self.lora_settings, "TOKEN_CLS", modules_to_save=["score"])

    def _forward(self, micro: DataProto) -> torch.Tensor:
        """The value of the state before each response token, 0 on padding."""
        response_mask = micro["attention_mask"][:, -micro["responses"].shape[1] :].bool()
        values = response_outputs(self.model, micro, self.layout, False, sequence_group=self.sequence_group)[:, 0]
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
        return self._update(data, loss_fn, self._forward)


class RewardModelWorker(FSDPWorker):
    """A reward model: a sequence-classification model with one label, sharded like the policy, that scores and never
    trains (see FSDPWorker.setup). Its score of a sequence is its head's output at the sequence's last token."""

    language_model = False
    packs = False  # it reads each sequence's last token from the padded rectangle

    def _from_pretrained(self, model_path: str, **kwargs):
        from transformers import AutoModelForSequenceClassification

        model = AutoModelForSequenceClassification.from_pretrained(model_path, **kwargs)
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
            log_probs = torch.log_softmax(response_outputs(self.model, micro, self.layout, language_model=True).float(), -1)
            verdicts = [log_probs[:, yes_ids].logsumexp(-1), log_probs[:, no_ids].logsumexp(-1)]
            return torch.stack(verdicts, -1), log_probs.argmax(-1)

        verdicts, top_tokens = self._in_micro_batches(data, forward)
        return DataProto.from_dict({"verdict_log_probs": verdicts, "top_tokens": top_tokens})


class RolloutWorker:
    """A rollout engine in a process of its own (split placement, --rollout-workers): it generates from the weights the
    policy last sent it (see PolicyWorker.send_weights) and tags every sample with their version, the number of
    updates they had had. The engines of a group form a torch.distributed group of their own, which vLLM's external
    launcher joins as the policy's engines join the policy's."""

    sequence_parallel_methods = ()
    master_address = FSDPWorker.master_address
    phase_peak_memory = FSDPWorker.phase_peak_memory

    def __init__(self, rank: int, world_size: int, use_gpu: bool):
        self.rank, self.world_size = rank, world_size
        self.device = torch.device("cuda", 0) if use_gpu else torch.device("cpu")
        self.phase_peaks: dict[str, float] = {}
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
        from transformers import AutoModelForCausalLM, AutoTokenizer

        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        addr, port = master
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=f"tcp://{addr}:{port}", rank=self.rank, world_size=self.world_size)
        torch.manual_seed(seed + self.rank)
        self.temperature, self.adapter_config = temperature, adapter_config
        tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.eos_token_ids = eos_token_ids(model_path, tokenizer)
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_token_ids[0]
        if rollout_engine == "hf":
            dtype = compute_dtype_for(compute_dtype, self.device)
            self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).to(self.device).eval()
            self.rollout = HFRollout(self.model, tokenizer, self.eos_token_ids, self.pad_token_id)
            return
        self.rollout = VLLMRollout(
            None,
            None,
            self.eos_token_ids,
            self.pad_token_id,
            model_path=model_path,
            **engine_placement(self, master),
            seed=seed,
            dtype=getattr(torch, rollout_dtype),
            gpu_memory_utilization=rollout_gpu_memory_utilization,
            max_model_len=max_model_len,
            lora_sync="adapter" if adapter_config is not None else "merged",
            adapter_config=adapter_config,
        )

    def join_weight_group(self, address: tuple[str, int], size: int) -> None:
        """Join the policy's rank 0 in the weight group, as rank 1 and up (see weight_sync.join_group)."""
        self.weight_group = weight_sync.join_group(address, self.rank + 1, size, self.device)

    @measured
    @torch.no_grad()
    def receive_weights(self, version: int, probe: list[int], answer_length: int) -> torch.Tensor:
        """Load what the policy's rank 0 sends (PolicyWorker.send_weights): from now on the engine generates from
        version `version`. Every weight the engine has must arrive, or it would generate from stale ones. Returns the
        log-probs at temperature 1 of the last `answer_length` tokens of `probe`, each after those before it, as the
        engine now computes them (see Run._send_weights)."""
        self.idle += time.perf_counter() - self.idle_since
        weights = weight_sync.received_tensors(self.weight_group, self.device)
        if self.adapter_config is not None:
            self.rollout.load_adapter(dict(weights), self.adapter_config)
        elif isinstance(self.rollout, VLLMRollout):
            self.rollout.load_weights(weights)
        else:
            params = dict(self.model.named_parameters(remove_duplicate=False))
            received = set()
            for name, tensor in weights:  # to the end of the stream, whatever arrives: the sender waits for it
                if name in params:
                    params[name].copy_(tensor)
                    received.add(name)
            missing = sorted(set(params) - received)
            if missing:
                raise RuntimeError(f"the rollout worker received no weights for {missing}: it would generate with stale ones")
        self.version = version
        probe_log_probs = self.probe_log_probs(probe, answer_length)
        self.idle_since = time.perf_counter()
        return probe_log_probs

    @torch.no_grad()
    def probe_log_probs(self, tokens: list[int], answer_length: int) -> torch.Tensor:
        """The log-probs at temperature 1 of the last `answer_length` of `tokens`, each after those before it."""
        if isinstance(self.rollout, VLLMRollout):
            return self.rollout.prompt_log_probs(tokens)[-answer_length:]
        logits = self.model(torch.tensor([tokens], device=self.device)).logits[0, -answer_length - 1 : -1].float()
        answer = torch.tensor(tokens[-answer_length:], device=self.device)
        return torch.log_softmax(logits, dim=-1).gather(-1, answer[:, None]).squeeze(-1).cpu()

    def generate(self, data: DataProto, max_response_length: int, **sampling) -> DataProto:
        """PolicyWorker.generate from this engine, each sample tagged with its `weight_version` and the seconds the
        engine had waited, for prompts or weights, since its last batch (`engine_idle_s`)."""
        self.idle += time.perf_counter() - self.idle_since
        batch = PolicyWorker.generate(self, data, max_response_length, **sampling)
        batch["weight_version"] = torch.full((len(batch),), self.version)
        batch["engine_idle_s"], self.idle = torch.full((len(batch),), self.idle), 0.0
        self.idle_since = time.perf_counter()
        return batch
