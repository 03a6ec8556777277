"""RLOO's, REINFORCE++'s and GSPO's math against values computed by hand and against each paper's formula."""

import math

import numpy as np
import pytest
import torch

from gspo_hybrid import Args as GSPOArgs
from gspo_hybrid import compute_policy_loss as gspo_policy_loss
from reinforcepp_hybrid import (
    compute_reinforcepp_advantages,
    compute_reinforcepp_baseline_advantages,
    compute_returns,
    kl_penalised_rewards,
    masked_whiten,
)
from rloo_hybrid import compute_rloo_advantages, kl_penalised_scores


def test_rloo_baseline_is_the_mean_of_the_others():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 0.5, 2.0, 3.0])
    uids = np.array(["a", "a", "a", "a", "b", "b", "c"], dtype=object)
    # group a: 1 - mean(0, 0, 1) = 2/3 and 0 - mean(1, 0, 1) = -2/3; group b: 0.5 - 2 and 2 - 0.5; c alone keeps 3
    expected = [2 / 3, -2 / 3, -2 / 3, 2 / 3, -1.5, 1.5, 3.0]
    assert compute_rloo_advantages(rewards, uids).tolist() == pytest.approx(expected)
    # verl 0.9.1's form of the same estimator: k / (k - 1) x (reward - group mean)
    group_a = rewards[:4]
    assert (4 / 3 * (group_a - group_a.mean())).tolist() == pytest.approx(expected[:4])


def test_rloo_reward_carries_the_sequence_kl():
    kl, mask = torch.tensor([[0.1, 0.2, 0.3], [0.5, 0.5, 0.5]]), torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    assert kl_penalised_scores(torch.tensor([1.0, 0.0]), kl, mask, 0.1).tolist() == pytest.approx([1 - 0.03, -0.05])


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


def sequence_objective(old_log_prob, log_prob, advantages, mask, clip_low, clip_high):
    """The paper's equations 5-7 written per sequence: s_i = exp(mean_t log(pi / pi_old)), the clipped surrogate,
    averaged over sequences."""
    lengths = mask.sum(-1)
    s = (((log_prob - old_log_prob) * mask).sum(-1) / lengths).exp()
    a = advantages[:, 0]
    return torch.maximum(-a * s, -a * s.clamp(1 - clip_low, 1 + clip_high)).mean()


def test_gspo_token_loss_and_gradient_equal_the_sequence_objective():
    torch.manual_seed(0)
    old = -torch.rand(3, 4) - 0.5
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 0.0]])
    advantages = torch.tensor([1.0, -1.0, 0.5])[:, None] * mask
    for shift, clip in [(0.0, (3e-4, 4e-4)), (1e-4, (3e-4, 4e-4)), (0.01, (3e-4, 4e-4)), (0.01, (0.2, 0.2))]:
        new = (old + shift * torch.arange(4.0)).requires_grad_()
        reference = new.detach().clone().requires_grad_()
        loss, _ = gspo_policy_loss(old, new, advantages, mask, *clip, "seq-mean-token-mean")
        expected = sequence_objective(old, reference, advantages, mask, *clip)
        assert loss.item() == pytest.approx(expected.item(), rel=1e-6)
        loss.backward()
        expected.backward()
        assert torch.allclose(new.grad, reference.grad, atol=1e-7), (shift, clip)


def test_gspo_clips_the_sequence_ratio_not_each_token():
    # token ratios 2 and 1/2: each far outside the clip range, but their geometric mean is 1, so nothing is clipped
    old, new = torch.zeros(1, 2), torch.tensor([[math.log(2.0), -math.log(2.0)]])
    loss, metrics = gspo_policy_loss(old, new, torch.ones(1, 2), torch.ones(1, 2), 3e-4, 4e-4, "seq-mean-token-mean")
    assert loss.item() == pytest.approx(-1.0) and metrics["clipfrac"].item() == 0.0
    # a sequence ratio of e^0.01 with a positive advantage is clipped at 1 + 4e-4
    loss, metrics = gspo_policy_loss(old, old + 0.01, torch.ones(1, 2), torch.ones(1, 2), 3e-4, 4e-4, "seq-mean-token-mean")
    assert loss.item() == pytest.approx(-(1 + 4e-4)) and metrics["clipfrac"].item() == 1.0


def test_gspo_defaults_are_the_papers():
    args = GSPOArgs()
    assert (args.clip_ratio_low, args.clip_ratio_high, args.loss_agg_mode, args.kl_loss_coef) == (
        3e-4,
        4e-4,
        "seq-mean-token-mean",
        0.0,
    )
