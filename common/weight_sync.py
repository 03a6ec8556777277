"""The policy's weights as a rollout engine loads them, gathered from FSDP2 one layer at a time.

A sharded policy holds 1/N of every weight on each rank. The engine needs
whole tensors under the names of the model's own checkpoint, and, with LoRA,
either the adapter (named as PEFT saves it) or the adapter merged into the
base weights. Gathering one FSDP unit (a decoder layer, then the root's
embeddings, norm and head) at a time keeps at most one layer whole on a
device, never the whole model.

Rollout engines in processes of their own (split placement) receive the same
tensors over a process group of their own, gloo between CPUs, NCCL between
GPUs: their names, shapes and dtypes once, as JSON, then their bytes packed
into flat buckets of BUCKET_BYTES, one broadcast each (`send_buckets`,
`received_tensors`), so that no tensor costs a collective or a host
round-trip of its own. The sender packs the next bucket (gathering its
units) while the one before travels; each engine posts its receive of the
next bucket while it loads the one before.

Who sends. An engine holds every tensor whole (one process, no tensor
parallelism), so each engine must receive every byte whoever sends it, while
FSDP2 holds each weight as row shards spread over the policy's ranks. Two
ways get the bytes there:

- the policy's ranks all-gather each unit over their own group and rank 0
  alone sends it on (chosen): the weight group holds rank 0 and the engines,
  one broadcast per bucket. On GPUs the gather runs over the policy's
  NVLink/NCCL group: as fast as the send to engines on the same node, about
  ten times faster than InfiniBand to engines on others.
- every policy rank sends its own rows: the weight group would hold every
  policy rank and each bucket become one broadcast per owner, into row
  slices of the engine's tensors (a bucket of rows of many tensors each).
  Over gloo on one host that moves the same bytes through the same memory
  with N times the collectives: no gain. Over NCCL it pays where the engines
  sit on other nodes: each rank's InfiniBand link then carries 1/N of the
  bytes, where rank 0's carries them all. That is the next step for engines
  on other nodes; engines on the policy's node read over NVLink either way.
"""

from __future__ import annotations

import datetime
import json
import math
from collections.abc import Iterable, Iterator

import torch
import torch.distributed as dist

ADAPTER = "default"  # the name PEFT gives an adapter it creates


def _units(model) -> list[tuple[object, list[str]]]:
    """Each FSDP unit, the root last, with the names of its own parameters in the order gathered_units yields them."""
    from torch.distributed.fsdp import FSDPModule

    unit_names = {module: name for name, module in model.named_modules() if isinstance(module, FSDPModule)}
    prefixes = sorted(unit_names.values(), key=len, reverse=True)
    owned = {prefix: [] for prefix in prefixes}
    # A tied weight under each of its names (the embeddings as lm_head too): an engine that reloads layer by
    # layer, as vLLM does, keeps its old copy in a layer that receives nothing.
    for name, _ in model.named_parameters(remove_duplicate=False):
        owner = next(p for p in prefixes if p == "" or name.startswith(p + "."))
        owned[owner].append(name)
    return [(unit, owned[prefix]) for unit, prefix in sorted(unit_names.items(), key=lambda item: item[1] == "")]


def gathered_units(model) -> Iterator[dict[str, torch.Tensor]]:
    """Each FSDP unit's own parameters, whole, keyed by their names in `model` (a collective: call every rank).

    The tensors are views of the gathered storage and are valid until the
    next unit is requested: copy or consume them before then.
    """
    units = _units(model)
    model.reshard()  # FSDP2 keeps the root gathered after a forward
    for unit, names in units:
        unit.unshard()
        try:
            yield {name: model.get_parameter(name).detach() for name in names}
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


def engine_weights(model, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(checkpoint name, tensor) of every weight of a sharded policy, a LoRA adapter merged in, gathered one FSDP
    unit at a time (a collective: call every rank); in `dtype`, the one the engine keeps, before they travel (None:
    as FSDP gathers them)."""
    lora = hasattr(model, "peft_config")
    scaling = lora_scaling(model) if lora else {}
    for unit in gathered_units(model):
        for name, tensor in (merged_weights(unit, scaling) if lora else base_weights(unit)).items():
            yield name, tensor if dtype is None else tensor.to(dtype)


def engine_layout(model, dtype: torch.dtype) -> list[tuple[str, list[int], str]]:
    """layout_of what engine_weights yields in `dtype`, known before any gather: each weight's whole shape."""
    lora = hasattr(model, "peft_config")
    layout = []
    for _, names in _units(model):
        for name in names:
            if not (lora and is_adapter(name)):
                layout.append((engine_name(name), list(model.get_parameter(name).shape), str(dtype).removeprefix("torch.")))
    return layout


def engine_adapter(model) -> dict[str, torch.Tensor]:
    """The LoRA adapter of a sharded policy, whole, named as PEFT saves it (a collective: call every rank)."""
    model.reshard()
    return adapter_weights({name: param.full_tensor() for name, param in model.named_parameters() if is_adapter(name)})


def join_group(address: tuple[str, int], rank: int, size: int, device: torch.device, timeout=datetime.timedelta(minutes=30)):
    """The weight group: the policy's rank 0 (rank 0 here, which serves the rendezvous at `address`) and every rollout
    engine's process. A group apart from each side's own, so that neither needs the other in its collectives.
    `timeout`: how long a broadcast waits for its peers (an engine may finish a long generation before it joins one)."""
    host, port = address
    store = dist.PrefixStore("weights", dist.TCPStore(host, port, size, rank == 0, timeout=timeout))
    if device.type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(store, rank, size, options)
    return dist.ProcessGroupGloo(store, rank, size, timeout)


def _broadcast(group, tensor: torch.Tensor):
    options = dist.BroadcastOptions()
    options.rootRank = 0
    return group.broadcast([tensor], options)


BUCKET_BYTES = 64 * 2**20  # large enough that a collective's fixed cost vanishes, small next to a 7B layer (400 MB bf16)
ALIGNMENT = 64  # bytes: every tensor of a bucket starts at an address any dtype's view accepts


def layout_of(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, list[int], str]]:
    """(name, shape, dtype) of each tensor, in order: what both sides of the weight group must agree on."""
    return [(name, list(tensor.shape), str(tensor.dtype).removeprefix("torch.")) for name, tensor in named_tensors]


