"""Ulysses sequence parallelism on 2 CPU ranks (real Ray actors, FSDP2 and all-to-all over gloo): a group whose 2 ranks
split every sequence's tokens gives the log-probs, entropies, values, losses, gradients and weights of a group whose
ranks each take whole sequences, for the padded and both packed layouts, with and without LoRA, for head counts that
divide by 2 and ones that do not."""

from functools import partial

import pytest
import ray
import torch
from ray import cloudpickle
from ray.util.placement_group import placement_group

import grpo_hybrid
import ppo_hybrid
from common.attention import CPU_WIDTH
from common.dataproto import DataProto
from common.sequence_parallel import check_heads, head_shares
from common.worker_group import ResourcePool, WorkerGroup
from helpers import CriticProbe, PolicyProbe, assert_same_adamw_steps

cloudpickle.register_pickle_by_value(grpo_hybrid)
cloudpickle.register_pickle_by_value(ppo_hybrid)

LOG_PROB_INPUTS = ("input_ids", "attention_mask", "position_ids", "responses")
LAYOUTS = ("padded", "rows", "shared prompts")


def made_up_batch(vocab_size: int) -> DataProto:
    """8 left-padded prompts and right-padded responses of 2 to 9 tokens; the prompts are 3, of 5, 7 and 3 tokens,
    shared by 3, 2 and 3 rows."""
    generator = torch.Generator().manual_seed(0)
    prompt_lengths, prompt_of = [5, 7, 3], [0, 0, 0, 1, 1, 2, 2, 2]
    response_lengths = [9, 4, 2, 7, 5, 3, 8, 6]
    prompts = [torch.randint(3, vocab_size, (length,), generator=generator) for length in prompt_lengths]
    width, response_width = max(prompt_lengths), max(response_lengths)
    input_ids = torch.zeros(len(prompt_of), width + response_width, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for row, (prompt, length) in enumerate(zip(prompt_of, response_lengths)):
        start = width - prompt_lengths[prompt]
        input_ids[row, start:width] = prompts[prompt]
        input_ids[row, width : width + length] = torch.randint(3, vocab_size, (length,), generator=generator)
        attention_mask[row, start : width + length] = 1
    response_mask = attention_mask[:, width:]
    return DataProto.from_dict(
        {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0),
            "responses": input_ids[:, width:],
            "response_mask": response_mask,
            "advantages": torch.linspace(-1, 1, len(prompt_of))[:, None] * response_mask,
        }
    )


def tiny_llama(path, heads: int, kv_heads: int, tokenizer) -> str:
    """A randomly initialised 2-layer Llama with `heads` query and `kv_heads` key/value heads of 16 dimensions each."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=16 * heads,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=64,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


class HalfCPUPool(ResourcePool):
    """Bundles of half a CPU: room for a group of 4 ranks beside the tests' pool of 2 on this 4-CPU Ray instance."""

    def __init__(self, num_workers: int):
        self.num_workers, self.use_gpu, self.max_colocated = num_workers, False, 2
        self.placement_group = placement_group([{"CPU": 0.5}] * num_workers, strategy="PACK")
        ray.get(self.placement_group.ready())


def groups(cpu_pool, model_path: str, worker_cls=PolicyProbe, split_pool=None, split_settings=None, **settings):
    """The same model, settings and weights twice: whole sequences per rank, and sequences split over 2 ranks (on
    `split_pool`'s ranks, default the tests' 2; with `split_settings` on top of `settings`)."""
    settings = dict(model_path=model_path, lr=1e-3, weight_decay=0.0, max_grad_norm=1e9, micro_batch_size=4) | settings
    whole = WorkerGroup(worker_cls, cpu_pool, "whole", **settings)
    try:
        split_settings = settings | (split_settings or {})
        return whole, WorkerGroup(worker_cls, split_pool or cpu_pool, "split", sequence_parallel=2, **split_settings)
    except BaseException:
        whole.shutdown()
        raise


def assert_policies_agree(whole, split, batch: DataProto) -> None:
    """In every layout: log-probs and entropies, the reference's log-probs, and an update's loss and gradient norm;
    then the weights after the updates."""
    loss_fn = partial(grpo_hybrid.actor_loss, args=grpo_hybrid.Args(kl_loss_coef=0.0))
    whole.broadcast("set", keep_gradients=True, gradients=[])
    for layout in LAYOUTS:
        outputs = []
        for group in (whole, split):
            group.broadcast("set", layout=layout)
            passed = group.scatter("compute_log_prob", batch.select(*LOG_PROB_INPUTS))
            reference = group.scatter("compute_ref_log_prob", batch.select(*LOG_PROB_INPUTS))["ref_log_probs"]
            inputs = batch.select(*LOG_PROB_INPUTS, "response_mask", "advantages") | DataProto.from_dict(
                {"old_log_probs": passed["old_log_probs"].detach()}
            )
            metrics = group.scatter("update", inputs, loss_fn=loss_fn)
            assert all(rank == metrics[0] for rank in metrics)
            outputs.append((passed["old_log_probs"], passed["entropy"], reference))
            outputs[-1] += (torch.tensor([metrics[0]["loss"], metrics[0]["grad_norm"]], dtype=torch.float64),)
        torch.testing.assert_close(outputs[1], outputs[0], rtol=1e-5, atol=1e-5, msg=lambda m: f"{layout}: {m}")
    weights_whole, weights_split = whole.broadcast("full_state_dict")[0], split.broadcast("full_state_dict")[0]
    gradients = whole.broadcast("get", "gradients")[0]  # one step a layout
    whole.broadcast("set", keep_gradients=False)
    assert_same_adamw_steps(weights_split, weights_whole, gradients, lr=1e-3, atol=1e-5)


