"""What of the vllm engine needs CUDA: bf16 beside the bf16-mixed-precision trainer over NCCL, sleep and wake, --offload.

Everything else about the engine (weight sync, LoRA adapter and merged, export, each script) runs on the CPU in
tests/test_vllm.py. Run these on a machine with a CUDA GPU and the gpu extra installed: `pytest tests/gpu`.
"""

import importlib.util
import sys
from functools import partial

import pytest
import torch

if not torch.cuda.is_available() or importlib.util.find_spec("vllm") is None:
    # before Ray's import: the device check runs tests/gpu where neither Ray nor vLLM is installed
    pytest.skip("CUDA-only: vLLM's sleep and wake and its NCCL weight sync need a CUDA GPU and vllm", allow_module_level=True)

from ray import cloudpickle  # noqa: E402

import grpo_hybrid  # noqa: E402
from common.data import collate, load_prompts  # noqa: E402
from common.engines import EngineSettings  # noqa: E402
from common.worker_group import ResourcePool, WorkerGroup  # noqa: E402
from common.workers import PolicyWorker  # noqa: E402

cloudpickle.register_pickle_by_value(grpo_hybrid)
cloudpickle.register_pickle_by_value(sys.modules[__name__])

LOG_PROB_INPUTS = ("input_ids", "attention_mask", "position_ids", "responses")
# bf16 engine against the bf16-mixed-precision trainer: per-token log-probs agree to a few hundredths
BF16_MEAN_GAP = 0.05


class MemoryProbe(PolicyWorker):
    def free_memory_asleep_and_awake(self) -> tuple[int, int]:
        torch.cuda.synchronize()
        asleep = torch.cuda.mem_get_info()[0]
        self.engine.llm.wake_up()  # its weights and its KV cache
        torch.cuda.synchronize()
        awake = torch.cuda.mem_get_info()[0]
        self.engine.llm.sleep(level=self.engine.sleep_level)
        return asleep, awake


@pytest.fixture(scope="module")
def gpu_model(tmp_path_factory, tokenizer):
    """A small random Qwen2 whose head size (64) every vLLM attention backend takes, with the demo's tokenizer."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    path = tmp_path_factory.mktemp("gpu_model")
    size = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    tokens = dict(pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    config = Qwen2Config(vocab_size=len(tokenizer), max_position_embeddings=256, tie_word_embeddings=True, **size, **tokens)
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


def vllm_policy(pool, model_path, name, worker=PolicyWorker, offload=False, **settings):
    engine = EngineSettings(name="vllm", gpu_memory_utilization=0.25, max_model_len=64, offload=offload)
    return WorkerGroup(worker, pool, name, model_path=model_path, engine=engine, micro_batch_size=16, **settings)


def rollout(policy, prompts, **sampling):
    batch = prompts.repeat(4)
    return batch | policy.scatter("generate", batch.select("prompts", "prompt_mask"), max_response_length=16, **sampling)


def log_prob_gap(policy, batch) -> float:
    """Mean |engine log-prob - trainer log-prob| over the response tokens."""
    trainer = policy.scatter("compute_log_prob", batch.select(*LOG_PROB_INPUTS))
    mask = batch["response_mask"].bool()
    return (trainer["old_log_probs"] - batch["rollout_log_probs"])[mask].abs().mean().item()


def update(policy, batch, steps=1):
    batch |= policy.scatter("compute_log_prob", batch.select(*LOG_PROB_INPUTS))
    batch["advantages"] = torch.linspace(-1, 1, len(batch))[:, None] * batch["response_mask"]
    for _ in range(steps):
        inputs = batch.select(*LOG_PROB_INPUTS, "response_mask", "old_log_probs", "advantages")
        policy.scatter("update", inputs, loss_fn=partial(grpo_hybrid.actor_loss, args=grpo_hybrid.Args(kl_loss_coef=0.0)))


def test_vllm_generates_and_follows_the_policy_after_an_update(gpu_pool, gpu_model, prompts, tokenizer):
    policy = vllm_policy(gpu_pool, gpu_model, "policy", lr=1e-2)
    try:
        before = rollout(policy, prompts)
        assert before["responses"].shape == (len(prompts) * 4, 16)
        mask = before["response_mask"]
        assert torch.all(mask[:, 1:] <= mask[:, :-1])
        assert torch.all(before["rollout_log_probs"][mask.bool()] <= 0)
        assert log_prob_gap(policy, before) < BF16_MEAN_GAP

        update(policy, before, steps=3)
        after = rollout(policy, prompts)
        # the engine samples from the updated policy: its log-probs match the trainer's now...
        assert log_prob_gap(policy, after) < BF16_MEAN_GAP
        # ...and not the weights it started with
        before_tokens = before["rollout_log_probs"][mask.bool()]
        trainer_now = policy.scatter("compute_log_prob", before.select(*LOG_PROB_INPUTS))
        assert (trainer_now["old_log_probs"][mask.bool()] - before_tokens).abs().mean().item() > 2 * BF16_MEAN_GAP
    finally:
        policy.shutdown()


def test_offload_moves_the_policy_off_the_gpu_while_the_engine_generates(gpu_pool, gpu_model, prompts):
    policy = vllm_policy(gpu_pool, gpu_model, "offload", offload=True, lr=1e-2)
    try:
        batch = rollout(policy, prompts)
        update(policy, batch)  # the optimiser state came back to the GPU with the weights
        assert log_prob_gap(policy, rollout(policy, prompts)) < BF16_MEAN_GAP
    finally:
        policy.shutdown()


def test_sleep_frees_and_wake_restores_memory(gpu_pool, gpu_model):
    policy = vllm_policy(gpu_pool, gpu_model, "memory", worker=MemoryProbe)
    try:
        asleep, awake = policy.broadcast("free_memory_asleep_and_awake")[0]
        total = torch.cuda.get_device_properties(0).total_memory
        # awake, the engine holds about --rollout-gpu-memory-utilization of the GPU (weights and KV cache)
        assert asleep - awake > 0.15 * total
    finally:
        policy.shutdown()
