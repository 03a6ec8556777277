"""The policy's weights as a rollout engine loads them, gathered from FSDP2 one layer at a time.

A sharded policy holds 1/N of every weight on each rank. The engine needs
whole tensors under the names of the model's own checkpoint, and, with LoRA,
either the adapter (named as PEFT saves it) or the adapter merged into the
base weights. Gathering one FSDP unit (a decoder layer, then the root's
embeddings, norm and head) at a time keeps at most one layer whole on a
device, never the whole model.

Rollout engines in processes of their own (split placement) receive the same
tensors over a process group of their own: the policy's rank 0 broadcasts
each one to every engine (`send_tensors`, `received_tensors`), gloo between
CPUs, NCCL between GPUs.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Iterable, Iterator

import torch
import torch.distributed as dist

ADAPTER = "default"  # the name PEFT gives an adapter it creates


def gathered_units(model) -> Iterator[dict[str, torch.Tensor]]:
    """Each FSDP unit's own parameters, whole, keyed by their names in `model` (a collective: call every rank).

    The tensors are views of the gathered storage and are valid until the
    next unit is requested: copy or consume them before then.
    """
    from torch.distributed.fsdp import FSDPModule

    unit_names = {module: name for name, module in model.named_modules() if isinstance(module, FSDPModule)}
    prefixes = sorted(unit_names.values(), key=len, reverse=True)
    owned = {prefix: [] for prefix in prefixes}
    # A tied weight under each of its names (the embeddings as lm_head too): an engine that reloads layer by
    # layer, as vLLM does, keeps its old copy in a layer that receives nothing.
    for name, _ in model.named_parameters(remove_duplicate=False):
        owner = next(p for p in prefixes if p == "" or name.startswith(p + "."))
        owned[owner].append(name)
    model.reshard()  # FSDP2 keeps the root gathered after a forward
    for unit, prefix in sorted(unit_names.items(), key=lambda item: item[1] == ""):
        unit.unshard()
        try:
            yield {name: model.get_parameter(name).detach() for name in owned[prefix]}
        finally:
            unit.reshard()


def engine_name(name: str) -> str:
    """The checkpoint name of a policy parameter: without PEFT's wrapper prefix and `base_layer`."""
    return name.removeprefix("base_model.model.").replace(".base_layer.", ".")


def is_adapter(name: str) -> bool:
    return f".lora_A.{ADAPTER}." in name or f".lora_B.{ADAPTER}." in name


def base_weights(unit: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The base model's weights in one unit, adapters left out (the engine loaded them once from disk)."""
    return {engine_name(name): tensor for name, tensor in unit.items() if not is_adapter(name)}


def merged_weights(unit: dict[str, torch.Tensor], lora_scaling: dict[str, float]) -> dict[str, torch.Tensor]:
    """The base weights with each adapter merged in: W + scaling * B @ A.

    `lora_scaling` maps each adapted module's name to its alpha / r.
    """
    merged = base_weights(unit)
    for module, scaling in lora_scaling.items():
        weight = f"{module}.base_layer.weight"
        if weight not in unit:
            continue
        lora_a, lora_b = unit[f"{module}.lora_A.{ADAPTER}.weight"], unit[f"{module}.lora_B.{ADAPTER}.weight"]
        delta = (lora_b.float() @ lora_a.float()) * scaling
        merged[engine_name(weight)] = (unit[weight].float() + delta).to(unit[weight].dtype)
    return merged


def adapter_weights(params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapter's weights among `params`, named as in a saved PEFT adapter (no adapter name)."""
    return {name.replace(f".{ADAPTER}.", "."): tensor for name, tensor in params.items() if is_adapter(name)}


def lora_scaling(model) -> dict[str, float]:
    """alpha / r of every LoRA-adapted module of a PEFT model, by module name."""
    from peft.tuners.lora import LoraLayer

    return {name: module.scaling[ADAPTER] for name, module in model.named_modules() if isinstance(module, LoraLayer)}


def engine_weights(model) -> Iterator[tuple[str, torch.Tensor]]:
    """(checkpoint name, tensor) of every weight of a sharded policy, a LoRA adapter merged in, gathered one FSDP
    unit at a time (a collective: call every rank)."""
    lora = hasattr(model, "peft_config")
    scaling = lora_scaling(model) if lora else {}
    for unit in gathered_units(model):
        yield from (merged_weights(unit, scaling) if lora else base_weights(unit)).items()


def engine_adapter(model) -> dict[str, torch.Tensor]:
    """The LoRA adapter of a sharded policy, whole, named as PEFT saves it (a collective: call every rank)."""
    model.reshard()
    return adapter_weights({name: param.full_tensor() for name, param in model.named_parameters() if is_adapter(name)})


def join_group(address: tuple[str, int], rank: int, size: int, device: torch.device):
    """The weight group: the policy's rank 0 (rank 0 here, which serves the rendezvous at `address`) and every rollout
    engine's process. A group apart from each side's own, so that neither needs the other in its collectives."""
    host, port = address
    timeout = datetime.timedelta(minutes=30)  # an engine may finish a long generation before it joins a broadcast
    store = dist.PrefixStore("weights", dist.TCPStore(host, port, size, rank == 0, timeout=timeout))
    if device.type == "cuda":
        return dist.ProcessGroupNCCL(store, rank, size)
    return dist.ProcessGroupGloo(store, rank, size, timeout)


def _broadcast(group, tensor: torch.Tensor) -> None:
    options = dist.BroadcastOptions()
    options.rootRank = 0
    group.broadcast([tensor], options).wait()


def send_tensors(group, named_tensors: Iterable[tuple[str, torch.Tensor]], device: torch.device) -> None:
    """Broadcast each (name, tensor) from rank 0 to the group: its name, shape and dtype, then its values; an empty
    header ends the stream."""

    def send_header(fields: list) -> None:
        header = torch.tensor(list(json.dumps(fields).encode()), dtype=torch.uint8, device=device)
        _broadcast(group, torch.tensor([header.numel()], device=device))
        _broadcast(group, header)

    for name, tensor in named_tensors:
        send_header([name, list(tensor.shape), str(tensor.dtype).removeprefix("torch.")])
        _broadcast(group, tensor.to(device).contiguous())
    send_header([])


def received_tensors(group, device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
    """What send_tensors sends, one (name, tensor) at a time, as it arrives."""
    while True:
        size = torch.zeros(1, dtype=torch.long, device=device)
        _broadcast(group, size)
        header = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
        _broadcast(group, header)
        fields = json.loads(bytes(header.tolist()).decode())
        if not fields:
            return
        name, shape, dtype = fields
        tensor = torch.empty(shape, dtype=getattr(torch, dtype), device=device)
        _broadcast(group, tensor)
        yield name, tensor
