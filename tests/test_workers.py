"""The policy worker group on 2 CPU ranks (real Ray actors, FSDP2 over gloo) against one plain process."""

import math
import sys
from functools import partial

import numpy as np
import pytest
import torch
from ray import cloudpickle

import dapo_hybrid
import grpo_hybrid
from common.data import load_prompts
from common.fsdp_worker import lr_factor
from common.engine_registry import check_rollout
from common.engines import EngineSettings
from common.worker_group import WorkerGroup
from helpers import LOG_PROB_INPUTS, PolicyProbe, assert_same_adamw_steps, local_log_probs, local_model

# The loss travels to the workers by value, as it does from a script run as __main__; so do the probes below.
cloudpickle.register_pickle_by_value(grpo_hybrid)
cloudpickle.register_pickle_by_value(dapo_hybrid)
cloudpickle.register_pickle_by_value(sys.modules[__name__])


@pytest.fixture(scope="module")
def policy(cpu_pool, tiny_model):
    settings = dict(lr=1e-3, weight_decay=0.0, max_grad_norm=1e9, micro_batch_size=2)
    group = WorkerGroup(PolicyProbe, cpu_pool, "policy", model_path=tiny_model, **settings)
    yield group
    group.shutdown()


def rollout(policy, prompts, n=1):
    batch = prompts.repeat(n)
    return batch | policy.scatter("generate", batch.select("prompts", "prompt_mask"), max_response_length=4)


class PerLayerProbe(PolicyProbe):
    min_unit_params = 0


def test_small_layers_share_a_unit_and_large_ones_get_their_own(policy, cpu_pool, tiny_model, prompts):
    """The tiny model's layers are far under a million parameters: one unit, the root, holds them (fewer collectives);
    with a unit per layer, as a model of real size gets, the log-probs are the same."""
    assert policy.broadcast("fsdp_units") == [1, 1]
    per_layer = WorkerGroup(PerLayerProbe, cpu_pool, "per_layer", model_path=tiny_model)
    try:
        assert per_layer.broadcast("fsdp_units") == [3, 3]  # two decoder layers and the root
        batch = rollout(policy, prompts, n=2)
        one_unit = policy.scatter("compute_log_prob", batch.select(*LOG_PROB_INPUTS))["old_log_probs"]
        torch.testing.assert_close(
            per_layer.scatter("compute_log_prob", batch.select(*LOG_PROB_INPUTS))["old_log_probs"], one_unit
        )
    finally:
        per_layer.shutdown()


def test_generate_returns_aligned_sequences(policy, prompts, tokenizer):
    batch = rollout(policy, prompts)  # 5 prompts over 2 ranks: padded to 6, unpadded back
    assert len(batch) == 5
    prompt_length = prompts["prompts"].shape[1]
    assert torch.equal(batch["input_ids"][:, :prompt_length], prompts["prompts"])
    assert batch["responses"].shape == (5, 4)
    mask = batch["response_mask"]
    # the mask is a prefix: ones up to and including EOS, zeros after
    assert torch.all(mask[:, 1:] <= mask[:, :-1])
    for row, length in zip(batch["responses"], mask.sum(-1).long()):
        assert tokenizer.eos_token_id not in row[: length - 1].tolist()
        assert length == 4 or row[length - 1] == tokenizer.eos_token_id
    positions = batch["position_ids"][batch["attention_mask"].bool()]
    assert positions.min() == 0


def test_dispatch_reassembles_log_probs_exactly(policy, prompts, tiny_model):
    batch = rollout(policy, prompts, n=1)[[4, 0, 3, 1, 2]]  # an odd size, in a shuffled order
    result = policy.scatter("compute_log_prob", batch.select(*LOG_PROB_INPUTS))
    assert len(result) == 5
    expected = local_log_probs(local_model(tiny_model), batch)
    mask = batch["response_mask"].bool()
    torch.testing.assert_close(result["old_log_probs"][mask], expected[mask], rtol=1e-5, atol=1e-5)
    assert torch.all(result["entropy"][mask] > 0)


