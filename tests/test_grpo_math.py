"""GRPO's math against values computed by hand."""

import math

import numpy as np
import pytest
import torch

from grpo_hybrid import agg_loss, compute_grpo_advantages, compute_policy_loss, kl_penalty
from helpers import RL_SCRIPTS

from common import rollout_correction
from common.rollout_correction import rollout_gap_of_update, rollout_logprob_gap


def test_grpo_advantages_normalised_per_group():
    scores = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 5.0])
    uids = np.array(["a", "a", "a", "b", "b", "c"], dtype=object)
    # group a: mean 1/3, Bessel std sqrt(((2/3)^2 + 2 (1/3)^2) / 2) = sqrt(1/3)
    std_a = math.sqrt(1 / 3)
    expected = [(2 / 3) / (std_a + 1e-6), (-1 / 3) / (std_a + 1e-6), (-1 / 3) / (std_a + 1e-6), 0.0, 0.0, 5 / (1 + 1e-6)]
    assert compute_grpo_advantages(scores, uids).tolist() == pytest.approx(expected, rel=1e-5)


def test_grpo_advantages_without_std_division_dr_grpo():
    scores = torch.tensor([1.0, 0.0, 0.0, 2.0, 4.0])
    uids = np.array(["a", "a", "a", "b", "b"], dtype=object)
    assert compute_grpo_advantages(scores, uids, norm_by_std=False).tolist() == pytest.approx(
        [2 / 3, -1 / 3, -1 / 3, -1.0, 1.0]
    )


def test_grpo_advantages_groups_need_not_be_contiguous():
    scores = torch.tensor([1.0, 3.0, 0.0, 2.0])
    uids = np.array(["a", "b", "a", "b"], dtype=object)
    adv = compute_grpo_advantages(scores, uids, norm_by_std=False)
    assert adv.tolist() == pytest.approx([0.5, 0.5, -0.5, -0.5])


def test_kl_estimators():
    log_prob, ref = torch.tensor([-1.0]), torch.tensor([-2.0])  # log ratio 1
    assert kl_penalty(log_prob, ref, "kl").item() == pytest.approx(1.0)
    assert kl_penalty(ref, log_prob, "abs").item() == pytest.approx(1.0)
    assert kl_penalty(log_prob, ref, "mse").item() == pytest.approx(0.5)
    # k3 = exp(ref - lp) - (ref - lp) - 1 = e^-1 + 1 - 1
    assert kl_penalty(log_prob, ref, "low_var_kl").item() == pytest.approx(math.exp(-1))
    # a log ratio of 50 is clamped to 20, then the result to 10
    assert kl_penalty(torch.tensor([0.0]), torch.tensor([-50.0]), "low_var_kl").item() == pytest.approx(10.0)
    assert kl_penalty(torch.tensor([0.0]), torch.tensor([0.0]), "low_var_kl").item() == pytest.approx(0.0)
    with pytest.raises(ValueError, match="unknown KL"):
        kl_penalty(log_prob, ref, "k9")


LOSS = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
MASK = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])


@pytest.mark.parametrize(
    "mode, expected",
    [
        ("token-mean", 7 / 3),
        ("seq-mean-token-sum", (3 + 4) / 2),
        ("seq-mean-token-mean", (1.5 + 4) / 2),
        ("seq-mean-token-sum-norm", 7 / (2 * 3)),
    ],
)
def test_agg_loss_modes(mode, expected):
    assert agg_loss(LOSS, MASK, mode).item() == pytest.approx(expected)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
def test_agg_loss_shares_add_up_to_the_whole(mode):
    loss, mask = torch.rand(6, 5), (torch.rand(6, 5) > 0.3).float()
    mask[:, 0] = 1
    whole = agg_loss(loss, mask, mode)
    shares = sum(agg_loss(loss[i : i + 2], mask[i : i + 2], mode, num_tokens=mask.sum(), num_seqs=6) for i in (0, 2, 4))
    assert shares.item() == pytest.approx(whole.item(), rel=1e-6)


def test_policy_loss_clip_and_dual_clip():
    # one token per case: (ratio, advantage)
    ratio = torch.tensor([[1.5, 0.5, 5.0, 0.5]])
    advantages = torch.tensor([[1.0, 1.0, -1.0, -1.0]])
    old, new, mask = torch.zeros(1, 4), ratio.log(), torch.ones(1, 4)
    loss, metrics = compute_policy_loss(old, new, advantages, mask, 0.2, 0.2, 3.0, "token-mean")
    # 1.5,+1 -> max(-1.5, -1.2) = -1.2 (clipped); 0.5,+1 -> max(-0.5, -0.8) = -0.5;
    # 5,-1 -> max(5, 1.2) = 5, dual-clipped to 3; 0.5,-1 -> max(0.5, 0.8) = 0.8 (clipped)
    assert loss.item() == pytest.approx((-1.2 - 0.5 + 3.0 + 0.8) / 4)
    assert metrics["clipfrac"].item() == pytest.approx(0.5)
    assert metrics["clipfrac_dual"].item() == pytest.approx(0.25)
    assert metrics["approx_kl"].item() == pytest.approx(-(math.log(1.5) + 2 * math.log(0.5) + math.log(5)) / 4)


