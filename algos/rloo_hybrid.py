# RLOO: Ahmadian et al. 2024, "Back to Basics" (https://arxiv.org/abs/2402.14740), section 3.2; a fork of grpo_hybrid.py.
# Each response's baseline is the mean reward of the other responses to its prompt (leave-one-out), the reward
# carries the sequence's KL to the reference, and nothing is divided by a std; no critic.
from dataclasses import dataclass
from functools import partial
from typing import Literal

import numpy as np
import torch
import tyro

from common.rollout_correction import loss_weights, needs_old_log_prob_pass, update_terms
from common.run import RunArgs


@dataclass
class Args(RunArgs):
    """The algorithm's flags; those every script shares (model, data, workers, batches, checkpoints) are in common/args.py"""

    clip_ratio_low: float = 0.2
    """PPO clip range below 1"""
    clip_ratio_high: float = 0.2
    """PPO clip range above 1"""
    clip_ratio_c: float = 3.0
    """dual-clip bound for negative advantages"""
    loss_agg_mode: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = "token-mean"
    """how per-token losses become one number"""
    kl_coef: float = 0.001
    """weight of the sequence's KL(policy || reference) subtracted from its reward; 0 skips the reference"""
    kl_type: Literal["kl", "abs", "mse", "low_var_kl"] = "kl"
    """KL estimator per token, summed over the sequence: k1 (the paper's), |k1|, k2, k3"""
    entropy_coef: float = 0.0
    """entropy bonus"""
    single_sample_groups: bool = False
    """allow --n 1: each response is then its own group, and its advantage its raw reward (no baseline)"""


def compute_rloo_advantages(rewards: torch.Tensor, group_ids: np.ndarray):
    """reward - the mean reward of the other samples of its prompt, which is k / (k - 1) x (reward - group mean) for
    a group of k; a group of one keeps its raw reward."""
    advantages = rewards.clone()  # [batch]
    for group in np.unique(group_ids):
        members = torch.as_tensor(np.flatnonzero(group_ids == group))
        k = len(members)
        if k > 1:
            advantages[members] = (rewards[members] - rewards[members].mean()) * k / (k - 1)
    return advantages


def kl_penalised_scores(scores: torch.Tensor, kl: torch.Tensor, response_mask: torch.Tensor, kl_coef: float):
    """The sequence's reward: its score minus kl_coef x its KL to the reference, summed over its tokens."""
    return scores - kl_coef * (kl * response_mask).sum(-1)  # [batch]


