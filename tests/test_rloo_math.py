"""RLOO's math against values computed by hand and against verl's form of the estimator."""

import numpy as np
import pytest
import torch

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
