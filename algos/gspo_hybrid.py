# GSPO: Zheng et al. 2025, "Group Sequence Policy Optimization" (https://arxiv.org/abs/2507.18071); a fork of
# grpo_hybrid.py. GRPO's group-relative advantages, but the importance ratio and its clipping are the sequence's:
# the geometric mean of its tokens' ratios, clipped in a narrow range, the loss averaged per sequence; no KL term.
from dataclasses import dataclass
from functools import partial
from typing import Literal

import numpy as np
import torch
import tyro

from common.run import RunArgs


@dataclass
class Args(RunArgs):
    """The algorithm's flags; those every script shares (model, data, workers, batches, checkpoints) are in common/run.py"""

    norm_adv_by_std: bool = True
    """divide advantages by the group's std (False: Dr.GRPO)"""
    clip_ratio_low: float = 3e-4
    """clip range of the sequence's ratio below 1 (the paper's)"""
    clip_ratio_high: float = 4e-4
    """clip range of the sequence's ratio above 1 (the paper's)"""
    tis: bool = False
    """truncated importance sampling: weight each token's loss by pi_old / pi_rollout, for the rollout engine's numerics;
    always on with --max-staleness above 0, where it also corrects for the engine's older weights (see README)"""
    tis_cap: float = 2.0
    """upper bound of the TIS weight"""
    loss_agg_mode: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = (
        "seq-mean-token-mean"
    )
    """how per-token losses become one number (the paper's objective: a mean per sequence, then over sequences)"""
    kl_loss_coef: float = 0.0
    """weight of KL(policy || reference) in the loss; 0 skips the reference"""
    kl_loss_type: Literal["kl", "abs", "mse", "low_var_kl"] = "low_var_kl"
    """KL estimator: k1, |k1|, k2, k3"""
    entropy_coef: float = 0.0
    """entropy bonus"""
    single_sample_groups: bool = False
    """allow --n 1: each response is then its own group, and its advantage its raw score (no baseline)"""


def compute_grpo_advantages(scores: torch.Tensor, group_ids: np.ndarray, norm_by_std: bool = True, eps: float = 1e-6):
    """(score - group mean) / (group std + eps), groups being the samples of one prompt.

    The std uses Bessel's correction; a group of one has mean 0 and std 1.
    """
    advantages = torch.empty_like(scores)
    for group in np.unique(group_ids):
        members = torch.as_tensor(np.flatnonzero(group_ids == group))
        group_scores = scores[members]
        if len(members) == 1:
            mean, std = torch.tensor(0.0), torch.tensor(1.0)
        else:
            mean, std = group_scores.mean(), group_scores.std()
        advantages[members] = (group_scores - mean) / (std + eps) if norm_by_std else group_scores - mean
    return advantages


