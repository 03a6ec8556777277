"""Sharded loading: each rank reads from the model's safetensors files only the rows of each weight that it owns.

The model is built on the meta device (shapes, no storage), given its LoRA adapter there, and sharded by FSDP2; only
then does each rank allocate its shards and fill them. FSDP2 shards every weight on dim 0 (`Shard(0)`), so a rank's
share of a weight is one contiguous range of its rows, which safetensors' `safe_open(...).get_slice` reads from the
memory-mapped file without reading the rest. Why each rank reads its own slices rather than rank 0 loading the model
and sending each rank its shards: no process, rank 0 included, ever holds more than its share (plus one weight's
slice in the file's dtype), and the ranks read in parallel from the page cache that the ones on a node share; rank 0
loading would hold the whole model in one process and send every byte once more over the network.

What is not in the files is made as from_pretrained makes it, in the same order, so every rank draws the same random
numbers as it did when it loaded the whole model: the weights a checkpoint lacks (a critic's or reward model's new
value head: whole on every rank, initialised by the model's own `_init_weights`, then sharded), the LoRA adapter
(PEFT's initialisation replayed on each adapter, see replay_lora_init), and the buffers no file holds (rotary
`inv_freq`, computed by `_init_weights`). A model folder without safetensors files (a `pytorch_model.bin`) loads whole
as before (see FSDPWorker._load).
"""

from __future__ import annotations

import json
import math
import os

import torch


def safetensors_files(model_path: str) -> dict[str, str] | None:
    """Which file of `model_path` holds each weight: one `model.safetensors`, or several named by their index json;
    None for a folder without safetensors."""
    index = os.path.join(model_path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            return {name: os.path.join(model_path, file) for name, file in json.load(f)["weight_map"].items()}
    single = os.path.join(model_path, "model.safetensors")
    if not os.path.isfile(single):
        return None
    from safetensors import safe_open

    with safe_open(single, "pt") as f:
        return dict.fromkeys(f.keys(), single)


def checkpoint_name(name: str, checkpoint: dict[str, str], prefix: str) -> str | None:
    """The name in the files of the model's parameter or buffer `name` (PEFT's wrapping taken off; the base model's
    prefix added or dropped, as a checkpoint saved from the bare base model names it), or None where they lack it."""
    name = name.removeprefix("base_model.model.").replace(".base_layer.", ".")
    candidates = (name, name.removeprefix(f"{prefix}."), f"{prefix}.{name}")
    return next((candidate for candidate in candidates if candidate in checkpoint), None)


def init_missing(model, checkpoint: dict[str, str]) -> None:
    """Materialise, whole and on the CPU, each module's weights that the files lack, and initialise them as
    from_pretrained does (the model's `_init_weights`, drawing from the same random generator)."""
    prefix = model.base_model_prefix
    names = {id(p): name for name, p in model.named_parameters()}
    for module in model.modules():
        own = list(module.parameters(recurse=False))
        if not own or any(checkpoint_name(names[id(p)], checkpoint, prefix) for p in own):
            continue
        module.to_empty(device="cpu", recurse=False)
        model._init_weights(module)


def replay_lora_init(model) -> None:
    """Give the LoRA adapters, which PEFT made on the meta device beside the base weights, the values PEFT would have
    drawn for them on the CPU: each adapter's layers as their constructors initialise them, then PEFT's own
    initialisation, layer after layer in the order get_peft_model adds them (run with the generator as it was then)."""
    from peft.tuners.lora import LoraLayer

    for layer in model.modules():
        if not isinstance(layer, LoraLayer):
            continue
        for adapter in layer.lora_A:
            for part in (layer.lora_A[adapter], layer.lora_B[adapter]):
                part.to_empty(device="cpu")
                part.reset_parameters()
            layer.reset_lora_parameters(adapter, model.peft_config[adapter].init_lora_weights)


@torch.no_grad()
def fill_shards(
    model, checkpoint: dict[str, str], rank: int, world_size: int, device: torch.device, offloaded: bool = False
) -> None:
    """Allocate on `device` the shards that this rank owns of `model`'s meta weights (FSDP2 DTensors, or whole tensors
    outside FSDP) and read them from the files, cast to each weight's dtype; weights already materialised (see
    init_missing, replay_lora_init) keep their values; buffers no file holds are computed. An `offloaded` model (FSDP2's
    CPUOffloadPolicy) keeps its parameters in host memory and its buffers on `device`, where it computes."""
    from safetensors import safe_open

    kept = {name: getattr(p, "to_local", lambda: p)().clone() for name, p in model.named_parameters() if not p.is_meta}
    # buffers no file holds (rotary inv_freq), of modules without weights of their own that _init_weights would draw
    computed = [
        module
        for module in model.modules()
        if any(b.is_meta for b in module.buffers(recurse=False)) and not list(module.parameters(recurse=False))
    ]
    model.to_empty(device="cpu" if offloaded else device)
    if offloaded:
        for module in model.modules():
            for name, buffer in module.named_buffers(recurse=False):
                setattr(module, name, buffer.to(device))
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    base.tie_weights()  # to_empty gives a tied weight outside FSDP a new tensor in each module that holds it
    prefix = getattr(model, "base_model_prefix", None) or model.get_base_model().base_model_prefix
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        local = getattr(tensor, "to_local", lambda: tensor)()
        if name in kept:
            local.copy_(kept[name])
            continue
        key = checkpoint_name(name, checkpoint, prefix)
        if key is None:
            continue
        # A file opened once for all its weights stays mapped: the pages read from it would count in this process's
        # resident memory until the end (the rank's share of the file again). Opened per weight, one slice at most.
        with safe_open(checkpoint[key], "pt") as file:
            stored = file.get_slice(key)
            if hasattr(tensor, "to_local") and local.dim():
                # torch.chunk's rows: ceil(rows / world size) on each rank, the last ones fewer or none
                start = min(rank * math.ceil(tensor.shape[0] / world_size), tensor.shape[0])
                part = stored[start : start + local.shape[0]]
            else:
                part = stored[:] if local.dim() else file.get_tensor(key)
            local.copy_(part.to(local.dtype))
    for module in computed:
        base._init_weights(module)
