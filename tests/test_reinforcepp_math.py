"""REINFORCE++'s math against values computed by hand: returns within each response, whitened over the batch, with
and without the group baseline."""

import numpy as np
import pytest
import torch

from reinforcepp_hybrid import (
    compute_reinforcepp_advantages,
    compute_reinforcepp_baseline_advantages,
    compute_returns,
    kl_penalised_rewards,
    masked_whiten,
)


def test_returns_are_the_reward_to_go_within_each_response():
    rewards = torch.tensor([[0.0, 1.0, 2.0, 9.0], [3.0, 9.0, 9.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 0.0, 0.0]])  # what follows a response counts for nothing
    assert compute_returns(rewards, mask, 1.0).tolist() == [[3.0, 3.0, 2.0, 0.0], [3.0, 0.0, 0.0, 0.0]]
    assert compute_returns(rewards, mask, 0.5).tolist() == [[1.0, 2.0, 2.0, 0.0], [3.0, 0.0, 0.0, 0.0]]


def test_returns_skip_the_environments_tokens_of_a_multi_turn_episode():
    rewards = torch.tensor([[0.0, 1.0, 9.0, 9.0, 2.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0, 1.0, 0.0]])  # model, model, env, env, model, padding
    assert compute_returns(rewards, mask, 0.5).tolist() == [[1.0, 2.0, 0.0, 0.0, 2.0, 0.0]]
    scored = kl_penalised_rewards(torch.tensor([3.0]), torch.zeros(1, 6), mask, 0.1)
    assert scored.tolist() == [[0.0, 0.0, 0.0, 0.0, 3.0, 0.0]]


def test_reinforcepp_advantages_are_returns_whitened_over_the_batch():
    scores, mask = torch.tensor([1.0, 0.0, 1.0]), torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    kl = torch.tensor([[0.1, -0.2, 0.3], [0.2, 0.1, 7.0], [0.4, 7.0, 7.0]])
    token_rewards = kl_penalised_rewards(scores, kl, mask, 0.1)
    advantages = compute_reinforcepp_advantages(token_rewards, mask, 1.0)
    # by hand: the returns of each valid token (row by row), then their mean and Bessel-corrected std over all six
    returns = [0.98, 0.99, 0.97, -0.03, -0.01, 0.96]
    mean, std = np.mean(returns), np.std(returns, ddof=1)
    assert advantages[mask.bool()].tolist() == pytest.approx([(r - mean) / std for r in returns], rel=1e-5)
    assert advantages[~mask.bool()].tolist() == [0.0] * 3


def test_reinforcepp_baseline_subtracts_the_group_mean_then_whitens():
    token_rewards = torch.tensor([[0.0, 1.0], [0.0, 0.0], [0.0, 1.0], [2.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 1.0], [1.0, 0.0], [1.0, 0.0]])
    uids = np.array(["a", "a", "b", "c"], dtype=object)
    advantages = compute_reinforcepp_baseline_advantages(token_rewards, mask, uids)
    # rewards 1, 0 (group a, mean 0.5), 0 (token 2 is masked; b alone keeps it), 2 (c alone); tiled over valid tokens
    tiled = torch.tensor([[0.5, 0.5], [-0.5, -0.5], [0.0, 0.0], [2.0, 0.0]])
    assert torch.allclose(advantages, masked_whiten(tiled, mask) * mask)
    values = [0.5, 0.5, -0.5, -0.5, 0.0, 2.0]
    mean, std = np.mean(values), np.std(values, ddof=1)
    assert advantages[0, 0].item() == pytest.approx((0.5 - mean) / std, rel=1e-5)
