"""DAPO's techniques, each on its own, against values computed by hand."""

import numpy as np
import pytest
import torch

from dapo_hybrid import Args, compute_policy_loss, filter_groups, overlong_penalty


def test_filter_groups_keeps_only_groups_that_disagree():
    uids = np.array(["right", "right", "wrong", "wrong", "mixed", "mixed", "mixed", "alone"], dtype=object)
    values = torch.tensor([1.0, 1.0, 0.0, 0.0, 1.0, 0.0, 1.0, 1.0])
    assert filter_groups(values, uids).tolist() == [False, False, False, False, True, True, True, True]


def test_filter_groups_on_shaped_rewards():
    # the same raw score but different overlong penalties: the shaped rewards disagree
    uids = np.array(["a", "a", "b", "b"], dtype=object)
    assert filter_groups(torch.tensor([1.0, 0.5, 0.0, 0.0]), uids).tolist() == [True, True, False, False]


def test_overlong_penalty_by_hand():
    # M = 20, L = 4: no penalty up to 16 tokens, then -(l - 16) / 4 x factor, reaching -factor at 20
    lengths = torch.tensor([3.0, 16.0, 17.0, 18.0, 20.0])
    assert overlong_penalty(lengths, 20, 4, 1.0).tolist() == pytest.approx([0.0, 0.0, -0.25, -0.5, -1.0])
    assert overlong_penalty(lengths, 20, 4, 0.5).tolist() == pytest.approx([0.0, 0.0, -0.125, -0.25, -0.5])


def test_clip_higher_defaults():
    args = Args()
    assert (args.clip_ratio_low, args.clip_ratio_high, args.clip_ratio_c, args.kl_loss_coef) == (0.2, 0.28, 10.0, 0.0)
    old, mask = torch.zeros(1, 2), torch.ones(1, 2)
    new = torch.tensor([[np.log(1.4), np.log(0.7)]])
    # ratio 1.4, A=+1 clips at 1.28; ratio 0.7, A=+1 is not clipped below (the min picks the unclipped -0.7)
    loss, _ = compute_policy_loss(old, new, torch.ones(1, 2), mask, 0.2, 0.28, 10.0, "token-mean")
    assert loss.item() == pytest.approx((-1.28 - 0.7) / 2)
    # ratio 20 with A=-1: the dual clip caps the loss at c = 10
    loss, _ = compute_policy_loss(
        torch.zeros(1, 1), torch.tensor([[np.log(20.0)]]), -torch.ones(1, 1), torch.ones(1, 1), 0.2, 0.28, 10.0, "token-mean"
    )
    assert loss.item() == pytest.approx(10.0)


def test_token_mean_is_not_a_mean_of_sequence_means():
    # one long sequence (4 tokens of loss 1) and one short one (1 token of loss 0)
    old, mask = torch.zeros(2, 4), torch.tensor([[1.0, 1.0, 1.0, 1.0], [1.0, 0.0, 0.0, 0.0]])
    advantages = torch.tensor([[-1.0] * 4, [0.0] * 4])
    token_level, _ = compute_policy_loss(old, old, advantages, mask, 0.2, 0.28, 10.0, "token-mean")
    sequence_level, _ = compute_policy_loss(old, old, advantages, mask, 0.2, 0.28, 10.0, "seq-mean-token-mean")
    assert token_level.item() == pytest.approx(4 / 5)
    assert sequence_level.item() == pytest.approx(0.5)


def test_recipe_defaults():
    """The DAPO recipe's settings unless a user asks otherwise: groups filtered on the score, not on the shaped reward
    (else groups whose samples differ only in length survive and train length alone), 16 samples, 16 optimiser steps
    per batch, weight decay 0.1, 10 warm-up steps, and an explicit overlong buffer."""
    args = Args()
    assert (args.filter_metric, args.n, args.weight_decay, args.lr_warmup_steps) == ("score", 16, 0.1, 10)
    assert args.train_batch_size // args.mini_batch_size == 16
    assert 0 < args.overlong_buffer_length < args.max_response_length
