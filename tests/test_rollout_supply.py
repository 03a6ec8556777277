"""common/rollout_supply.py: the prompts a run draws, the samples the policy's own engine generates from them, and the
data position a resumed run stands at (the engines apart from the policy: test_split_placement.py)."""

import numpy as np
import pytest
import torch

from common.args import RunArgs, engine_settings
from common.data import PromptLoader, load_prompts
from common.rollout_supply import RolloutSupply
from common.worker_group import WorkerGroup
from common.workers import PolicyWorker


def supply_of(demo_files, tokenizer, **changes) -> RolloutSupply:
    """A supply of the demo's prompts, 4 a batch, with no environment."""
    args = RunArgs(train_files=[demo_files[1]], max_prompt_length=8, max_response_length=4, train_batch_size=4, **changes)
    loader = PromptLoader(load_prompts(args.train_files, tokenizer, 8), 4, tokenizer.pad_token_id, shuffle=True, seed=1)
    return RolloutSupply(args, engine_settings(args), tokenizer, [tokenizer.eos_token_id], loader, None, 0)


def test_the_policy_generates_unless_engines_apart_do(demo_files, tokenizer):
    assert supply_of(demo_files, tokenizer).policy_settings()["generates"]
    apart = supply_of(demo_files, tokenizer, rollout_workers=1).policy_settings()
    assert not apart["generates"] and apart["engine"].temperature == 1.0  # the policy's log-probs still at it
    assert supply_of(demo_files, tokenizer).groups() == {}


def test_a_resumed_supply_draws_the_prompts_the_run_had_not_reached(demo_files, tokenizer):
    first = supply_of(demo_files, tokenizer)
    first.next_prompts()
    saved = first.checkpoint_state()
    expected = first.next_prompts()
    resumed = supply_of(demo_files, tokenizer)
    resumed.restore(5, saved)
    assert resumed.version == 5
    assert list(resumed.next_prompts()["uid"]) == list(expected["uid"])
    assert not np.array_equal(supply_of(demo_files, tokenizer).next_prompts()["uid"], expected["uid"])


@pytest.fixture
def policy(cpu_pool, tiny_model):
    group = WorkerGroup(PolicyWorker, cpu_pool, "supply_policy", model_path=tiny_model, use_reference=False)
    yield group
    group.shutdown()


def test_rollouts_are_n_samples_of_each_prompt_from_the_policy_as_it_is(demo_files, tokenizer, policy):
    supply = supply_of(demo_files, tokenizer)
    supply.start(policy, None, None)
    supply.version = 3  # the updates the run made so far
    metrics = {}
    batch = supply.next_rollouts(2, metrics)
    assert len(batch) == 8 and batch["responses"].shape == (8, 4)
    assert list(batch["uid"][::2]) == list(batch["uid"][1::2])  # a prompt's samples side by side, sharing its uid
    assert len(set(batch["uid"])) == 4
    assert torch.equal(batch["weight_version"], torch.full((8,), 3)) and torch.equal(
        batch["staleness"], torch.zeros(8, dtype=torch.long)
    )
    assert metrics == {}
