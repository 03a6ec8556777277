"""The FSDP2 worker: what the policy, the critic and the scoring models share (common/workers.py).

Each rank joins the group's torch.distributed group, loads the model in fp32 (with a LoRA adapter if asked), shards
it with FSDP2 over the ranks, and computes in bf16 or fp32 over those master weights. It runs a pass over a batch in
micro-batches laid out as common/layouts.py packs them, and updates with a loss that arrives from the script as a
plain function: it knows no algorithm.
"""

from __future__ import annotations

import math
import os
from collections import defaultdict
from functools import partial
from typing import ClassVar

import numpy as np
import torch
import torch.distributed as dist

from common.attention import ATTENTION as FLEX
from common.attention import VARLEN, choose, flash_attn_loads, flex_from, register_varlen, varlen_kernel
from common.attention import available as flex_available
from common.attention import register as register_flex
from common.dataproto import DataProto
from common.layouts import Layout, balanced_parts, packing_gap, part_loads
from common.loading import fill_shards, init_missing, replay_lora_init, safetensors_files
from common.memory import machine_memory_bytes, peak_memory_gb, restart_peak_memory
from common.micro_batch_budget import MemoryBudget, made_up_sequence
from common.sequence_parallel import ATTENTION as ULYSSES
from common.sequence_parallel import register as register_sequence_parallel
from common.update_metrics import MAX, MIN, accumulate
from common.worker_group import Worker


def lr_factor(update: int, warmup_steps: int, decay_steps: int) -> float:
    """The learning rate of the update numbered `update` (from 0), as a share of the peak: a linear rise over
    `warmup_steps` updates, then a cosine from 1 to 0 over `decay_steps` updates (constant 1 without them)."""
    if update < warmup_steps:
        return (update + 1) / warmup_steps
    if not decay_steps:
        return 1.0
    progress = min(1.0, (update - warmup_steps) / decay_steps)
    return 0.5 * (1 + math.cos(math.pi * progress))