def kl_penalty(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token estimate of KL(policy || reference) (Schulman, "Approximating KL divergence")."""
    log_ratio = log_prob - ref_log_prob  # [batch, response_len]
    if kind == "kl":  # k1 = log(pi / pi_ref)
        return log_ratio
    if kind == "abs":  # |k1|
        return log_ratio.abs()
    if kind == "mse":  # k2 = log(pi / pi_ref)^2 / 2
        return 0.5 * log_ratio.square()
    if kind == "low_var_kl":  # k3 = pi_ref / pi - 1 - log(pi_ref / pi): unbiased and always positive
        ref_over_policy = (-log_ratio).clamp(-20, 20)
        return (ref_over_policy.exp() - ref_over_policy - 1).clamp(-10, 10)
    raise ValueError(f"unknown KL estimator '{kind}'")


def agg_loss(
    loss: torch.Tensor, mask: torch.Tensor, mode: str, num_tokens: float | None = None, num_seqs: float | None = None
):
    """Reduce a [batch, tokens] loss over the valid tokens: the loss contract of every update.

    The worker splits a mini-batch into micro-batches on every rank, and hands each loss function
    `num_tokens` and `num_seqs`, the valid tokens and the sequences that have any of the whole mini-batch over
    every micro-batch and rank. Each mode divides by one of those counts (or by a constant), never by a
    micro-batch's own, so a micro-batch's result is its share of the mini-batch's value: the shares add up
    over micro-batches and ranks to exactly that value, and their gradients to its gradient, however the
    mini-batch is split. The worker then only sums, all-reduces and steps. Without the counts, a batch's
    own value.
    """
    num_tokens = mask.sum() if num_tokens is None else num_tokens
    num_seqs = mask.any(-1).sum() if num_seqs is None else num_seqs
    num_tokens, num_seqs = max(num_tokens, 1), max(num_seqs, 1)  # a batch rejected whole (--rollout-rs) adds nothing
    token_sums = (loss * mask).sum(-1)  # [batch]
    if mode == "token-mean":
        return token_sums.sum() / num_tokens
    if mode == "seq-mean-token-sum":
        return token_sums.sum() / num_seqs
    if mode == "seq-mean-token-mean":
        return (token_sums / mask.sum(-1).clamp(min=1)).sum() / num_seqs
    if mode == "seq-mean-token-sum-norm":  # Dr.GRPO: a constant length normaliser
        return token_sums.sum() / (num_seqs * mask.shape[-1])
    raise ValueError(f"unknown loss aggregation '{mode}'")


def compute_policy_loss(
    old_log_prob,
    log_prob,
    advantages,
    mask,
    clip_low,
    clip_high,
    clip_c,
    agg_mode,
    num_tokens=None,
    num_seqs=None,
    is_weights=None,
):
    """PPO's clipped surrogate with dual-clip (Ye et al. 2020) for negative advantages, optionally weighted per token
    (--rollout-is: common/rollout_correction.py's loss_weights)."""
    log_ratio = (log_prob - old_log_prob).clamp(-20, 20)  # [batch, response_len]: log r, r = pi / pi_old
    ratio = log_ratio.exp()
    surrogate = -advantages * ratio
    surrogate_clipped = -advantages * ratio.clamp(1 - clip_low, 1 + clip_high)
    clipped_loss = torch.maximum(surrogate, surrogate_clipped)  # max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high))
    dual_clipped_loss = torch.minimum(clipped_loss, -advantages * clip_c)  # min(that, -A c), taken where A < 0
    per_token = torch.where(advantages < 0, dual_clipped_loss, clipped_loss)
    if is_weights is not None:
        per_token = per_token * is_weights
    token_mean = partial(agg_loss, mask=mask, mode="token-mean", num_tokens=num_tokens)
    metrics = {
        "clipfrac": token_mean((surrogate_clipped > surrogate).float()).detach(),
        "clipfrac_dual": token_mean(((clipped_loss > -advantages * clip_c) & (advantages < 0)).float()).detach(),
        "approx_kl": token_mean(-log_ratio).detach(),
    }
    return agg_loss(per_token, mask, agg_mode, num_tokens, num_seqs), metrics


def actor_loss(batch, outputs, minibatch_tokens, minibatch_seqs, args: Args):
    """The policy's loss on one micro-batch, as its share of the mini-batch (see agg_loss)."""
    log_prob, entropy = outputs
    mask, counts = batch["response_mask"], (minibatch_tokens, minibatch_seqs)
    aggregate = partial(agg_loss, mask=mask, mode=args.loss_agg_mode, num_tokens=minibatch_tokens, num_seqs=minibatch_seqs)
    # Without an old-log-prob pass the policy before this update is this one: its log-probs held constant are pi_old.
    old_log_prob = batch["old_log_probs"] if "old_log_probs" in batch else log_prob.detach()
    is_weights = loss_weights(batch, old_log_prob, args)  # --rollout-is: pi_old / pi_rollout for the engine's samples
    clip = dict(clip_low=args.clip_ratio_low, clip_high=args.clip_ratio_high, clip_c=args.clip_ratio_c)
    aggregation = dict(agg_mode=args.loss_agg_mode, num_tokens=minibatch_tokens, num_seqs=minibatch_seqs)
    pg_loss, metrics = compute_policy_loss(
        old_log_prob, log_prob, batch["advantages"], mask, **clip, **aggregation, is_weights=is_weights
    )
    metrics |= update_terms(batch, old_log_prob, entropy, *counts, args)  # what a skipped old-log-prob pass measures
    loss = pg_loss - args.entropy_coef * aggregate(entropy)
    metrics["pg_loss"] = pg_loss.detach()
    return loss, metrics


if __name__ == "__main__":
    from common import demo
    from common.rollout_correction import rejection_mask, rollout_diagnostics, update_figures
    from common.run import Run
    from common.tracking import timer
    from common.workers import LOG_PROB_INPUTS

    args = tyro.cli(Args)
    if args.model_path is None or not args.train_files:
        # 16 samples per prompt: an answer the warm start gives a few percent shows up in most groups, so RL finds it before
        # what it learns on other problems pushes it out of reach
        demo_settings = dict(lr=6e-4, n=16, train_batch_size=32, mini_batch_size=8, total_steps=400, kl_coef=0.2)
        args = demo.apply(Args, args, **demo_settings)
    if args.n < 2 and not args.single_sample_groups:
        raise ValueError(
            f"--n {args.n}: the advantage compares each response with the others sampled for its prompt, so a group "
            "of one gets its raw score. Sample --n 2 or more, or pass --single-sample-groups to train so anyway"
        )
    run = Run(args)
    policy = run.policy(use_reference=args.kl_coef > 0)
    old_log_prob_pass = needs_old_log_prob_pass(args, reward_reads_it=args.kl_coef > 0)
    update_inputs = [*LOG_PROB_INPUTS, "response_mask", "advantages", "rollout_log_probs"]
    if old_log_prob_pass:
        update_inputs.append("old_log_probs")

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
                batch |= policy.scatter("compute_log_prob", batch.select(*LOG_PROB_INPUTS))
        if args.kl_coef > 0:
            with timer("ref_log_prob", metrics):
                batch |= policy.scatter("compute_ref_log_prob", batch.select(*LOG_PROB_INPUTS))

        # 4. RLOO's advantage: the response's KL-penalised reward against the mean of the others', the same for each
        # of its tokens.
        with timer("advantages", metrics):
            response_mask, kl = batch["response_mask"], torch.zeros_like(batch["response_mask"])
            if args.kl_coef > 0:
                kl = kl_penalty(batch["old_log_probs"], batch["ref_log_probs"], args.kl_type)
            advantages = compute_rloo_advantages(kl_penalised_scores(scores, kl, response_mask, args.kl_coef), batch["uid"])
            batch["advantages"] = advantages[:, None] * response_mask  # [batch, response_len]
            metrics["actor/kl"] = ((kl * response_mask).sum() / response_mask.sum()).item()

        # 5. Policy update: clipped surrogate, over epochs x mini-batches x micro-batches.
        update_mask = rejection_mask(batch, args)  # --rollout-rs: rejected tokens and sequences leave the update
        with timer("update", metrics):
            update_batch = batch.select(*update_inputs)
            update_batch["response_mask"] = update_mask
            update = policy.update(update_batch, partial(actor_loss, args=args))
        # The engine's gap (too large: the run stops) and the off-policy diagnostics, measured by the pass or the update
        metrics |= rollout_diagnostics(batch, update_mask, update, args) | update_figures(update, "actor/")
        run.end_step(step, batch, scores, metrics)

    run.finish()
