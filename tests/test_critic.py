"""The critic worker group on 2 CPU ranks against one plain process."""

from functools import partial

import pytest
import torch
from ray import cloudpickle

import ppo_hybrid
from common.data import collate, load_prompts
from common.worker_group import WorkerGroup
from common.workers import PolicyWorker
from helpers import CriticProbe, assert_same_adamw_steps

cloudpickle.register_pickle_by_value(ppo_hybrid)
INPUTS = ("input_ids", "attention_mask", "position_ids", "responses")


def test_critic_values_and_update_match_one_process(cpu_pool, tiny_model, demo_files, tokenizer):
    from transformers import AutoModelForTokenClassification

    prompts = collate(load_prompts([demo_files[1]], tokenizer, max_prompt_length=8)[:3], tokenizer.pad_token_id).repeat(2)
    policy = WorkerGroup(PolicyWorker, cpu_pool, "policy", model_path=tiny_model, use_reference=False)
    critic = WorkerGroup(
        CriticProbe, cpu_pool, "critic", model_path=tiny_model, lr=1e-3, max_grad_norm=1e9, micro_batch_size=2
    )
    try:
        batch = prompts | policy.scatter("generate", prompts.select("prompts", "prompt_mask"), max_response_length=4)
        batch |= critic.scatter("compute_values", batch.select(*INPUTS))
        assert batch["values"].shape == batch["responses"].shape == (6, 4)

        model = AutoModelForTokenClassification.from_pretrained(tiny_model, num_labels=1)
        model.load_state_dict(critic.broadcast("full_state_dict")[0])
        local_values = model(**{k: batch[k] for k in INPUTS[:3]}).logits[:, -5:-1, 0]
        mask = batch["response_mask"].bool()
        torch.testing.assert_close(batch["values"][mask], local_values.detach()[mask], rtol=1e-5, atol=1e-5)

        batch["returns"] = torch.linspace(0, 1, 6)[:, None] * batch["response_mask"]
        loss_fn = partial(ppo_hybrid.critic_loss, args=ppo_hybrid.Args())
        inputs = batch.select(*INPUTS, "response_mask", "values", "returns")
        loss, _ = loss_fn(inputs, local_values, minibatch_tokens=batch["response_mask"].sum(), minibatch_seqs=6)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9).item()
        per_rank = critic.scatter("update", inputs, loss_fn=loss_fn)
        assert per_rank[0]["loss"] == pytest.approx(loss.item(), rel=1e-4)
        assert per_rank[0]["grad_norm"] == pytest.approx(grad_norm, rel=1e-4)
        gradients = {name: p.grad.clone() for name, p in model.named_parameters()}
        torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0).step()
        rank0, rank1 = critic.broadcast("full_state_dict")
        for name, value in rank0.items():
            assert torch.equal(value, rank1[name])
        assert_same_adamw_steps(rank0, model.state_dict(), [gradients], lr=1e-3, atol=1e-5)
    finally:
        policy.shutdown()
        critic.shutdown()
