"""The policy worker group on 2 CPU ranks (real Ray actors, FSDP2 over gloo) against one plain process."""

from functools import partial

from ray import cloudpickle
import numpy as np
import pytest
import torch

import dapo_hybrid
import grpo_hybrid
from common.data import load_prompts
from common.dataproto import DataProto
from common.workers import PolicyWorker, WorkerGroup

# The loss travels to the workers by value, as it does from a script run as __main__.
cloudpickle.register_pickle_by_value(grpo_hybrid)
cloudpickle.register_pickle_by_value(dapo_hybrid)

LOG_PROB_INPUTS = ("input_ids", "attention_mask", "position_ids", "responses")


def local_log_probs(model, batch: DataProto) -> torch.Tensor:
    """Log-probs of the responses in one process, without FSDP."""
    responses = batch.batch["responses"]
    logits = model(
        input_ids=batch.batch["input_ids"], attention_mask=batch.batch["attention_mask"], position_ids=batch.batch["position_ids"]
    ).logits[:, -responses.shape[1] - 1 : -1]
    return torch.log_softmax(logits.float(), -1).gather(-1, responses.unsqueeze(-1)).squeeze(-1)


def local_model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


@pytest.fixture(scope="module")
def policy(cpu_pool, tiny_model):
    group = WorkerGroup(PolicyWorker, cpu_pool, "policy", model_path=tiny_model, lr=1e-3, weight_decay=0.0, max_grad_norm=1e9)
    yield group
    group.shutdown()


def rollout(policy, prompts, n=1):
    batch = prompts.repeat(n)
    return batch | policy.scatter("generate", batch.select("prompts", "prompt_mask"), max_response_length=4)


def test_generate_returns_aligned_sequences(policy, prompts, tokenizer):
    batch = rollout(policy, prompts)  # 5 prompts over 2 ranks: padded to 6, unpadded back
    assert len(batch) == 5
    prompt_length = prompts.batch["prompts"].shape[1]
    assert torch.equal(batch.batch["input_ids"][:, :prompt_length], prompts.batch["prompts"])
    assert batch.batch["responses"].shape == (5, 4)
    mask = batch.batch["response_mask"]
    # the mask is a prefix: ones up to and including EOS, zeros after
    assert torch.all(mask[:, 1:] <= mask[:, :-1])
    for row, length in zip(batch.batch["responses"], mask.sum(-1).long()):
        assert tokenizer.eos_token_id not in row[: length - 1].tolist()
        assert length == 4 or row[length - 1] == tokenizer.eos_token_id
    positions = batch.batch["position_ids"][batch.batch["attention_mask"].bool()]
    assert positions.min() == 0


def test_dispatch_reassembles_log_probs_exactly(policy, prompts, tiny_model):
    batch = rollout(policy, prompts, n=1)[[4, 0, 3, 1, 2]]  # an odd size, in a shuffled order
    result = policy.scatter("compute_log_prob", batch.select(*LOG_PROB_INPUTS), temperature=1.0, micro_batch_size=2)
    assert len(result) == 5
    expected = local_log_probs(local_model(tiny_model), batch)
    mask = batch.batch["response_mask"].bool()
    torch.testing.assert_close(result.batch["old_log_probs"][mask], expected[mask], rtol=1e-5, atol=1e-5)
    assert torch.all(result.batch["entropy"][mask] > 0)


def test_rollout_log_probs_are_the_sampling_distribution(policy, prompts):
    """The engine's own log-prob of each sampled token, at the sampling temperature, equals the trainer's."""
    batch = prompts.repeat(4)
    batch |= policy.scatter("generate", batch.select("prompts", "prompt_mask"), max_response_length=4, temperature=2.0)
    result = policy.scatter("compute_log_prob", batch.select(*LOG_PROB_INPUTS), temperature=2.0, micro_batch_size=4)
    mask = batch.batch["response_mask"].bool()
    rollout_log_probs = batch.batch["rollout_log_probs"]
    torch.testing.assert_close(rollout_log_probs[mask], result.batch["old_log_probs"][mask], rtol=1e-5, atol=1e-5)
    assert torch.all(rollout_log_probs[~mask] == 0)
    assert rollout_log_probs[mask].min() < -0.01  # sampled, not all certain