@pytest.mark.parametrize("heads, kv_heads", [(4, 2), (3, 1)], ids=["heads-divide", "heads-do-not-divide"])
def test_split_sequences_train_as_whole_ones(cpu_pool, tokenizer, tmp_path, heads, kv_heads):
    """4 query and 2 key/value heads: each rank attends for 2 and 1 of them. 3 and 1: for 2 and 1 query heads, the
    key/value head repeated to match."""
    whole, split = groups(cpu_pool, tiny_llama(tmp_path / "llama", heads, kv_heads, tokenizer))
    try:
        assert_policies_agree(whole, split, made_up_batch(len(tokenizer)))
    finally:
        whole.shutdown()
        split.shutdown()


def test_split_sequences_train_as_whole_ones_with_lora(cpu_pool, tiny_model, tokenizer):
    """The demo model (2 query heads, 1 key/value head) with a LoRA adapter: the reference is the adapter disabled."""
    whole, split = groups(cpu_pool, tiny_model, lora_rank=4, lora_alpha=8)
    try:
        assert_policies_agree(whole, split, made_up_batch(len(tokenizer)))
    finally:
        whole.shutdown()
        split.shutdown()


def test_data_parallel_and_sequence_parallel_ranks_combine(cpu_pool, tiny_model, tokenizer):
    """4 ranks, 2 data-parallel groups of 2 sequence-parallel ranks, against 2 ranks that each take whole sequences."""
    pool = HalfCPUPool(4)
    whole, split = groups(cpu_pool, tiny_model, split_pool=pool)
    try:
        assert_policies_agree(whole, split, made_up_batch(len(tokenizer)))
    finally:
        whole.shutdown()
        split.shutdown()
        pool.shutdown()


def test_split_sequences_attend_through_block_masks_as_whole_ones(cpu_pool, tiny_model, tokenizer):
    """FlexAttention inside sequence parallelism: split workers whose micro-batches may reach CPU_WIDTH tokens pass
    their start-up check through block masks (else they fall back to the dense mask), and with block masks at every
    width give the log-probs, entropies and reference log-probs of whole sequences over a dense mask (on the CPU only
    the passes without gradients take them)."""
    batch = made_up_batch(len(tokenizer)).select(*LOG_PROB_INPUTS)
    whole, split = groups(cpu_pool, tiny_model, split_settings=dict(micro_batch_tokens=CPU_WIDTH))
    try:
        assert split.broadcast("get", "flex_from") == [CPU_WIDTH] * 2
        split.broadcast("set", flex_from=0)
        for layout in ("rows", "shared prompts"):
            outputs = []
            for group in (whole, split):
                group.broadcast("set", layout=layout)
                passed = group.scatter("compute_log_prob", batch)
                reference = group.scatter("compute_ref_log_prob", batch)["ref_log_probs"]
                outputs.append((passed["old_log_probs"], passed["entropy"], reference))
            torch.testing.assert_close(outputs[1], outputs[0], rtol=1e-5, atol=1e-5, msg=lambda m: f"{layout}: {m}")
    finally:
        whole.shutdown()
        split.shutdown()


def test_split_sequences_give_a_critic_its_values_and_gradients(cpu_pool, tiny_model, tokenizer):
    batch = made_up_batch(len(tokenizer))
    batch["values"] = torch.zeros_like(batch["advantages"])
    batch["returns"] = batch["advantages"] * 3
    loss_fn = partial(ppo_hybrid.critic_loss, args=ppo_hybrid.Args())
    whole, split = groups(cpu_pool, tiny_model, worker_cls=CriticProbe)
    try:
        for layout in LAYOUTS:
            outputs = []
            for group in (whole, split):
                group.broadcast("set", layout=layout)
                values = group.scatter("compute_values", batch.select(*LOG_PROB_INPUTS))["values"]
                metrics = group.scatter("update", batch, loss_fn=loss_fn)[0]
                outputs.append((values, torch.tensor([metrics["loss"], metrics["grad_norm"]], dtype=torch.float64)))
            torch.testing.assert_close(outputs[1], outputs[0], rtol=1e-5, atol=1e-5, msg=lambda m: f"{layout}: {m}")
    finally:
        whole.shutdown()
        split.shutdown()


def test_heads_are_dealt_evenly_and_too_few_are_refused(tiny_model):
    assert head_shares(9, 2) == [5, 4]
    assert head_shares(4, 2) == [2, 2]
    assert head_shares(2, 2) == [1, 1]
    check_heads(tiny_model, 2)
    with pytest.raises(ValueError, match="--sequence-parallel 3: .* has 2 attention heads, .* use at most 2"):
        check_heads(tiny_model, 3)