def test_rollout_log_probs_are_the_sampling_distribution(policy, prompts):
    """The engine's own log-prob of each sampled token, at the sampling temperature, equals the trainer's."""
    batch = prompts.repeat(4)
    policy.broadcast("set_temperature", 2.0)
    try:
        batch |= policy.scatter("generate", batch.select("prompts", "prompt_mask"), max_response_length=4)
        result = policy.scatter("compute_log_prob", batch.select(*LOG_PROB_INPUTS))
    finally:
        policy.broadcast("set_temperature", 1.0)
    mask = batch["response_mask"].bool()
    rollout_log_probs = batch["rollout_log_probs"]
    torch.testing.assert_close(rollout_log_probs[mask], result["old_log_probs"][mask], rtol=1e-5, atol=1e-5)
    assert torch.all(rollout_log_probs[~mask] == 0)
    assert rollout_log_probs[mask].min() < -0.01  # sampled, not all certain


def test_update_matches_one_process_for_any_micro_batch(policy, prompts, tiny_model, tmp_path):
    """Gradient accumulation over micro-batches and 2 ranks gives the whole mini-batch's token-mean gradient."""
    batch = rollout(policy, prompts[:4], n=2)  # 8 sequences
    batch |= policy.scatter("compute_log_prob", batch.select(*LOG_PROB_INPUTS))
    advantages = torch.tensor([1.0, 0.2, 0.5, -0.7, 2.0, 0.1, 0.3, -1.3])
    batch["advantages"] = advantages[:, None] * batch["response_mask"]
    inputs = batch.select(*LOG_PROB_INPUTS, "response_mask", "old_log_probs", "advantages")
    model = local_model(tiny_model)

    by_rows = [{"micro_batch_size": size, "micro_batch_tokens": 0} for size in (4, 2, 1)]
    by_tokens = [{"micro_batch_tokens": budget} for budget in (12, 30)]  # a sequence here is 5 to 12 tokens
    cases = [(script, micro) for script in (grpo_hybrid, dapo_hybrid) for micro in by_rows + by_tokens]
    for attempt, (script, micro) in enumerate(cases):
        loss_fn = partial(script.actor_loss, args=script.Args(kl_loss_coef=0.0))
        before = policy.broadcast("full_state_dict")[0]
        model.load_state_dict(before, strict=False)
        model.zero_grad()
        log_prob = local_log_probs(model, batch)
        outputs, tokens = (log_prob, torch.zeros_like(log_prob)), inputs["response_mask"].sum()
        loss, _ = loss_fn(inputs, outputs, minibatch_tokens=tokens, minibatch_seqs=8)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9).item()

        policy.broadcast("set", mini_batch_size=8, **micro)
        per_rank = policy.scatter("update", inputs, loss_fn=loss_fn)
        assert per_rank[0] == per_rank[1]
        assert per_rank[0]["loss"] == pytest.approx(loss.item(), rel=1e-4, abs=1e-6)
        assert per_rank[0]["grad_norm"] == pytest.approx(grad_norm, rel=1e-4)

        if attempt == 0:  # a fresh AdamW on both sides: the updated weights must agree too
            gradients = {name: p.grad.clone() for name, p in model.named_parameters()}
            torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0).step()
            rank0, rank1 = policy.broadcast("full_state_dict")
            for name, value in rank0.items():
                torch.testing.assert_close(value, rank1[name], rtol=0, atol=0)
            assert_same_adamw_steps(rank0, model.state_dict(), [gradients], lr=1e-3, atol=1e-5)
    policy.broadcast("set", mini_batch_size=None, micro_batch_size=2, micro_batch_tokens=0)


