"""The policy worker's side of the vllm engine, on 2 CPU ranks: what it sends, and what it makes of the answer.

vLLM runs on GPUs only; here the worker's own code (`_sync_weights`, `_generate_vllm`) talks to
an engine that records what it receives. tests/gpu runs the real engine.
"""

import sys

import pytest
import torch
from ray import cloudpickle
from safetensors.torch import load_file
from torch.distributed.tensor import DTensor

from common.workers import PolicyWorker, WorkerGroup, attention_implementation
from test_workers import local_model

cloudpickle.register_pickle_by_value(sys.modules[__name__])


class RecordingEngine:
    """Receives weights as vLLM does and keeps a CPU copy, noting how much of the policy was whole meanwhile."""

    def __init__(self, model):
        self.model, self.weights, self.adapter, self.config, self.whole_at_handover = model, {}, {}, None, []

    def whole_parameters(self) -> int:
        return sum(p.numel() for p in self.model.parameters() if not isinstance(p, DTensor))

    def load_weights(self, weights) -> None:
        for name, tensor in weights:
            self.whole_at_handover.append(self.whole_parameters())
            self.weights[name] = tensor.detach().clone().cpu()

    def load_adapter(self, tensors, peft_config) -> None:
        self.adapter = {name: tensor.detach().clone().cpu() for name, tensor in tensors.items()}
        self.config = peft_config


class ScriptedEngine(RecordingEngine):
    """Answers each prompt with its tokens reversed, then EOS, with log-prob -0.5 for each token."""

    def __init__(self, model):
        super().__init__(model)
        self.calls, self.prompts = [], None

    def wake_weights(self):
        self.calls.append("wake_weights")

    def load_weights(self, weights):
        self.calls.append("load_weights")
        super().load_weights(weights)

    def wake_kv_cache(self):
        self.calls.append("wake_kv_cache")

    def sleep(self):
        self.calls.append("sleep")

    def generate(self, prompts, max_tokens, eos_token_ids, do_sample, temperature, top_p, top_k):
        self.calls.append("generate")
        self.prompts = prompts
        tokens = [prompt[::-1][: max_tokens - 1] + [eos_token_ids[0]] for prompt in prompts]
        return tokens, [[-0.5] * len(ids) for ids in tokens]


class SyncProbe(PolicyWorker):
    def perturb(self, name_part: str) -> None:
        """Move the parameters whose names contain `name_part` off their initial values (each rank its own shard)."""
        generator = torch.Generator().manual_seed(self.rank)
        self.model.reshard()  # the root stays gathered after a forward
        with torch.no_grad():
            for name, param in self.model.named_parameters():
                if name_part in name:
                    local = param.to_local()
                    local.copy_(torch.randn(local.shape, generator=generator))

    def sync(self, lora_merge: bool) -> dict:
        self.vllm, self.lora_merge = RecordingEngine(self.model), lora_merge
        self._sync_weights()
        engine, self.vllm = self.vllm, None
        return dict(weights=engine.weights, adapter=engine.adapter, config=engine.config, whole_at_handover=engine.whole_at_handover)

    def generate_scripted(self, data):
        self.vllm = ScriptedEngine(self.model)
        output = self.generate(data, max_response_length=6)
        engine, self.vllm = self.vllm, None
        return output, engine.calls, engine.prompts


def test_full_weights_are_gathered_one_unit_at_a_time_under_checkpoint_names(cpu_pool, tiny_model):
    probe = WorkerGroup(SyncProbe, cpu_pool, "probe", model_path=tiny_model)
    try:
        probe.broadcast("perturb", "")  # as after training: no weight equals what the checkpoint holds
        expected = probe.rank0("full_state_dict")
        rank0, rank1 = probe.broadcast("sync", lora_merge=False)
    finally:
        probe.shutdown()
    assert set(expected) == {name for name, _ in local_model(tiny_model).named_parameters()}  # the names vLLM's load_weights reads
    assert set(rank0["weights"]) == set(expected)
    for name, tensor in expected.items():
        torch.testing.assert_close(rank0["weights"][name], tensor, rtol=0, atol=0)
        torch.testing.assert_close(rank1["weights"][name], tensor, rtol=0, atol=0)
    # while a tensor is handed over, only its own unit is whole (a decoder layer, or the root's
    # embeddings and norm), never the whole model
    layer_names = [name for name in expected if name.startswith("model.layers.0.")]
    layer = sum(expected[name].numel() for name in layer_names)
    root = sum(t.numel() for t in expected.values()) - 2 * layer
    assert sorted(rank0["whole_at_handover"]) == [root] * (len(expected) - 2 * len(layer_names)) + [layer] * 2 * len(layer_names)