def test_policy_loss_clip_higher_and_ratio_clamp():
    old, mask = torch.zeros(1, 1), torch.ones(1, 1)
    loss, _ = compute_policy_loss(old, torch.tensor([[math.log(1.5)]]), torch.ones(1, 1), mask, 0.2, 0.28, 3.0, "token-mean")
    assert loss.item() == pytest.approx(-1.28)
    # a log-ratio of 30 is clamped to 20 before exp; with advantage -1 the dual clip caps it at 3
    loss, metrics = compute_policy_loss(old, torch.tensor([[30.0]]), -torch.ones(1, 1), mask, 0.2, 0.2, 3.0, "token-mean")
    assert loss.item() == pytest.approx(3.0)
    assert metrics["approx_kl"].item() == pytest.approx(-20.0)


def test_policy_loss_ignores_masked_tokens():
    old = torch.zeros(1, 3)
    new = torch.tensor([[0.1, 5.0, -5.0]])
    mask = torch.tensor([[1.0, 0.0, 0.0]])
    loss, _ = compute_policy_loss(old, new, torch.ones(1, 3), mask, 0.2, 0.2, 3.0, "token-mean")
    assert loss.item() == pytest.approx(-min(math.exp(0.1), 1.2))


def test_policy_loss_with_tis_weights_each_token():
    ratio = torch.tensor([[1.5, 0.5, 1.0]])
    advantages = torch.tensor([[1.0, 1.0, -2.0]])
    old, mask = torch.zeros(1, 3), torch.ones(1, 3)
    weights = torch.tensor([[2.0, 0.5, 0.25]])
    loss, _ = compute_policy_loss(old, ratio.log(), advantages, mask, 0.2, 0.2, 3.0, "token-mean", is_weights=weights)
    # per token, unweighted: -1.2 (clipped), -0.5, 2.0
    assert loss.item() == pytest.approx((2.0 * -1.2 + 0.5 * -0.5 + 0.25 * 2.0) / 3)




@pytest.mark.parametrize("script", RL_SCRIPTS)
def test_actor_loss_without_old_log_probs_equals_the_loss_with_them(script):
    """One optimiser step per batch skips the old-log-prob pass: the update's own log-probs, held constant, give the
    loss, the gradient and the metrics that the pass's (equal) log-probs would."""
    import importlib

    from common.dataproto import DataProto

    module = importlib.import_module(script)
    args = module.Args(tis=True, **({"kl_loss_coef": 0.1} if hasattr(module.Args, "kl_loss_coef") else {}))
    generator = torch.Generator().manual_seed(0)
    log_prob_init = -torch.rand(4, 5, generator=generator) * 3
    mask = torch.tensor([[1.0] * 5, [1.0] * 3 + [0.0] * 2, [1.0] * 4 + [0.0], [1.0] * 5])
    batch = {
        "response_mask": mask,
        "advantages": torch.randn(4, 1, generator=generator) * mask,
        "rollout_log_probs": log_prob_init + 0.01 * torch.randn(4, 5, generator=generator),
        "ref_log_probs": log_prob_init - 0.3,
    }
    entropy = torch.rand(4, 5, generator=generator)
    results = []
    for with_pass in (True, False):
        log_prob = log_prob_init.clone().requires_grad_(True)
        tensors = batch | ({"old_log_probs": log_prob_init.clone()} if with_pass else {})
        loss, metrics = module.actor_loss(DataProto.from_dict(tensors), (log_prob, entropy), mask.sum(), 4, args)
        loss.backward()
        results.append((loss.item(), log_prob.grad.clone(), metrics))
    (loss_pass, grad_pass, metrics_pass), (loss_skip, grad_skip, metrics_skip) = results
    assert loss_skip == pytest.approx(loss_pass, rel=1e-6)
    assert torch.allclose(grad_skip, grad_pass, atol=1e-7)
    assert grad_pass.abs().sum() > 0
    for key, value in metrics_pass.items():
        assert float(metrics_skip[key]) == pytest.approx(float(value), abs=1e-7), key
    gap = ((log_prob_init - batch["rollout_log_probs"]).abs() * mask).sum() / mask.sum()
    assert float(metrics_skip[rollout_correction.ROLLOUT_LOGPROB_DIFF]) == pytest.approx(gap.item(), rel=1e-5)
    assert float(metrics_skip["entropy"]) == pytest.approx(((entropy * mask).sum() / mask.sum()).item(), rel=1e-5)
    # the driver's figures of the engine's gap, as the pass's batch gives them
    stale = torch.ones(4, dtype=torch.long)
    update = {key: float(value) for key, value in metrics_skip.items()}
    figures = rollout_gap_of_update(update, stale, bound=0.1)
    passed = DataProto.from_dict(batch | {"old_log_probs": log_prob_init, "staleness": stale})
    expected = rollout_logprob_gap(passed, bound=0.1)
    assert figures == pytest.approx(expected, rel=1e-4)
    assert figures["rollout/logprob_diff_mean"] > 0


def test_the_updates_gap_is_checked_only_on_batches_from_the_trainers_weights():
    """Samples from older weights differ from the trainer's by the updates since: the probe checks their engines."""
    names = rollout_correction
    update = {names.ROLLOUT_LOGPROB_DIFF: 0.5, names.ROLLOUT_LOGPROB_DIFF_MAX: 0.9}
    figures = rollout_gap_of_update(dict(update), torch.tensor([1, 0]), bound=0.1)
    assert figures == pytest.approx({"rollout/logprob_diff_mean": 0.5, "rollout/logprob_diff_max": 0.9})
    with pytest.raises(RuntimeError, match="does not hold the policy's weights"):
        rollout_gap_of_update(dict(update), torch.tensor([0, 0]), bound=0.1)