def test_ranks_get_even_tokens_and_micro_batches_fit_the_budget(policy, prompts, tokenizer):
    from common.rollout import response_batch

    # responses of 4 tokens first, then of 1: split in order, one rank would get most of the tokens
    response_lengths = torch.tensor([4] * 8 + [2] * 4 + [1] * 8)
    batch = prompts.repeat(4)
    responses = torch.randint(10, 60, (20, 4), generator=torch.Generator().manual_seed(0))
    responses[torch.arange(4)[None] == response_lengths[:, None] - 1] = tokenizer.eos_token_id
    batch |= response_batch(
        batch["prompts"], batch["prompt_mask"], responses, torch.zeros(20, 4), 4, [tokenizer.eos_token_id], 0
    )
    lengths = batch["attention_mask"].sum(-1)
    rows, tokens, distinct_prompts = zip(*policy.scatter("load_of", batch.select(*LOG_PROB_INPUTS, "prompts")))
    assert rows == (10, 10) and sum(tokens) == lengths.sum()
    # 5 prompts x 4 samples: 2 prompts' samples whole on each rank, the fifth's split, to share the prompts' tokens
    assert distinct_prompts == (3, 3)
    assert abs(tokens[0] - tokens[1]) <= lengths.max()
    halves = batch["attention_mask"].sum(-1).split(10)
    assert abs(tokens[0] - tokens[1]) < abs(halves[0].sum() - halves[1].sum())

    policy.broadcast("set", micro_batch_tokens=24)
    try:
        (loads, rows), (other_loads, other_rows) = policy.scatter("micro_batch_loads", batch.select(*LOG_PROB_INPUTS))
        result = policy.scatter("compute_log_prob", batch.select(*LOG_PROB_INPUTS))
    finally:
        policy.broadcast("set", micro_batch_tokens=0)
    assert len(loads) == len(other_loads) >= math.ceil(max(sum(loads), sum(other_loads)) / 24)  # one forward each at once
    assert max(loads + other_loads) <= 24 and rows == other_rows == list(range(10))
    reference = policy.scatter("compute_log_prob", batch.select(*LOG_PROB_INPUTS))
    mask = batch["response_mask"].bool()
    torch.testing.assert_close(result["old_log_probs"][mask], reference["old_log_probs"][mask], rtol=1e-5, atol=1e-5)


def test_reference_stays_the_base_model_after_updates(policy, prompts, tiny_model):
    batch = rollout(policy, prompts, n=2)
    reference = policy.scatter("compute_ref_log_prob", batch.select(*LOG_PROB_INPUTS))
    current = policy.scatter("compute_log_prob", batch.select(*LOG_PROB_INPUTS))
    mask = batch["response_mask"].bool()
    expected = local_log_probs(local_model(tiny_model), batch)
    torch.testing.assert_close(reference["ref_log_probs"][mask], expected[mask], rtol=1e-5, atol=1e-5)
    # the previous test updated the policy, so it no longer matches its reference
    assert (current["old_log_probs"] - reference["ref_log_probs"])[mask].abs().max() > 1e-4


def test_save_and_load_restore_weights(policy, prompts, tmp_path):
    saved = policy.broadcast("full_state_dict")[0]
    policy.broadcast("save", str(tmp_path / "checkpoint"))
    batch = rollout(policy, prompts[:4], n=2)
    batch |= policy.scatter("compute_log_prob", batch.select(*LOG_PROB_INPUTS))
    batch["advantages"] = torch.linspace(-1, 1, 8)[:, None] * batch["response_mask"]
    inputs = batch.select(*LOG_PROB_INPUTS, "response_mask", "old_log_probs", "advantages")
    policy.scatter("update", inputs, loss_fn=partial(grpo_hybrid.actor_loss, args=grpo_hybrid.Args(kl_loss_coef=0.0)))
    changed = policy.broadcast("full_state_dict")[0]
    assert any(not torch.equal(saved[k], changed[k]) for k in saved)
    policy.broadcast("load", str(tmp_path / "checkpoint"))
    restored = policy.broadcast("full_state_dict")[0]
    for name in saved:
        assert torch.equal(saved[name], restored[name]), name


