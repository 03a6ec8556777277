"""GSPO's math against the paper's sequence-level objective and its clipping of the sequence ratio."""

import math

import pytest
import torch

from gspo_hybrid import Args as GSPOArgs
from gspo_hybrid import compute_policy_loss as gspo_policy_loss


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
