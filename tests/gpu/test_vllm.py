"""The vllm rollout engine on a GPU: generation, weight sync after an update, LoRA adapter vs merged sync, sleep/wake.

Run on a machine with a CUDA GPU and the gpu extra installed: `pytest tests/gpu`.
"""

import importlib.util
import sys
from functools import partial

import pytest
import torch
from ray import cloudpickle

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or importlib.util.find_spec("vllm") is None,
    reason="needs a CUDA GPU and vllm; on a GPU machine see the README, 'What ran where'",
)

import grpo_hybrid  # noqa: E402
from common.data import collate, load_prompts  # noqa: E402
from common.workers import PolicyWorker, ResourcePool, WorkerGroup  # noqa: E402

cloudpickle.register_pickle_by_value(grpo_hybrid)
cloudpickle.register_pickle_by_value(sys.modules[__name__])

LOG_PROB_INPUTS = ("input_ids", "attention_mask", "position_ids", "responses")
# bf16 engine against the bf16-mixed-precision trainer: per-token log-probs agree to a few hundredths
BF16_MEAN_GAP = 0.05


class MemoryProbe(PolicyWorker):
    def free_memory_asleep_and_awake(self) -> tuple[int, int]:
        torch.cuda.synchronize()
        asleep = torch.cuda.mem_get_info()[0]
        self.vllm.wake_weights()
        self.vllm.wake_kv_cache()
        torch.cuda.synchronize()
        awake = torch.cuda.mem_get_info()[0]
        self.vllm.sleep()
        return asleep, awake


