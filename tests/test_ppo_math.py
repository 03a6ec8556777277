"""PPO's math against values computed by hand."""

import statistics

import pytest
import torch

from common.dataproto import DataProto
from common.episodes import split_turn_rewards
from ppo_hybrid import compute_gae, compute_value_loss, kl_penalised_rewards, masked_whiten, update_kl_coef


def test_gae_with_a_short_response_and_discounting():
    gamma, lam = 0.9, 0.8
    rewards = torch.tensor([[0.0, 0.0, 1.0, 5.0], [0.0, 0.0, 0.0, 2.0]])
    values = torch.tensor([[0.5, 0.6, 0.7, 9.9], [1.0, 1.0, 1.0, 1.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
    # row 0 ends after 3 tokens: the padded value 9.9 and reward 5 count for nothing.
    # t=2: 1 - 0.7 = 0.3; t=1: 0.9*0.7 - 0.6 + 0.72*0.3 = 0.246; t=0: 0.9*0.6 - 0.5 + 0.72*0.246 = 0.21712
    # row 1: t=3: 2 - 1 = 1; t=2: -0.1 + 0.72 = 0.62; t=1: -0.1 + 0.72*0.62 = 0.3464; t=0: -0.1 + 0.72*0.3464
    raw = [0.21712, 0.246, 0.3, -0.1 + 0.72 * 0.3464, 0.3464, 0.62, 1.0]
    mean, std = statistics.mean(raw), statistics.stdev(raw)
    advantages, returns = compute_gae(rewards, values, mask, gamma, lam)
    expected = [(a - mean) / std for a in raw]
    assert advantages[mask.bool()].tolist() == pytest.approx(expected, rel=1e-5)
    assert advantages[0, 3].item() == 0.0
    assert returns[0].tolist() == pytest.approx([0.71712, 0.846, 1.0, 0.0])
    assert returns[1].tolist() == pytest.approx([1 + raw[3], 1.3464, 1.62, 2.0])


def test_gae_gamma_lam_one_is_reward_to_go_minus_value():
    rewards = torch.tensor([[0.0, 0.0, 1.0]])
    values = torch.tensor([[0.2, 0.4, 0.6]])
    mask = torch.ones(1, 3)
    _, returns = compute_gae(rewards, values, mask, 1.0, 1.0)
    assert returns[0].tolist() == pytest.approx([1.0, 1.0, 1.0])


def test_masked_whiten():
    x = torch.tensor([[1.0, 2.0, 100.0], [3.0, 4.0, 5.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    valid = [1.0, 2.0, 3.0, 4.0, 5.0]
    white = masked_whiten(x, mask)
    assert white[mask.bool()].tolist() == pytest.approx([(v - 3) / statistics.stdev(valid) for v in valid], rel=1e-6)


def test_value_loss_and_clipping():
    mask = torch.ones(1, 2)
    loss, metrics = compute_value_loss(
        torch.tensor([[1.0, 2.0]]), torch.tensor([[0.0, 2.0]]), torch.tensor([[0.0, 3.0]]), mask, 0.5, "token-mean"
    )
    # token 0: unclipped (1-0)^2 = 1, clipped (0.5-0)^2 = 0.25 -> 1; token 1: both 1 -> 1
    assert loss.item() == pytest.approx(0.5)
    assert metrics["vf_clipfrac"].item() == 0.0
    # the clipped value 0.5 is further from the return 1 than the new value 1: the clipped error counts
    loss, metrics = compute_value_loss(
        torch.tensor([[1.0]]), torch.tensor([[0.0]]), torch.tensor([[1.0]]), torch.ones(1, 1), 0.5, "token-mean"
    )
    assert loss.item() == pytest.approx(0.5 * 0.25)
    assert metrics["vf_clipfrac"].item() == 1.0
    # masked tokens do not count
    loss, _ = compute_value_loss(
        torch.tensor([[1.0, 7.0]]),
        torch.tensor([[1.0, 0.0]]),
        torch.tensor([[2.0, 0.0]]),
        torch.tensor([[1.0, 0.0]]),
        0.5,
        "token-mean",
    )
    assert loss.item() == pytest.approx(0.5)


def test_adaptive_kl_controller():
    assert update_kl_coef(0.1, 0.2, 0.1, 64, 10000) == pytest.approx(0.1 * (1 + 0.2 * 64 / 10000))
    assert update_kl_coef(0.1, 0.09, 0.1, 64, 10000) == pytest.approx(0.1 * (1 - 0.1 * 64 / 10000))
    assert update_kl_coef(0.1, 0.0, 0.1, 100, 100) == pytest.approx(0.1 * 0.8)


def test_kl_penalised_rewards():
    scores = torch.tensor([1.0, 0.0])
    kl = torch.tensor([[0.1, 0.2, 0.3], [0.5, 0.5, 0.5]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 1.0]])
    rewards = kl_penalised_rewards(scores, kl, mask, 0.1)
    torch.testing.assert_close(rewards, torch.tensor([[-0.01, 0.98, 0.0], [-0.05, -0.05, -0.05]]))


def test_gae_skips_the_environments_tokens_of_a_multi_turn_episode():
    # model, model, env, env, model, padding: the model's tokens alone, laid end to end, give the same estimates
    rewards, values = torch.tensor([[0.1, 0.0, 7.0, 7.0, 1.0, 5.0]]), torch.tensor([[0.5, 0.6, 9.0, 9.0, 0.7, 9.9]])
    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0, 1.0, 0.0]])
    own = mask[0].bool()
    episode_estimates = compute_gae(rewards.repeat(2, 1), values.repeat(2, 1), mask.repeat(2, 1), 0.9, 0.8)
    model_only_estimates = compute_gae(rewards[:, own].repeat(2, 1), values[:, own].repeat(2, 1), torch.ones(2, 3), 0.9, 0.8)
    for episode, model_only in zip(episode_estimates, model_only_estimates):  # advantages, then returns
        torch.testing.assert_close(episode[:, own], model_only)
        assert episode[:, ~own].abs().sum().item() == 0.0


def test_the_score_goes_to_the_models_last_token_after_the_environments():
    mask = torch.tensor([[1.0, 1.0, 0.0, 1.0, 0.0, 0.0]])
    rewards = kl_penalised_rewards(torch.tensor([2.0]), torch.zeros(1, 6), mask, 0.1)
    assert rewards.tolist() == [[0.0, 0.0, 0.0, 2.0, 0.0, 0.0]]


def test_each_turns_reward_lands_on_that_turns_last_token_in_gae():
    # model, model, env, env, model, model, padding: the first turn rewarded 0.5 by the environment, the outcome 2.0
    mask = torch.tensor([[1.0, 1.0, 0.0, 0.0, 1.0, 1.0, 0.0]])
    turns = torch.tensor([[0.0, 0.5, 0.0, 0.0, 0.0, 0.0, 0.0]])
    batch = DataProto.from_dict({"response_mask": mask, "turn_reward_tokens": turns, "outcome_score": torch.tensor([2.0])})
    outcome, turn_rewards = split_turn_rewards(torch.tensor([2.5]), batch)  # the scorer's sum: 2.5
    rewards = kl_penalised_rewards(outcome, torch.zeros(1, 7), mask, 0.1) + turn_rewards
    assert rewards.tolist() == [[0.0, 0.5, 0.0, 0.0, 0.0, 2.0, 0.0]]
    _, returns = compute_gae(rewards, torch.zeros(1, 7), mask, 0.5, 1.0)
    # values 0: the reward-to-go over the model's tokens alone, discounted by 0.5 a token: 0.5 * (0.5 + 0.5 * 0.5 * 2), ...
    assert returns.tolist() == [[0.5, 1.0, 0.0, 0.0, 1.0, 2.0, 0.0]]
    single = DataProto.from_dict({"response_mask": mask})  # a single turn's batch: the score alone, at the end
    assert torch.equal(split_turn_rewards(torch.tensor([2.5]), single)[0], torch.tensor([2.5]))