def test_update_matches_one_process_for_any_micro_batch(policy, prompts, tiny_model, tmp_path):
    """Gradient accumulation over micro-batches and 2 ranks gives the whole mini-batch's token-mean gradient."""
    batch = rollout(policy, prompts[:4], n=2)  # 8 sequences
    batch |= policy.scatter("compute_log_prob", batch.select(*LOG_PROB_INPUTS), temperature=1.0, micro_batch_size=8)
    advantages = torch.tensor([1.0, 0.2, 0.5, -0.7, 2.0, 0.1, 0.3, -1.3])
    batch.batch["advantages"] = advantages[:, None] * batch.batch["response_mask"]
    inputs = batch.select(*LOG_PROB_INPUTS, "response_mask", "old_log_probs", "advantages")
    model = local_model(tiny_model)

    cases = [(script, micro_batch_size) for script in (grpo_hybrid, dapo_hybrid) for micro_batch_size in (4, 2, 1)]
    for attempt, (script, micro_batch_size) in enumerate(cases):
        loss_fn = partial(script.actor_loss, args=script.Args(kl_loss_coef=0.0))
        before = policy.rank0("full_state_dict")
        model.load_state_dict(before, strict=False)
        model.zero_grad()
        log_prob = local_log_probs(model, batch)
        loss, _ = loss_fn(inputs.batch, (log_prob, torch.zeros_like(log_prob)), minibatch_tokens=inputs.batch["response_mask"].sum(), minibatch_seqs=8)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9).item()

        per_rank = policy.scatter("update", inputs, loss_fn=loss_fn, temperature=1.0, epochs=1, mini_batch_size=8, micro_batch_size=micro_batch_size)
        assert per_rank[0] == per_rank[1]
        assert per_rank[0]["loss"] == pytest.approx(loss.item(), rel=1e-4, abs=1e-6)
        assert per_rank[0]["grad_norm"] == pytest.approx(grad_norm, rel=1e-4)

        if attempt == 0:  # a fresh AdamW on both sides: the updated weights must agree too
            torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0).step()
            rank0, rank1 = policy.broadcast("full_state_dict")
            for name, value in rank0.items():
                torch.testing.assert_close(value, rank1[name], rtol=0, atol=0)
                torch.testing.assert_close(value, model.state_dict()[name], rtol=1e-5, atol=1e-5)


def test_reference_stays_the_base_model_after_updates(policy, prompts, tiny_model):
    batch = rollout(policy, prompts, n=2)
    reference = policy.scatter("compute_ref_log_prob", batch.select(*LOG_PROB_INPUTS), temperature=1.0, micro_batch_size=4)
    current = policy.scatter("compute_log_prob", batch.select(*LOG_PROB_INPUTS), temperature=1.0, micro_batch_size=4)
    mask = batch.batch["response_mask"].bool()
    expected = local_log_probs(local_model(tiny_model), batch)
    torch.testing.assert_close(reference.batch["ref_log_probs"][mask], expected[mask], rtol=1e-5, atol=1e-5)
    # the previous test updated the policy, so it no longer matches its reference
    assert (current.batch["old_log_probs"] - reference.batch["ref_log_probs"])[mask].abs().max() > 1e-4


def test_save_and_load_restore_weights(policy, prompts, tmp_path):
    saved = policy.rank0("full_state_dict")
    policy.broadcast("save", str(tmp_path / "checkpoint"))
    batch = rollout(policy, prompts[:4], n=2)
    batch |= policy.scatter("compute_log_prob", batch.select(*LOG_PROB_INPUTS), temperature=1.0, micro_batch_size=8)
    batch.batch["advantages"] = torch.linspace(-1, 1, 8)[:, None] * batch.batch["response_mask"]
    policy.scatter(
        "update", batch.select(*LOG_PROB_INPUTS, "response_mask", "old_log_probs", "advantages"),
        loss_fn=partial(grpo_hybrid.actor_loss, args=grpo_hybrid.Args(kl_loss_coef=0.0)),
        temperature=1.0, epochs=1, mini_batch_size=8, micro_batch_size=8,
    )  # fmt: skip
    changed = policy.rank0("full_state_dict")
    assert any(not torch.equal(saved[k], changed[k]) for k in saved)
    policy.broadcast("load", str(tmp_path / "checkpoint"))
    restored = policy.rank0("full_state_dict")
    for name in saved:
        assert torch.equal(saved[name], restored[name]), name