@pytest.fixture(scope="module")
def gpu_model(tmp_path_factory, tokenizer):
    """A small random Qwen2 whose head size (64) every vLLM attention backend takes, with the demo's tokenizer."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    path = tmp_path_factory.mktemp("gpu_model")
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None,
    )  # fmt: skip
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def gpu_pool(ray_cluster):
    pool = ResourcePool(1, use_gpu=True, max_colocated=2)
    yield pool
    pool.shutdown()


@pytest.fixture(scope="module")
def prompts(demo_files, tokenizer):
    return collate(load_prompts([demo_files[1]], tokenizer, max_prompt_length=8)[:16], tokenizer.pad_token_id)


def vllm_policy(pool, model_path, name, worker=PolicyWorker, **settings):
    return WorkerGroup(
        worker, pool, name, model_path=model_path, rollout_engine="vllm", rollout_gpu_memory_utilization=0.25, max_model_len=64, **settings
    )


def rollout(policy, prompts, **sampling):
    batch = prompts.repeat(4)
    return batch | policy.scatter("generate", batch.select("prompts", "prompt_mask"), max_response_length=16, **sampling)


def log_prob_gap(policy, batch) -> float:
    """Mean |engine log-prob - trainer log-prob| over the response tokens."""
    trainer = policy.scatter("compute_log_prob", batch.select(*LOG_PROB_INPUTS), temperature=1.0, micro_batch_size=16)
    mask = batch.batch["response_mask"].bool()
    return (trainer.batch["old_log_probs"] - batch.batch["rollout_log_probs"])[mask].abs().mean().item()


def update(policy, batch, steps=1):
    batch |= policy.scatter("compute_log_prob", batch.select(*LOG_PROB_INPUTS), temperature=1.0, micro_batch_size=16)
    batch.batch["advantages"] = torch.linspace(-1, 1, len(batch))[:, None] * batch.batch["response_mask"]
    for _ in range(steps):
        policy.scatter(
            "update", batch.select(*LOG_PROB_INPUTS, "response_mask", "old_log_probs", "advantages"),
            loss_fn=partial(grpo_hybrid.actor_loss, args=grpo_hybrid.Args(kl_loss_coef=0.0)),
            temperature=1.0, epochs=1, mini_batch_size=len(batch), micro_batch_size=16,
        )  # fmt: skip


def test_vllm_generates_and_follows_the_policy_after_an_update(gpu_pool, gpu_model, prompts, tokenizer):
    policy = vllm_policy(gpu_pool, gpu_model, "policy", lr=1e-2)
    try:
        before = rollout(policy, prompts)
        assert before.batch["responses"].shape == (len(prompts) * 4, 16)
        mask = before.batch["response_mask"]
        assert torch.all(mask[:, 1:] <= mask[:, :-1])
        assert torch.all(before.batch["rollout_log_probs"][mask.bool()] <= 0)
        assert log_prob_gap(policy, before) < BF16_MEAN_GAP

        update(policy, before, steps=3)
        after = rollout(policy, prompts)
        # the engine samples from the updated policy: its log-probs match the trainer's now...
        assert log_prob_gap(policy, after) < BF16_MEAN_GAP
        # ...and not the weights it started with
        before_tokens = before.batch["rollout_log_probs"][mask.bool()]
        trainer_now = policy.scatter("compute_log_prob", before.select(*LOG_PROB_INPUTS), temperature=1.0, micro_batch_size=16)
        assert (trainer_now.batch["old_log_probs"][mask.bool()] - before_tokens).abs().mean().item() > 2 * BF16_MEAN_GAP
    finally:
        policy.shutdown()


def test_lora_adapter_sync_and_merged_sync_generate_the_same(gpu_pool, gpu_model, prompts, tmp_path):
    lora = dict(lora_rank=8, lora_alpha=16, lr=1e-2, seed=3)
    adapter = vllm_policy(gpu_pool, gpu_model, "adapter", **lora)
    merged = vllm_policy(gpu_pool, gpu_model, "merged", lora_merge=True, **lora)
    try:
        update(adapter, rollout(adapter, prompts), steps=3)  # LoRA's B starts at zero: train it first
        adapter.broadcast("save", str(tmp_path / "checkpoint"))
        merged.broadcast("load", str(tmp_path / "checkpoint"))
        greedy_adapter = rollout(adapter, prompts, do_sample=False)
        greedy_merged = rollout(merged, prompts, do_sample=False)
        same = (greedy_adapter.batch["responses"] == greedy_merged.batch["responses"]).float().mean().item()
        assert same > 0.95
        assert log_prob_gap(adapter, greedy_adapter) < BF16_MEAN_GAP
        assert log_prob_gap(merged, greedy_merged) < BF16_MEAN_GAP
    finally:
        adapter.shutdown()
        merged.shutdown()


def test_sleep_frees_and_wake_restores_memory(gpu_pool, gpu_model):
    policy = vllm_policy(gpu_pool, gpu_model, "memory", worker=MemoryProbe)
    try:
        asleep, awake = policy.rank0("free_memory_asleep_and_awake")
        total = torch.cuda.get_device_properties(0).total_memory
        # awake, the engine holds about --rollout-gpu-memory-utilization of the GPU (weights and KV cache)
        assert asleep - awake > 0.15 * total
    finally:
        policy.shutdown()


def test_vllm_reads_the_adapter_folder_the_worker_writes(tiny_model, tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM
    from vllm.config.lora import LoRAConfig
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.peft_helper import PEFTHelper

    from common import weight_sync
    from common.vllm_rollout import VLLM_LORA_RANKS, write_adapter

    config = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0, task_type="CAUSAL_LM")
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model), config)
    adapter = {name: p.detach() for name, p in model.named_parameters() if weight_sync.is_adapter(name)}
    write_adapter(str(tmp_path / "adapter"), weight_sync.adapter_weights(adapter), model.peft_config["default"])

    helper = PEFTHelper.from_local_dir(str(tmp_path / "adapter"), max_position_embeddings=128)
    helper.validate_legal(LoRAConfig(max_lora_rank=min(r for r in VLLM_LORA_RANKS if r >= 4), max_loras=1))
    qwen2_modules = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    lora = LoRAModel.from_local_checkpoint(
        str(tmp_path / "adapter"), qwen2_modules, peft_helper=helper, lora_model_id=1, device="cpu", dtype=torch.float32, model_vocab_size=model.config.vocab_size
    )
    assert len(lora.loras) == 7 * 2 and lora.rank == 4
    assert lora.loras["model.layers.0.self_attn.q_proj"].scaling == 2.0  # alpha / r