class FSDPWorker(Worker):
    """What the policy and the critic share: distributed setup, FSDP2 sharding, optimisation, micro-batches sized to
    the memory (its MemoryBudget, `budget`)."""

    language_model = True  # its output is logits over the vocabulary (see response_outputs)
    packs = True  # its micro-batches may be packed (response_outputs), where the model keeps packed sequences apart
    # FSDP gathers each unit's parameters before its forward and backward and scatters its gradients after: a unit per
    # decoder layer keeps one layer whole at a time. A collective of under a million parameters (4 MB in fp32) costs its
    # latency, not its size, so consecutive layers smaller than that share a unit until it holds that many.
    min_unit_params = 1_000_000
    # What a sequence-parallel group's ranks run together, each on a share of the same micro-batches' tokens.
    sequence_parallel_methods = ("compute_log_prob", "compute_ref_log_prob", "compute_values", "update")

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
        self.budget = MemoryBudget(micro_batch_tokens, self.device, self._all_reduce_max, type(self).__name__)
        # FlexAttention where SDPA would take a dense mask (see set_up_block_masks); SDPA until a forward gets a block mask
        if self.attention == "sdpa" and flex_available():
            self.attention = register_flex()
        self.lora_settings = (lora_rank, lora_alpha, lora_target_modules)
        model = self._load(model_path)
        self.layer_classes = set(getattr(model, "_no_split_modules", None) or [])
        if gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if self.lora:
            model = self._with_lora(model)
        frozen = {p for p in model.parameters() if not p.requires_grad} if self.lora else set()
        if replicate_frozen is None:
            replicate_frozen = frozen_weights_fit(frozen, self.compute_dtype, self.device, self.world_size)
        self.model = self._shard(model, replicated=frozen if replicate_frozen else set())
        self._build_optimizer(lr, weight_decay, lr_warmup_steps, lr_decay_steps)
        packings = ["one row"] if self.attention in ("flash_attention_2", VARLEN) else ["shared prompts", "rows"]
        self.layout = next((packing for packing in packings if self.packs and self._packs_exactly(packing)), "padded")
        self.flex_from = None
        self.set_up_block_masks(micro_batch_tokens)
        self._report_setup(replicate_frozen)

    def _report_setup(self, replicate_frozen: bool) -> None:
        """Rank 0 prints one line of how the workers compute: devices, dtype, attention kernel, micro-batch layout."""
        if self.rank != 0:
            return
        frozen_layout = f", frozen weights: {'replicated' if replicate_frozen else 'sharded'}" if self.lora else ""
        split = f", sequence parallel: {self.sequence_parallel}" if self.sequence_group is not None else ""
        print(
            f"{type(self).__name__}: {self.world_size} x {self.device.type}, compute: {self.compute_dtype}, "
            f"attention: {self.attention_kernel}, "
            f"micro-batches: {self.layout}{frozen_layout}{split}"
        )

    def _init_distributed(self, master: tuple[str, int], seed: int, sequence_parallel: int = 1) -> None:
        from torch.distributed.device_mesh import init_device_mesh

        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
            if self.compute_dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
                raise ValueError(f"{torch.cuda.get_device_name()} has no bf16: pass --compute-dtype float32")
        if not dist.is_initialized():
            self.join_process_group(master)
        self.mesh = init_device_mesh(self.device.type, (self.world_size,))  # FSDP shards over every rank
        self.attention = attention_implementation(self.device, self.compute_dtype)
        if self.attention == VARLEN:
            register_varlen()
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

    auto_model = "AutoModelForCausalLM"  # the transformers class that builds the model from its folder
    model_kwargs: ClassVar[dict] = {}  # what its config takes beyond the folder's

    def _from_pretrained(self, model_path: str, empty: bool = False, **kwargs):
        """The model of `model_path` with its weights, or with `empty` built on the meta device without them."""
        import transformers

        auto = getattr(transformers, self.auto_model)
        if not empty:
            return self._checked(auto.from_pretrained(model_path, **self.model_kwargs, **kwargs), model_path)
        config = transformers.AutoConfig.from_pretrained(model_path, **self.model_kwargs)
        with torch.device("meta"):
            return self._checked(auto.from_config(config, **kwargs), model_path)

    def _checked(self, model, model_path: str):
        """`model`, once it is the kind of model this worker needs (a subclass says what it requires)."""
        return model

    def _load(self, model_path: str):
        """The model on the meta device, its weights to be read by _shard, each rank only its shards (common/loading.py);
        from a folder without safetensors files, loaded whole on every rank instead, as torch.load reads a .bin."""
        # fp32 master weights; FSDP2 casts them to the compute dtype as it gathers them.
        settings = {"dtype": torch.float32, "attn_implementation": self.attention}
        checkpoint = safetensors_files(model_path)
        if checkpoint is None:
            if self.rank == 0:
                print(f"{type(self).__name__}: {model_path} has no safetensors files: every rank loads the whole model")
            model = self._from_pretrained(model_path, **settings)
        else:
            model = self._from_pretrained(model_path, empty=True, **settings)
            init_missing(model, checkpoint)
        # RL compares log-probs of the same tokens across passes: dropout would make
        # the first importance ratio differ from 1.
        for module in model.modules():
            if isinstance(module, torch.nn.Dropout):
                module.p = 0.0
        return model

    def _with_lora(self, model):
        """`model` with its LoRA adapter; on the meta device, with the values PEFT draws for it on the CPU."""
        rng = torch.get_rng_state()
        model = self._add_lora(model)
        if any(p.is_meta for p in model.parameters()):
            torch.set_rng_state(rng)
            replay_lora_init(model)
        return model

    def _shard(self, model, offload: bool = False, replicated: set[torch.nn.Parameter] = frozenset()):
        """FSDP2 over the worker group's ranks, a unit per decoder layer (or several small ones), the rest in the root.
        The `replicated` parameters (frozen) stay whole on every rank, in the compute dtype, outside FSDP."""
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

        on_gpu = self.device.type == "cuda"
        for param in replicated:  # (on the meta device until fill_shards reads them)
            param.data = param.data.to("meta" if param.is_meta else self.device, self.compute_dtype)
        mp = MixedPrecisionPolicy(param_dtype=self.compute_dtype, reduce_dtype=torch.float32)
        options = {
            "mesh": self.mesh,
            "mp_policy": mp,
            "offload_policy": CPUOffloadPolicy() if offload and on_gpu else OffloadPolicy(),
            "ignored_params": set(replicated),
        }
        layers, size = [], 0
        for module in list(model.modules()):
            if type(module).__name__ in self.layer_classes:
                layers.append(module)
                size += sum(p.numel() for p in module.parameters())
                if size >= self.min_unit_params:
                    fully_shard(layers, **options)
                    layers, size = [], 0
        fully_shard(model, **options)  # the root: embeddings, norm and head, with the layers left over
        if any(p.is_meta for p in model.parameters()):
            files = safetensors_files(self.model_path)
            fill_shards(model, files, self.rank, self.world_size, self.device, offloaded=offload and on_gpu)
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

    @property
    def attention_kernel(self) -> str:
        """The attention kernel by name, as the start-up line and the device check say it."""
        kernels = {"flash_attention_2": "flash-attn (varlen)", VARLEN: "torch varlen (FlashAttention)", FLEX: "sdpa"}
        blocks = "" if self.flex_from is None else f" (block masks from {self.flex_from} tokens wide)"
        return kernels.get(self.attention, self.attention) + blocks

    def set_up_block_masks(self, widest: int) -> None:
        """Block masks for packed rows from flex_from's width on, where this worker's rows may be `widest` tokens wide
        and its start-up check passes (_flex_packs_exactly); once set up, they stay. A row of packed sequences is at
        most as wide as the longest one ("rows", "shared prompts" within their segments' share of the rectangle), so
        setup decides from its micro-batch tokens and fit_micro_batch_tokens again from the longest sequence, whatever
        setup was given; "one row" (flash kernels) takes no mask at all."""
        if self.flex_from is not None or self.attention not in (FLEX, ULYSSES) or self.layout == "padded":
            return
        width = flex_from(self.device, widest)
        if width is not None and self._flex_packs_exactly():
            self.flex_from = width

    def _flex_packs_exactly(self) -> bool:
        """Whether the packed micro-batches give the padded outputs through block masks too (_packs_exactly). Where
        they do not, or FlexAttention cannot run here (torch.compile finds no C++ compiler on the CPU, no Triton on
        the GPU, or no kernel fits this model's attention), SDPA keeps the dense mask."""
        try:
            return self._packs_exactly(self.layout, flex_from=0)
        except Exception as error:  # a compiler's failure, raised alike on every rank
            if self.rank == 0:
                print(f"{type(self).__name__}: FlexAttention does not run here ({type(error).__name__}): dense masks instead")
            return False

    def _packs_exactly(self, packing: Layout, flex_from: int | None = None) -> bool:
        """Whether packed micro-batches stand in for padded ones with this model (layouts.packing_gap, in the precision
        it trains in; transformers keeps packed sequences apart for most models); packed rows from `flex_from` tokens
        wide through block masks. Rank 0 says why not."""
        self.model.eval()
        gap = packing_gap(self.model, packing, self.language_model, self.compute_dtype, self.sequence_group, flex_from)
        if gap is not None and self.rank == 0:
            print(f"{type(self).__name__}: {gap}{'' if flex_from is None else ' (block masks)'}")
        return gap is None

    def micro_batches(self, data: DataProto) -> list[np.ndarray]:
        """The rows of each micro-batch of `data`: `micro_batch_size` rows at a time, or with `micro_batch_tokens`, the
        fewest micro-batches of at most that many tokens each, balanced by tokens (balanced_parts). Every rank takes
        as many micro-batches as the rank that needs most: FSDP's collectives run once per forward on every rank."""
        budget = self.budget.tokens
        if not budget:
            return [
                np.arange(i, min(i + self.micro_batch_size, len(data))) for i in range(0, len(data), self.micro_batch_size)
            ]
        lengths = data["attention_mask"].sum(-1).tolist()
        count = math.ceil(sum(lengths) / budget)
        while count < len(lengths) and max(part_loads(lengths, balanced_parts(lengths, count))) > budget:
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
                gradients = partial(self._gradients, mini, loss_fn, forward, tokens, seqs)
                all_shares.append(self.budget.within(gradients, self._drop_gradients, speaks=self.rank == 0))
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
        return metrics | self.budget.metrics()

    def _gradients(self, mini: DataProto, loss_fn, forward, tokens: float, seqs: float) -> dict:
        """The gradients of mini-batch `mini` (of `tokens` and `seqs` over all ranks), added up over its micro-batches;
        the loss shares and metrics of the script's loss, summed."""
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
        return shares

    def _all_reduce_max(self, value: float) -> float:
        tensor = torch.tensor([value], dtype=torch.float64, device=self.device)
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
        return tensor.item()

    def _drop_gradients(self) -> None:
        """What a mini-batch cut short by running out of memory leaves: its gradients, and its units gathered."""
        from torch.distributed.fsdp import FSDPModule

        self.optimizer.zero_grad(set_to_none=True)
        for module in self.model.modules():
            if isinstance(module, FSDPModule):
                module.reshard()

    def keep_memory_within(self, share: float, colocated: int) -> int:
        """From now on, keep updates within `share` of the memory, split among the `colocated` groups' processes that
        share it (MemoryBudget.keep_within). Returns the limit in bytes."""
        return self.budget.keep_within(share, colocated, self.world_size)

    def fit_micro_batch_tokens(self, max_prompt_length: int, max_response_length: int) -> dict[str, float]:
        """Set the micro-batch token budget to what keeps an update within the memory limit (keep_memory_within), from
        a forward and backward (the outputs' sum as the loss) over a made-up sequence half as long as the longest
        prompt and response, then one that long (MemoryBudget.fit): no optimiser step, and the gradients dropped after
        each. AdamW's state, made at its first step, and its step's temporaries count as three copies of the trainable
        weights. Rank 0 prints the budget. Returns this rank's budget and measurements, in tokens and bytes."""
        longest = max_prompt_length + max_response_length
        # Rows as wide as the longest sequence, whatever setup was told; decided first, so that what the block masks'
        # check leaves in memory (FlexAttention's compiled kernels) is in the measurement
        self.set_up_block_masks(longest)
        vocab_size = self.model.config.vocab_size
        half = made_up_sequence(vocab_size, max(1, max_prompt_length // 2), max(1, max_response_length // 2))
        whole = made_up_sequence(vocab_size, max_prompt_length, max_response_length)
        try:
            self._probe_peak(half)  # what a first pass makes once (FSDP's buffers, autograd's threads) is no activation
            probes = [(half["input_ids"].shape[1], self._probe_peak(half)), (longest, self._probe_peak(whole))]
        except torch.OutOfMemoryError as error:
            raise ValueError(self.budget.does_not_fit(longest, "ran out of the GPU's memory")) from error
        trainable = [p for p in self.model.parameters() if p.requires_grad]
        weight_bytes = sum((p.to_local() if hasattr(p, "to_local") else p).nbytes for p in trainable)
        # AdamW's two moments once it has stepped, and its step's foreach temporaries, about one more copy.
        optimizer_bytes = (0 if self.optimizer.state else 2 * weight_bytes) + weight_bytes
        fitted = self.budget.fit(probes, optimizer_bytes, longest)
        if self.rank == 0:
            print(
                f"{type(self).__name__}: micro-batches of at most {fitted['tokens']} tokens (--micro-batch-tokens auto): "
                f"an update measured {fitted['fixed_bytes'] / 2**30:.2f} GB + {fitted['per_token_bytes'] / 2**20:.3f} MB "
                f"per token, with {optimizer_bytes / 2**30:.2f} GB for the optimiser, within "
                f"{fitted['limit_bytes'] / 2**30:.2f} GB a worker; attention: {self.attention_kernel}",
                flush=True,
            )
        return fitted

    def _probe_peak(self, sequence: DataProto) -> float:
        """The peak bytes of one forward and backward of the update over `sequence`; its gradients are then dropped."""
        self.model.train()
        restart_peak_memory(self.device, live_only=True)
        outputs = self._update_forward(sequence.to(self.device))
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        sum(output.float().sum() for output in outputs if output is not None).backward()
        peak = peak_memory_gb(self.device) * 2**30
        self.model.zero_grad(set_to_none=True)
        self.model.reshard()
        return peak

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


def attention_implementation(device: torch.device, dtype: torch.dtype = torch.bfloat16) -> str:
    """The attention this machine gives a worker on `device` computing in `dtype` (attention.choose): flash-attn's or
    PyTorch's varlen FlashAttention on a GPU from Ampere in bf16, SDPA otherwise."""
    capability = torch.cuda.get_device_capability(device)[0] if device.type == "cuda" else 0
    on_gpu = capability >= 8
    return choose(device.type, capability, dtype, on_gpu and flash_attn_loads(), varlen_kernel() is not None)


def lora_model(model, rank: int, alpha: int, target_modules: str, task_type: str, modules_to_save: list[str] | None = None):
    """`model` with a LoRA adapter of `rank` on `target_modules`; `modules_to_save` train in full beside it."""
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
