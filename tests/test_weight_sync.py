"""What the policy worker sends a rollout engine, on 2 CPU ranks: every weight gathered one FSDP unit at a time under
the checkpoint's names, or with LoRA the adapter as PEFT saves it or merged as PEFT merges it.

tests/test_vllm.py sends the same to the real vLLM engine and checks what it then generates.
"""

import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from ray import cloudpickle
from safetensors.torch import load_file
from torch.distributed.tensor import DTensor

from common.fsdp_worker import attention_implementation
from common.weight_sync import (
    ADAPTER,
    bucket_plan,
    engine_adapter,
    engine_weights,
    join_group,
    layout_of,
    received_tensors,
    send_tensors,
)
from common.worker_group import WorkerGroup, _free_port
from helpers import PolicyProbe, local_model

cloudpickle.register_pickle_by_value(sys.modules[__name__])


class SyncProbe(PolicyProbe):
    min_unit_params = 0  # a unit per decoder layer, as a model of real size gets

    def perturb(self, name_part: str) -> None:
        """Move the parameters whose names contain `name_part` off their initial values (each rank its own shard)."""
        generator = torch.Generator().manual_seed(self.rank)
        self.model.reshard()  # the root stays gathered after a forward
        with torch.no_grad():
            for name, param in self.model.named_parameters():
                if name_part in name:
                    local = param.to_local()
                    local.copy_(torch.randn(local.shape, generator=generator))

    def engine_weights(self, dtype: torch.dtype | None = None) -> dict:
        """What the engine would receive (in `dtype`), on the CPU, and how many parameters were whole as each tensor was
        handed over."""
        weights, whole_at_handover = {}, []
        for name, tensor in engine_weights(self.model, dtype):
            whole_at_handover.append(sum(p.numel() for p in self.model.parameters() if not isinstance(p, DTensor)))
            weights[name] = tensor.to("cpu", copy=True)  # the gathered storage is freed with its unit
        return dict(weights=weights, whole_at_handover=whole_at_handover)

    def engine_adapter(self) -> tuple[dict, object]:
        return {name: tensor.cpu() for name, tensor in engine_adapter(self.model).items()}, self.model.peft_config[ADAPTER]


def test_full_weights_are_gathered_one_unit_at_a_time_under_checkpoint_names(cpu_pool, tiny_model):
    probe = WorkerGroup(SyncProbe, cpu_pool, "probe", model_path=tiny_model)
    try:
        probe.broadcast("perturb", "")  # as after training: no weight equals what the checkpoint holds
        expected = probe.broadcast("full_state_dict")[0]
        rank0, rank1 = probe.broadcast("engine_weights")
        bf16 = probe.broadcast("engine_weights", torch.bfloat16)[0]["weights"]  # a bf16 engine's: half the bytes
    finally:
        probe.shutdown()
    assert set(expected) == {
        name for name, _ in local_model(tiny_model).named_parameters()
    }  # the names vLLM's load_weights reads
    # the tied head travels under its own name too, as the engine keeps a layer per name
    expected["lm_head.weight"] = expected["model.embed_tokens.weight"]
    assert set(rank0["weights"]) == set(expected)
    for name, tensor in expected.items():
        torch.testing.assert_close(rank0["weights"][name], tensor, rtol=0, atol=0)
        torch.testing.assert_close(rank1["weights"][name], tensor, rtol=0, atol=0)
        assert bf16[name].dtype == torch.bfloat16 and torch.equal(bf16[name], tensor.to(torch.bfloat16))
    # while a tensor is handed over, only its own unit is whole (a decoder layer, or the root's
    # embeddings and norm), never the whole model
    layer_names = [name for name in expected if name.startswith("model.layers.0.")]
    layer = sum(expected[name].numel() for name in layer_names)
    root = sum(t.numel() for n, t in expected.items() if n != "lm_head.weight") - 2 * layer
    assert sorted(rank0["whole_at_handover"]) == [root] * (len(expected) - 2 * len(layer_names)) + [layer] * 2 * len(
        layer_names
    )