def test_log_probs_in_chunks_train_as_whole_ones_through_fsdp(policy, prompts, tmp_path):
    """Log-probs 2 response tokens at a time in the log-prob pass and the update (there each chunk's logits are
    computed again in backward, inside FSDP's root unit): the same log-probs, entropies, gradient norm and weights
    after the step as with all of a micro-batch's at once."""
    policy.broadcast("save", str(tmp_path / "checkpoint"))
    batch = rollout(policy, prompts[:4], n=2)
    batch["advantages"] = torch.linspace(-1, 1, 8)[:, None] * batch["response_mask"]
    inputs = batch.select(*LOG_PROB_INPUTS, "response_mask", "rollout_log_probs", "advantages")
    loss_fn = partial(grpo_hybrid.actor_loss, args=grpo_hybrid.Args(kl_loss_coef=0.0))
    results = []
    for chunk_tokens in (2, 0):
        policy.broadcast("set", log_prob_chunk_tokens=chunk_tokens, keep_gradients=True, gradients=[])
        passed = policy.scatter("compute_log_prob", batch.select(*LOG_PROB_INPUTS))
        metrics = policy.scatter("update", inputs, loss_fn=loss_fn)
        results.append((passed["old_log_probs"], passed["entropy"], metrics[0]["grad_norm"]))
        results[-1] += (policy.broadcast("full_state_dict")[0],)
        policy.broadcast("load", str(tmp_path / "checkpoint"))
    policy.broadcast("set", keep_gradients=False)
    (*chunked, chunked_weights), (*whole, whole_weights) = results
    torch.testing.assert_close(chunked, whole, rtol=1e-5, atol=1e-6)
    gradients = policy.broadcast("get", "gradients")[0]  # the whole log-probs' step
    assert_same_adamw_steps(chunked_weights, whole_weights, gradients, lr=1e-3, atol=1e-6)
    assert any(
        (whole_weights[name] - weight).abs().max() > 1e-4 for name, weight in policy.broadcast("full_state_dict")[0].items()
    )


def test_bf16_compute_over_fp32_master_weights(cpu_pool, tiny_model, prompts):
    """--compute-dtype bfloat16 on the CPU: passes and generation in bf16 near the fp32 model's log-probs, the packing
    check still passes (at bf16's tolerance), the engine's log-probs stay within the guard's bound, and the weights an
    update changes stay fp32."""
    group = WorkerGroup(PolicyProbe, cpu_pool, "bf16", model_path=tiny_model, compute_dtype="bfloat16", lr=1e-2)
    try:
        assert group.broadcast("compute_setup")[0] == ("torch.bfloat16", "shared prompts", ["torch.float32"])
        batch = rollout(group, prompts, n=4)
        batch |= group.scatter("compute_log_prob", batch.select(*LOG_PROB_INPUTS))
        mask = batch["response_mask"].bool()
        fp32 = local_log_probs(local_model(tiny_model), batch)[mask]
        gap_to_fp32 = (batch["old_log_probs"][mask] - fp32).abs()
        # bf16 keeps 8 bits of each number: every log-prob within a few percent of itself (an unlikely token's by a
        # tenth of a nat), and their mean, which the guard reads, within a hundredth
        assert 0 < gap_to_fp32.mean() < 0.01
        assert torch.all(gap_to_fp32 <= 0.03 * fp32.abs() + 0.01)
        assert (batch["old_log_probs"] - batch["rollout_log_probs"])[mask].abs().mean() < 0.1
        before = group.broadcast("full_state_dict")[0]
        batch["advantages"] = torch.linspace(-1, 1, len(batch))[:, None] * batch["response_mask"]
        inputs = batch.select(*LOG_PROB_INPUTS, "response_mask", "old_log_probs", "advantages")
        group.scatter("update", inputs, loss_fn=partial(grpo_hybrid.actor_loss, args=grpo_hybrid.Args(kl_loss_coef=0.0)))
        after = group.broadcast("full_state_dict")[0]
        assert all(tensor.dtype == torch.float32 for tensor in after.values())
        assert any(not torch.equal(before[name], after[name]) for name in before)
    finally:
        group.shutdown()