def test_lora_reference_is_the_base_model(cpu_pool, tiny_model, prompts):
    """With LoRA the reference is the same model with its adapter disabled; updates move only the policy."""
    group = WorkerGroup(PolicyWorker, cpu_pool, "lora-policy", model_path=tiny_model, lr=1e-2, lora_rank=4, lora_alpha=8)
    try:
        names = group.rank0("full_state_dict").keys()
        assert any("lora_A" in name for name in names)
        batch = rollout(group, prompts, n=2)
        mask = batch.batch["response_mask"].bool()
        inputs = batch.select(*LOG_PROB_INPUTS)
        base = local_log_probs(local_model(tiny_model), batch)
        reference = group.scatter("compute_ref_log_prob", inputs, temperature=1.0, micro_batch_size=4).batch["ref_log_probs"]
        torch.testing.assert_close(reference[mask], base[mask], rtol=1e-5, atol=1e-5)

        batch |= group.scatter("compute_log_prob", inputs, temperature=1.0, micro_batch_size=4)
        batch.batch["advantages"] = torch.tensor(np.linspace(-1, 1, len(batch)), dtype=torch.float32)[:, None] * batch.batch["response_mask"]
        for _ in range(3):
            group.scatter(
                "update", batch.select(*LOG_PROB_INPUTS, "response_mask", "old_log_probs", "advantages"),
                loss_fn=partial(grpo_hybrid.actor_loss, args=grpo_hybrid.Args(kl_loss_coef=0.0)),
                temperature=1.0, epochs=1, mini_batch_size=10, micro_batch_size=5,
            )  # fmt: skip
        after = group.scatter("compute_log_prob", inputs, temperature=1.0, micro_batch_size=4).batch["old_log_probs"]
        reference_after = group.scatter("compute_ref_log_prob", inputs, temperature=1.0, micro_batch_size=4).batch["ref_log_probs"]
        torch.testing.assert_close(reference_after[mask], base[mask], rtol=1e-5, atol=1e-5)
        assert (after - base)[mask].abs().max() > 1e-3
    finally:
        group.shutdown()


def test_validation_with_n_samples_reports_mean_and_pass_at_n(policy, demo_files, tokenizer):
    from common.data import PromptLoader
    from common.rewards import default_reward, validate

    data = load_prompts([demo_files[2]], tokenizer, max_prompt_length=8)[:6]
    loader = PromptLoader(data, 4, tokenizer.pad_token_id, shuffle=False, drop_last=False)
    sampling = dict(max_response_length=4, temperature=1.0, top_p=1.0, top_k=0)
    metrics, samples = validate(policy, loader, tokenizer, default_reward, sampling, n=4)
    assert len(samples) == 6 * 4
    assert metrics["val/mean@4"] == metrics["val/accuracy"] == pytest.approx(np.mean([s["score"] for s in samples]))
    by_prompt = {}
    for sample in samples:
        by_prompt[sample["prompt"]] = max(by_prompt.get(sample["prompt"], 0.0), sample["score"])
    assert metrics["val/pass@4"] == pytest.approx(np.mean(list(by_prompt.values())))
    assert metrics["val/pass@4"] >= metrics["val/mean@4"]
    greedy, greedy_samples = validate(policy, loader, tokenizer, default_reward, sampling, n=1)
    assert len(greedy_samples) == 6 and "val/pass@1" not in greedy


@pytest.mark.parametrize("flag", ["offload", "lora_merge"])
def test_vllm_only_settings_are_refused_with_the_hf_engine(cpu_pool, tiny_model, flag):
    with pytest.raises(Exception, match="act on the vllm engine only"):
        WorkerGroup(PolicyWorker, cpu_pool, "bad", model_path=tiny_model, **{flag: True})