@pytest.fixture(scope="module")
def lora_probe(cpu_pool, tiny_model):
    group = WorkerGroup(SyncProbe, cpu_pool, "lora_probe", model_path=tiny_model, lora_rank=4, lora_alpha=8)
    group.broadcast("perturb", "lora_B")  # B starts at zero, which would make any merge look right
    yield group
    group.shutdown()


def lora_model(tiny_model, state):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(
        local_model(tiny_model),
        LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0, task_type="CAUSAL_LM"),
    )
    result = model.load_state_dict(state, strict=False)
    assert result.missing_keys == ["base_model.model.lm_head.weight"] and not result.unexpected_keys  # tied to the embeddings
    return model


def test_merged_sync_equals_peft_merge(lora_probe, tiny_model):
    state = lora_probe.broadcast("full_state_dict")[0]
    sent = lora_probe.broadcast("engine_weights")[0]["weights"]
    merged = dict(lora_model(tiny_model, state).merge_and_unload().named_parameters(remove_duplicate=False))
    assert set(sent) == set(merged)
    base, changed = local_model(tiny_model), 0
    for name, tensor in merged.items():
        torch.testing.assert_close(sent[name], tensor, rtol=1e-5, atol=1e-6)
        changed += not torch.equal(tensor, base.get_parameter(name))
    assert changed >= 7 * 2  # every adapted linear of both layers moved


def test_adapter_sync_is_a_peft_adapter(lora_probe, tiny_model, tmp_path):
    state = lora_probe.broadcast("full_state_dict")[0]
    adapter, config = lora_probe.broadcast("engine_adapter")[0]
    lora_model(tiny_model, state).save_pretrained(tmp_path)
    saved = load_file(tmp_path / "adapter_model.safetensors")
    assert set(adapter) == set(saved)
    for name, tensor in saved.items():
        torch.testing.assert_close(adapter[name], tensor, rtol=0, atol=0)
    assert config.r == 4 and config.lora_alpha == 8


def test_attention_falls_back_to_sdpa_without_a_gpu():
    assert attention_implementation(torch.device("cpu")) == "sdpa"


def test_buckets_carry_every_tensor_bit_for_bit_to_every_engine():
    generator = torch.Generator().manual_seed(0)
    sent = [
        ("embed", torch.randn(40, 16, generator=generator)),  # 2560 bytes: alone, larger than a bucket
        ("norm", torch.randn(5, generator=generator)),
        ("half", torch.randn(3, 7, generator=generator).to(torch.bfloat16)),  # odd byte counts: the next starts aligned
        ("count", torch.tensor(3, dtype=torch.int64)),
        ("empty", torch.empty(0, 4)),
        ("head", torch.randn(9, 9, generator=generator)),
    ]
    bucket_bytes = 1024
    plans = bucket_plan(layout_of(sent), bucket_bytes)
    assert [[index for index, _ in bucket] for bucket in plans] == [[0], [1, 2, 3, 4, 5]]
    address, cpu = ("127.0.0.1", _free_port()), torch.device("cpu")

    def receive(rank):
        return [(name, tensor.clone()) for name, tensor in received_tensors(join_group(address, rank, 3, cpu), cpu)]

    def send():
        send_tensors(join_group(address, 0, 3, cpu), sent, cpu, bucket_bytes)

    with ThreadPoolExecutor(3) as threads:
        calls = [threads.submit(send), threads.submit(receive, 1), threads.submit(receive, 2)]
        received = [call.result(timeout=60) for call in calls[1:]]
    for engine in received:
        assert [name for name, _ in engine] == [name for name, _ in sent]
        for (_, got), (_, expected) in zip(engine, sent):
            assert got.dtype == expected.dtype and got.shape == expected.shape
            assert torch.equal(got, expected)