def test_lora_reference_is_the_base_model(cpu_pool, tiny_model, prompts):
    """With LoRA the reference is the same model with its adapter disabled; updates move only the policy."""
    group = WorkerGroup(
        PolicyProbe, cpu_pool, "lora-policy", model_path=tiny_model, lr=1e-2, lora_rank=4, lora_alpha=8, micro_batch_size=5
    )
    try:
        names = group.broadcast("full_state_dict")[0].keys()
        assert any("lora_A" in name for name in names)
        batch = rollout(group, prompts, n=2)
        mask = batch["response_mask"].bool()
        inputs = batch.select(*LOG_PROB_INPUTS)
        base = local_log_probs(local_model(tiny_model), batch)
        reference = group.scatter("compute_ref_log_prob", inputs)["ref_log_probs"]
        torch.testing.assert_close(reference[mask], base[mask], rtol=1e-5, atol=1e-5)

        batch |= group.scatter("compute_log_prob", inputs)
        batch["advantages"] = (
            torch.tensor(np.linspace(-1, 1, len(batch)), dtype=torch.float32)[:, None] * batch["response_mask"]
        )
        for _ in range(3):
            inputs_for_update = batch.select(*LOG_PROB_INPUTS, "response_mask", "old_log_probs", "advantages")
            group.scatter(
                "update", inputs_for_update, loss_fn=partial(grpo_hybrid.actor_loss, args=grpo_hybrid.Args(kl_loss_coef=0.0))
            )
        after = group.scatter("compute_log_prob", inputs)["old_log_probs"]
        reference_after = group.scatter("compute_ref_log_prob", inputs)["ref_log_probs"]
        torch.testing.assert_close(reference_after[mask], base[mask], rtol=1e-5, atol=1e-5)
        assert (after - base)[mask].abs().max() > 1e-3
    finally:
        group.shutdown()


def test_peak_memory_is_measured_per_method(policy, prompts):
    """Each method's peak memory counts from its own start: the gigabyte one call held is not in the next call's
    peak (Linux resets the resident set's high-water mark; a GPU, its allocator's). Each peak is read once."""
    policy.broadcast("phase_peak_memory")
    policy.broadcast("hold", 1.0)
    batch = rollout(policy, prompts)
    policy.scatter("compute_log_prob", batch.select(*LOG_PROB_INPUTS))
    for peaks in policy.broadcast("phase_peak_memory"):
        assert set(peaks) == {"hold", "generate", "compute_log_prob"}
        assert peaks["hold"] > peaks["compute_log_prob"] + 0.9 and peaks["hold"] > peaks["generate"] + 0.9
        assert peaks["compute_log_prob"] > 0
    assert policy.broadcast("phase_peak_memory") == [{}, {}]