def kl_penalty(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) (Schulman, "Approximating KL divergence")."""
    log_ratio = log_prob - ref_log_prob
    if kind == "kl":  # k1
        return log_ratio
    if kind == "abs":
        return log_ratio.abs()
    if kind == "mse":  # k2
        return 0.5 * log_ratio.square()
    if kind == "low_var_kl":  # k3: unbiased and always positive
        ref_over_policy = (-log_ratio).clamp(-20, 20)
        return (ref_over_policy.exp() - ref_over_policy - 1).clamp(-10, 10)
    raise ValueError(f"unknown KL estimator '{kind}'")


def agg_loss(
    loss: torch.Tensor, mask: torch.Tensor, mode: str, num_tokens: float | None = None, num_seqs: float | None = None
):
    """Reduce a [batch, tokens] loss over the valid tokens: the loss contract of every update.

    The worker splits a mini-batch into micro-batches on every rank, and hands each loss function
    `num_tokens` and `num_seqs`, the valid tokens and the sequences of the whole mini-batch over every
    micro-batch and rank. Each mode divides by one of those counts (or by a constant), never by a
    micro-batch's own, so a micro-batch's result is its share of the mini-batch's value: the shares add up
    over micro-batches and ranks to exactly that value, and their gradients to its gradient, however the
    mini-batch is split. The worker then only sums, all-reduces and steps. Without the counts, a batch's
    own value.
    """
    num_tokens = mask.sum() if num_tokens is None else num_tokens
    num_seqs = mask.shape[0] if num_seqs is None else num_seqs
    token_sums = (loss * mask).sum(-1)
    if mode == "token-mean":
        return token_sums.sum() / num_tokens
    if mode == "seq-mean-token-sum":
        return token_sums.sum() / num_seqs
    if mode == "seq-mean-token-mean":
        return (token_sums / mask.sum(-1).clamp(min=1)).sum() / num_seqs
    if mode == "seq-mean-token-sum-norm":  # Dr.GRPO: a constant length normaliser
        return token_sums.sum() / (num_seqs * mask.shape[-1])
    raise ValueError(f"unknown loss aggregation '{mode}'")


def compute_tis_weights(old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, cap: float) -> torch.Tensor:
    """min(pi_old / pi_rollout, cap) per token: the rollout engine samples from slightly other probabilities than the
    trainer computes (Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training")."""
    return (old_log_prob - rollout_log_prob).clamp(max=20).exp().clamp(max=cap)


def compute_policy_loss(
    old_log_prob, log_prob, advantages, mask, clip_low, clip_high, agg_mode, num_tokens=None, num_seqs=None, tis_weights=None
):
    """GSPO-token's clipped surrogate (section 4.2): every token of a sequence carries the sequence's importance ratio,
    s = (pi / pi_old)^(1 / length), the geometric mean of its tokens' ratios, and its own token's gradient
    (s_t = sg[s] x pi_t / sg[pi_t]); the ratio is clipped to [1 - clip_low, 1 + clip_high]. Optionally TIS-weighted."""
    seq_log_ratio = ((log_prob - old_log_prob) * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    log_ratio = (log_prob - log_prob.detach() + seq_log_ratio.detach()[:, None]).clamp(max=10)
    ratio = log_ratio.exp()
    surrogate = -advantages * ratio
    surrogate_clipped = -advantages * ratio.clamp(1 - clip_low, 1 + clip_high)
    per_token = torch.maximum(surrogate, surrogate_clipped)
    if tis_weights is not None:
        per_token = per_token * tis_weights
    token_mean = partial(agg_loss, mask=mask, mode="token-mean", num_tokens=num_tokens)
    metrics = {
        "clipfrac": token_mean((surrogate_clipped > surrogate).float()).detach(),
        "approx_kl": token_mean(-(log_prob - old_log_prob)).detach(),
    }
    if tis_weights is not None:
        metrics["tis_weight"] = token_mean(tis_weights).detach()
    return agg_loss(per_token, mask, agg_mode, num_tokens, num_seqs), metrics


def actor_loss(batch, outputs, minibatch_tokens, minibatch_seqs, args: Args):
    """The policy's loss on one micro-batch, as its share of the mini-batch (see agg_loss)."""
    log_prob, entropy = outputs
    mask, counts = batch["response_mask"], (minibatch_tokens, minibatch_seqs)
    aggregate = partial(agg_loss, mask=mask, mode=args.loss_agg_mode, num_tokens=minibatch_tokens, num_seqs=minibatch_seqs)
    # Without an old-log-prob pass (one epoch, one mini-batch) the policy before this update is this one, unchanged so
    # far: its log-probs held constant are the old ones (the ratio is 1, and its gradient that of the ratio).
    old_log_prob = batch["old_log_probs"] if "old_log_probs" in batch else log_prob.detach()
    # Samples from older weights (--max-staleness) are off-policy: the decoupled objective (Hilton et al. 2022) clips
    # around the policy before this update and weights each token by it over the sampler's, truncated: TIS's weight.
    tis = args.tis or args.max_staleness > 0
    tis_weights = compute_tis_weights(old_log_prob, batch["rollout_log_probs"], args.tis_cap) if tis else None
    clip = (args.clip_ratio_low, args.clip_ratio_high)
    pg_loss, metrics = compute_policy_loss(
        old_log_prob, log_prob, batch["advantages"], mask, *clip, args.loss_agg_mode, *counts, tis_weights
    )
    if "old_log_probs" not in batch:  # what the skipped pass would have measured: entropy, the engine's gap
        token_mean = partial(agg_loss, mask=mask, mode="token-mean", num_tokens=minibatch_tokens)
        metrics["entropy"] = token_mean(entropy).detach()
        log_ratio = old_log_prob - batch["rollout_log_probs"]
        metrics["rollout_logprob_diff"] = token_mean(log_ratio.abs())
        # the trainer's probability over the engine's, untruncated: its mean and spread (see rollout_gap_of_update)
        importance_weight = log_ratio.clamp(max=20).exp()
        metrics["importance_weight"] = token_mean(importance_weight)
        metrics["importance_weight_sq_dev"] = token_mean((importance_weight - 1) ** 2)
    loss = pg_loss - args.entropy_coef * aggregate(entropy)
    metrics["pg_loss"] = pg_loss.detach()
    if args.kl_loss_coef > 0:
        kl = aggregate(kl_penalty(log_prob, batch["ref_log_probs"], args.kl_loss_type))
        loss = loss + args.kl_loss_coef * kl
        metrics["kl"] = kl.detach()
    return loss, metrics


if __name__ == "__main__":
    from common import demo
    from common.rollout import rollout_gap_of_update, rollout_logprob_gap
    from common.run import Run
    from common.tracking import timer

    args = tyro.cli(Args)
    if args.model_path is None or not args.train_files:
        # 16 samples per prompt: an answer the warm start gives a few percent shows up in most groups, so RL finds it before
        # what it learns on other problems pushes it out of reach
        demo_settings = dict(lr=6e-4, n=16, train_batch_size=32, mini_batch_size=8, total_steps=400, kl_loss_coef=0.2)
        args = demo.apply(Args, args, **demo_settings)
    if args.n < 2 and not args.single_sample_groups:
        raise ValueError(
            f"--n {args.n}: the advantage compares each response with the others sampled for its prompt, so a group "
            "of one gets its raw score. Sample --n 2 or more, or pass --single-sample-groups to train so anyway"
        )
    run = Run("gspo", args)
    policy = run.policy(use_reference=args.kl_loss_coef > 0)
    log_prob_inputs = ("input_ids", "attention_mask", "position_ids", "responses")
    # One epoch over one mini-batch trains the policy as it is before the update: the update's own log-probs are the old
    # ones. With --max-staleness too, where the old policy is the proximal one of the decoupled objective (see actor_loss).
    old_log_prob_pass = args.ppo_epochs > 1 or args.mini_batch_size < args.train_batch_size
    update_inputs = [*log_prob_inputs, "response_mask", "advantages", "rollout_log_probs"]
    if old_log_prob_pass:
        update_inputs.append("old_log_probs")
    if args.kl_loss_coef > 0:
        update_inputs.append("ref_log_probs")

    for step in run.steps():
        metrics = {}

        # 1. Rollout: n samples of every prompt; a prompt's samples share its uid (the group).
        # With --max-staleness the rollout workers generated it while the policy trained on the batches before.
        with timer("generate", metrics):
            batch = run.next_rollouts(args.n, metrics)

        # 2. Outcome reward: one score per response.
        with timer("reward", metrics):
            scores = run.score(batch, metrics)

        # 3. Log-probs of the sampled tokens under the policy that sampled them, and under the reference.
        if old_log_prob_pass:
            with timer("old_log_prob", metrics):
                batch |= policy.scatter("compute_log_prob", batch.select(*log_prob_inputs))
            # The engine's own log-probs against the trainer's: the gap TIS corrects, too large when the engine lags behind.
            metrics |= rollout_logprob_gap(batch, args.max_rollout_logprob_diff)
        if args.kl_loss_coef > 0:
            with timer("ref_log_prob", metrics):
                batch |= policy.scatter("compute_ref_log_prob", batch.select(*log_prob_inputs))

        # 4. GRPO's advantage: the response's score relative to its group, the same for each of its tokens.
        with timer("advantages", metrics):
            advantages = compute_grpo_advantages(scores, batch["uid"], args.norm_adv_by_std)
            batch["advantages"] = advantages[:, None] * batch["response_mask"]

        # 5. Policy update: the sequence-level clipped surrogate, over epochs x mini-batches x micro-batches.
        with timer("update", metrics):
            actor_metrics = policy.scatter("update", batch.select(*update_inputs), loss_fn=partial(actor_loss, args=args))
        metrics |= {f"actor/{key}": value for key, value in actor_metrics[0].items()}
        if not old_log_prob_pass:  # the engine's gap, measured by the update: it stops the run before the next step
            metrics |= rollout_gap_of_update(metrics, batch["staleness"], args.max_rollout_logprob_diff)
        run.end_step(step, batch, scores, metrics)

    run.finish()