def bucket_plan(layout: list[tuple[str, list[int], str]], bucket_bytes: int) -> list[list[tuple[int, int]]]:
    """Each bucket's tensors as (index in `layout`, byte offset), in order; the bucket's size is its last tensor's end.
    A tensor larger than `bucket_bytes` travels alone."""
    buckets, current, end = [], [], 0
    for index, (_, shape, dtype) in enumerate(layout):
        offset = -(-end // ALIGNMENT) * ALIGNMENT
        nbytes = math.prod(shape) * getattr(torch, dtype).itemsize
        if current and offset + nbytes > bucket_bytes:
            buckets.append(current)
            current, offset = [], 0
        current.append((index, offset))
        end = offset + nbytes
    return buckets + [current] if current else buckets


def _bucket_bytes(layout, bucket) -> int:
    index, offset = bucket[-1]
    _, shape, dtype = layout[index]
    return offset + math.prod(shape) * getattr(torch, dtype).itemsize


def _views(buffer: torch.Tensor, layout, bucket) -> Iterator[tuple[str, torch.Tensor]]:
    for index, offset in bucket:
        name, shape, dtype = layout[index]
        dtype = getattr(torch, dtype)
        yield name, buffer[offset : offset + math.prod(shape) * dtype.itemsize].view(dtype).view(shape)


def packed_buckets(layout, named_tensors: Iterable[tuple[str, torch.Tensor]], device: torch.device, bucket_bytes: int):
    """The tensors, in `layout`'s order, copied into flat byte buffers on `device`, one per bucket of bucket_plan, each
    yielded once full: the tensors may be views that the next one requested invalidates (gathered_units)."""
    named_tensors = iter(named_tensors)
    for bucket in bucket_plan(layout, bucket_bytes):
        buffer = torch.empty(_bucket_bytes(layout, bucket), dtype=torch.uint8, device=device)
        for expected, view in _views(buffer, layout, bucket):
            name, tensor = next(named_tensors)
            if name != expected or tensor.shape != view.shape or tensor.dtype != view.dtype:
                raise RuntimeError(
                    f"weight sync: {name} {tensor.dtype} {list(tensor.shape)} arrived where the layout sent "
                    f"ahead has {expected} {view.dtype} {list(view.shape)}"
                )
            view.copy_(tensor)
        yield buffer


def send_buckets(group, layout, buckets: Iterable[torch.Tensor], device: torch.device, bucket_bytes: int) -> None:
    """Broadcast from rank 0 `layout` and `bucket_bytes` (once, as JSON), then each bucket of packed_buckets, one
    collective each. The next bucket is fetched (packed as the policy gathers it) while the one before travels."""
    header = torch.tensor(list(json.dumps([layout, bucket_bytes]).encode()), dtype=torch.uint8, device=device)
    _broadcast(group, torch.tensor([header.numel()], device=device)).wait()
    in_flight = _broadcast(group, header)
    for bucket in buckets:
        bucket = bucket.to(device)
        in_flight.wait()
        in_flight = _broadcast(group, bucket)
    in_flight.wait()


def send_tensors(
    group, named_tensors: Iterable[tuple[str, torch.Tensor]], device: torch.device, bucket_bytes: int = BUCKET_BYTES
) -> None:
    """send_buckets of tensors at hand (a list or a dict's items), to received_tensors on every other rank."""
    named_tensors = list(named_tensors)
    layout = layout_of(named_tensors)
    send_buckets(group, layout, packed_buckets(layout, named_tensors, device, bucket_bytes), device, bucket_bytes)


def received_tensors(group, device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
    """What send_buckets sends, one (name, tensor) at a time, each a view of its bucket (valid as long as it is
    kept). The next bucket is already on its way while the tensors of one are taken."""
    size = torch.zeros(1, dtype=torch.long, device=device)
    _broadcast(group, size).wait()
    header = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    _broadcast(group, header).wait()
    layout, bucket_bytes = json.loads(bytes(header.tolist()).decode())
    pending = None
    for bucket in bucket_plan(layout, bucket_bytes) + [None]:
        arriving = None
        if bucket is not None:
            buffer = torch.empty(_bucket_bytes(layout, bucket), dtype=torch.uint8, device=device)
            arriving = (_broadcast(group, buffer), buffer, bucket)
        if pending is not None:
            work, buffer, received = pending
            work.wait()
            yield from _views(buffer, layout, received)
        pending = arriving