@pytest.mark.parametrize("compute_dtype", ["float32", "bfloat16"])
def test_lora_frozen_weights_replicated_or_sharded_compute_alike(policy, cpu_pool, tiny_model, prompts, compute_dtype):
    """With LoRA the frozen base weights are whole on every rank when they fit (the tiny model's do), in the compute
    dtype, else sharded as the adapter is: the log-probs, the reference's, the update and the adapter it leaves are
    the same either way."""
    batch = rollout(policy, prompts, n=2)
    batch["advantages"] = torch.linspace(-1, 1, len(batch))[:, None] * batch["response_mask"]
    settings = dict(model_path=tiny_model, lr=1e-2, lora_rank=4, lora_alpha=8, micro_batch_size=3, compute_dtype=compute_dtype)
    results = {}
    for replicate in (None, False):
        group = WorkerGroup(PolicyProbe, cpu_pool, f"lora-frozen-{replicate}", replicate_frozen=replicate, **settings)
        try:
            layouts = group.broadcast("parameter_layouts")
            inputs = batch.select(*LOG_PROB_INPUTS)
            log_probs = group.scatter("compute_log_prob", inputs)["old_log_probs"]
            reference = group.scatter("compute_ref_log_prob", inputs)["ref_log_probs"]
            loss_fn = partial(grpo_hybrid.actor_loss, args=grpo_hybrid.Args(kl_loss_coef=0.0))
            update_inputs = batch.select(*LOG_PROB_INPUTS, "response_mask", "rollout_log_probs", "advantages")
            metrics = group.scatter("update", update_inputs, loss_fn=loss_fn)
            trained = {name: t for name, t in group.broadcast("full_state_dict")[0].items() if "lora_" in name}
            results[replicate] = layouts, log_probs, reference, metrics[0]["grad_norm"], trained
        finally:
            group.shutdown()
    (replicated_layouts, *replicated), (sharded_layouts, *sharded) = results[None], results[False]
    adapter = "sharded torch.float32"  # master weights
    assert replicated_layouts[0] == replicated_layouts[1] == {"adapter": adapter, "base": f"whole torch.{compute_dtype}"}
    assert sharded_layouts[0] == {"adapter": adapter, "base": "sharded torch.float32"}
    torch.testing.assert_close(replicated, sharded, rtol=1e-5, atol=1e-6)


def test_validation_with_n_samples_reports_mean_and_pass_at_n(policy, demo_files, tokenizer):
    from common.data import PromptLoader
    from common.isolation import InProcessCalls
    from common.rewards import REWARD_CALLS, default_reward, score_texts, validate

    data = load_prompts([demo_files[2]], tokenizer, max_prompt_length=8)[:6]
    loader = PromptLoader(data, 4, tokenizer.pad_token_id, shuffle=False, drop_last=False)
    sampling = dict(max_response_length=4, top_p=1.0, top_k=0)

    def generate(batch, do_sample):
        return policy.scatter("generate", batch.select("prompts", "prompt_mask"), **sampling, do_sample=do_sample)

    def score_responses(texts, batch):
        return score_texts(texts, batch, InProcessCalls(default_reward, None, REWARD_CALLS))

    metrics, samples = validate(generate, loader, tokenizer, score_responses, n=4)
    assert len(samples) == 6 * 4
    assert metrics["val/mean@4"] == metrics["val/accuracy"] == pytest.approx(np.mean([s["score"] for s in samples]))
    by_prompt = {}
    for sample in samples:
        by_prompt[sample["prompt"]] = max(by_prompt.get(sample["prompt"], 0.0), sample["score"])
    assert metrics["val/pass@4"] == pytest.approx(np.mean(list(by_prompt.values())))
    assert metrics["val/pass@4"] >= metrics["val/mean@4"]
    greedy, greedy_samples = validate(generate, loader, tokenizer, score_responses, n=1)
    assert len(greedy_samples) == 6 and "val/pass@1" not in greedy


@pytest.mark.parametrize("setting", [dict(offload=True), dict(lora_sync="merged"), dict(lora_sync="adapter")])
def test_vllm_only_settings_are_refused_with_the_hf_engine(setting):
    with pytest.raises(ValueError, match="act on the vllm engine only"):
        check_rollout(EngineSettings(name="hf", **setting))


def test_lr_factor_warms_up_then_decays_along_a_cosine_to_zero():
    assert [lr_factor(update, 2, 0) for update in range(4)] == [0.5, 1.0, 1.0, 1.0]
    cosine = [1.0, (1 + math.cos(math.pi / 4)) / 2, 0.5, (1 + math.cos(3 * math.pi / 4)) / 2, 0.0, 0.0]
    assert [lr_factor(update, 2, 4) for update in range(8)] == pytest.approx([0.5, 1.0, *cosine])