@pytest.fixture(scope="module")
def lora_probe(cpu_pool, tiny_model):
    group = WorkerGroup(SyncProbe, cpu_pool, "lora_probe", model_path=tiny_model, lora_rank=4, lora_alpha=8)
    group.broadcast("perturb", "lora_B")  # B starts at zero, which would make any merge look right
    yield group
    group.shutdown()


def lora_model(tiny_model, state):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(local_model(tiny_model), LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0, task_type="CAUSAL_LM"))
    result = model.load_state_dict(state, strict=False)
    assert result.missing_keys == ["base_model.model.lm_head.weight"] and not result.unexpected_keys  # tied to the embeddings
    return model


def test_merged_sync_equals_peft_merge(lora_probe, tiny_model):
    state = lora_probe.rank0("full_state_dict")
    sent = lora_probe.broadcast("sync", lora_merge=True)[0]["weights"]
    merged = dict(lora_model(tiny_model, state).merge_and_unload().named_parameters())
    assert set(sent) == set(merged)
    base, changed = local_model(tiny_model), 0
    for name, tensor in merged.items():
        torch.testing.assert_close(sent[name], tensor, rtol=1e-5, atol=1e-6)
        changed += not torch.equal(tensor, base.get_parameter(name))
    assert changed >= 7 * 2  # every adapted linear of both layers moved


def test_adapter_sync_is_a_peft_adapter(lora_probe, tiny_model, tmp_path):
    state = lora_probe.rank0("full_state_dict")
    sent = lora_probe.broadcast("sync", lora_merge=False)[0]
    lora_model(tiny_model, state).save_pretrained(tmp_path)
    saved = load_file(tmp_path / "adapter_model.safetensors")
    assert set(sent["adapter"]) == set(saved)
    for name, tensor in saved.items():
        torch.testing.assert_close(sent["adapter"][name], tensor, rtol=0, atol=0)
    assert sent["weights"] == {}  # the base weights stay in the engine
    assert sent["config"].r == 4 and sent["config"].lora_alpha == 8


def test_vllm_generation_wakes_syncs_and_sleeps_and_aligns_the_answer(cpu_pool, tiny_model, demo_files, tokenizer):
    from common.data import collate, load_prompts

    prompts = collate(load_prompts([demo_files[1]], tokenizer, max_prompt_length=8)[:3], tokenizer.pad_token_id)
    probe = WorkerGroup(SyncProbe, cpu_pool, "generate_probe", model_path=tiny_model)
    try:
        output, calls, sent = probe.broadcast("generate_scripted", prompts.select("prompts", "prompt_mask"))[0]
    finally:
        probe.shutdown()
    # the weights arrive before the KV cache takes its memory, and the engine sleeps again before training
    assert calls == ["wake_weights", "load_weights", "wake_kv_cache", "generate", "sleep"]
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    for i, (row, mask) in enumerate(zip(prompts.batch["prompts"], prompts.batch["prompt_mask"])):
        prompt = row[mask.bool()].tolist()
        assert sent[i] == prompt  # left padding stripped
        answer = prompt[::-1][:5] + [eos]
        length = len(answer)
        assert output.batch["responses"][i].tolist() == answer + [pad] * (6 - length)
        assert output.batch["response_mask"][i].tolist() == [1.0] * length + [0.0] * (6 - length)
        assert output.batch["rollout_log_probs"][i].tolist() == [-0.5] * length + [0.0] * (6 - length)
        assert output.batch["input_ids"][i].tolist() == row.tolist() + answer + [pad] * (6 - length)


def test_attention_falls_back_to_sdpa_without_a_gpu():
    assert attention_implementation(torch.device("cpu")) == "sdpa"
