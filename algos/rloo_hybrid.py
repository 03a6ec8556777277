# RLOO: Ahmadian et al. 2024, "Back to Basics: Revisiting REINFORCE Style Optimization for Learning from Human
# Feedback in LLMs" (https://arxiv.org/abs/2402.14740), section 3.2; a fork of grpo_hybrid.py.
# Each response's baseline is the mean reward of the other responses to its prompt (leave-one-out), the reward
# carries the sequence's KL to the reference, and nothing is divided by a std; no critic.
# Off-policy correction (docs/off-policy-correction.md): --rollout-is and --rollout-rs correct pi_old, the policy before
# the update (the proximal policy of --max-staleness's decoupled objective), against pi_rollout, the engine's
# probabilities of its samples (other numerics, older weights); the weight multiplies each token's clipped term.
# The ratio the loss clips is pi / pi_old per token.
import math
from dataclasses import dataclass
from functools import partial
from typing import Annotated, Literal

import numpy as np
import torch
import tyro

from common.run import RunArgs
from common.update_metrics import ROLLOUT_CORR, rollout_gap_terms


@dataclass
class Args(RunArgs):
    """The algorithm's flags; those every script shares (model, data, workers, batches, checkpoints) are in common/args.py"""

    clip_ratio_low: float = 0.2
    """PPO clip range below 1"""
    clip_ratio_high: float = 0.2
    """PPO clip range above 1"""
    clip_ratio_c: float = 3.0
    """dual-clip bound for negative advantages"""
    rollout_is: Literal["none", "token", "sequence"] | None = None
    """importance weights pi_old / pi_rollout for the engine's samples (its numerics, its older weights): per token, or
    their product over the response on each of its tokens; unset: token with --tis or --max-staleness above 0, else
    none (docs/off-policy-correction.md)"""
    rollout_is_threshold: Annotated[float, tyro.conf.arg(aliases=("--tis-cap",))] = 2.0
    """upper bound of the importance weight (--tis-cap: its short name)"""
    tis: bool = False
    """short for --rollout-is token (truncated importance sampling)"""
    rollout_rs: str = ""
    """rejection by divergence, comma-separated criteria: token_k1, token_k2, token_k3, seq_{sum,mean,max}_{k1,k2,k3}, or
    the presets icepop and geo_mask; a rejected token or sequence leaves the loss"""
    rollout_rs_threshold: str = ""
    """one threshold per --rollout-rs criterion, comma-separated; a k1 criterion bounds the ratio as lower_upper (e.g.
    0.5_2.0), a k2 or k3 one its value; empty: the presets' own"""
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
    advantages = rewards.clone()
    for group in np.unique(group_ids):
        members = torch.as_tensor(np.flatnonzero(group_ids == group))
        k = len(members)
        if k > 1:
            advantages[members] = (rewards[members] - rewards[members].mean()) * k / (k - 1)
    return advantages


def kl_penalised_scores(scores: torch.Tensor, kl: torch.Tensor, response_mask: torch.Tensor, kl_coef: float):
    """The sequence's reward: its score minus kl_coef x its KL to the reference, summed over its tokens."""
    return scores - kl_coef * (kl * response_mask).sum(-1)


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


def rollout_log_ratio(old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor) -> torch.Tensor:
    """log r_t = log pi_old(y_t) - log pi_rollout(y_t) of each sampled token, the trainer's over the engine's, bounded at
    +-20 so that r_t, its products and its squares stay finite; without gradient."""
    return (old_log_prob - rollout_log_prob).clamp(-20, 20).detach()


def rollout_is_weights(log_ratio: torch.Tensor, mask: torch.Tensor, level: str, threshold: float) -> torch.Tensor:
    """Importance weights for the engine's samples, without gradient: token, min(r_t, C) per token (truncated
    importance sampling, Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training");
    sequence, min(prod_t r_t, C) over the response's tokens in `mask`, the same on each of them (Liu et al. 2025,
    "When Speed Kills Stability")."""
    if level == "sequence":
        log_ratio = (log_ratio * mask).sum(-1, keepdim=True).clamp(-20, 20).expand_as(log_ratio)
    return log_ratio.exp().clamp(max=threshold).detach()


def rollout_rejection(log_ratio: torch.Tensor, mask: torch.Tensor, criteria: list[tuple[str, float, float]]):
    """`mask` without the tokens and the sequences that a criterion of --rollout-rs rejects (check_rollout_correction
    gives them as (name, lower, upper)). Per token, the trainer's divergence from the engine by Schulman's estimators
    ("Approximating KL divergence"): k1 = log r_t, whose bounds are the ratio's (IcePop: Ling Team 2025, "Every Step
    Evolves"), k2 = (log r_t)^2 / 2 and k3 = r_t - 1 - log r_t, below their threshold. A sequence criterion judges the
    sum of its tokens' values, their mean (seq_mean_k1: the ratio's geometric mean) or their max (any token out of
    bounds). Each criterion judges the sampled tokens; their rejections add up."""
    kept, valid = mask.clone(), mask.bool()
    for name, lower, upper in criteria:
        _, *aggregate, estimator = name.split("_")
        values = {"k1": log_ratio, "k2": 0.5 * log_ratio.square(), "k3": log_ratio.exp() - 1 - log_ratio}[estimator]
        low, high = (math.log(lower), math.log(upper)) if estimator == "k1" else (lower, upper)
        if aggregate == ["sum"]:
            values = (values * mask).sum(-1, keepdim=True)
        elif aggregate == ["mean"]:
            values = (values * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)
        rejected = (values < low) | (values > high)
        if aggregate == ["max"]:
            rejected = (rejected & valid).any(-1, keepdim=True)
        kept = kept * ~rejected
    return kept


def rollout_corr_terms(old_log_prob, rollout_log_prob, mask, kept, level, threshold, num_tokens=None, num_seqs=None):
    """The off-policy diagnostics' terms over every sampled token in `mask` (rejected or not; `kept` is what the
    rejection left), as the shares of a batch of `num_tokens` tokens and `num_seqs` sequences (see agg_loss) that add up
    over micro-batches and ranks, and the extremes (*_max, *_min) that the worker keeps. The weights are --rollout-is's
    before truncation's bound is lifted, r_t where it is none. KL(pi_rollout || pi_old) by k1 and k3; each sequence's
    perplexity exp(-mean log-prob) under either policy and their log difference; chi-squared, the mean of (r - 1)^2,
    per token and per sequence (r: the product over the response); the largest r_t; rollout_corr_metrics finishes them."""
    log_ratio = rollout_log_ratio(old_log_prob, rollout_log_prob)
    ratio, valid, has_tokens = log_ratio.exp(), mask.bool(), mask.bool().any(-1)
    weights = rollout_is_weights(log_ratio, kept, level, threshold) if level != "none" else ratio
    token_mean = partial(agg_loss, mask=mask, mode="token-mean", num_tokens=num_tokens)
    num_seqs = has_tokens.sum() if num_seqs is None else num_seqs
    lengths = mask.sum(-1).clamp(min=1)
    seq_log_ratio = (log_ratio * mask).sum(-1)
    terms = {
        "weight_mean": token_mean(weights),
        "weight_sq_mean": token_mean(weights.square()),
        "weight_max": torch.where(valid, weights, 0).max(),
        "weight_min": torch.where(valid, weights, math.inf).min(),
        "rejected_token_share": token_mean(1 - kept),
        "rejected_seq_share": (has_tokens & ~kept.bool().any(-1)).sum() / num_seqs,
        "kl_k1": token_mean(-log_ratio),
        "kl_k3": token_mean(ratio - 1 - log_ratio),
        "ppl_trainer": (-(old_log_prob * mask).sum(-1) / lengths).exp()[has_tokens].sum() / num_seqs,
        "ppl_rollout": (-(rollout_log_prob * mask).sum(-1) / lengths).exp()[has_tokens].sum() / num_seqs,
        "log_ppl_diff": (-seq_log_ratio / lengths).sum() / num_seqs,
        "chi2_token": token_mean((ratio - 1).square()),
        "chi2_seq": ((seq_log_ratio.clamp(-20, 20).exp() - 1).square() * has_tokens).sum() / num_seqs,
        "ratio_max": torch.where(valid, ratio, 0).max(),
    }
    return {ROLLOUT_CORR + key: value.detach() for key, value in terms.items()}


def rollout_corr_metrics(terms: dict) -> dict:
    """The diagnostics from rollout_corr_terms' terms (added up over micro-batches and ranks where the update measured
    them): the effective sample size ESS = (sum w)^2 / (n sum w^2) = mean(w)^2 / mean(w^2), 1 for equal weights and 1/n
    for one weight that outweighs all others; the spread of r_t untruncated, std^2 = mean((r - 1)^2) - (mean(r) - 1)^2,
    and its largest, as rollout/importance_weight_std and _max; the rest as they are."""
    metrics = {key: float(value) for key, value in terms.items()}
    metrics[ROLLOUT_CORR + "ess"] = metrics[ROLLOUT_CORR + "weight_mean"] ** 2 / metrics.pop(ROLLOUT_CORR + "weight_sq_mean")
    mean_r_minus_1 = metrics[ROLLOUT_CORR + "kl_k3"] - metrics[ROLLOUT_CORR + "kl_k1"]  # mean(r - 1 - log r) - mean(-log r)
    metrics["rollout/importance_weight_std"] = max(metrics[ROLLOUT_CORR + "chi2_token"] - mean_r_minus_1**2, 0.0) ** 0.5
    metrics["rollout/importance_weight_max"] = metrics.pop(ROLLOUT_CORR + "ratio_max")
    return metrics


def skipped_pass_metrics(old_log_prob, rollout_log_prob, entropy, mask, num_tokens, num_seqs, args: Args) -> dict:
    """What the old-log-prob pass would have measured, measured by the update that stands in for it (its own log-probs,
    held constant, are the old ones): entropy, the engine's gap (common/update_metrics.py names its terms for
    common/rollout.py) and the off-policy diagnostics' terms, as this micro-batch's shares."""
    token_mean = partial(agg_loss, mask=mask, mode="token-mean", num_tokens=num_tokens)
    gap = rollout_gap_terms(old_log_prob, rollout_log_prob, mask, num_tokens)
    level, threshold = rollout_is_level(args), args.rollout_is_threshold
    corr = rollout_corr_terms(old_log_prob, rollout_log_prob, mask, mask, level, threshold, num_tokens, num_seqs)
    return {"entropy": token_mean(entropy).detach()} | gap | corr


REJECTION_CRITERIA = [f"{level}_{k}" for level in ("token", "seq_sum", "seq_mean", "seq_max") for k in ("k1", "k2", "k3")]
# The named presets: a criterion and its default threshold
REJECTION_PRESETS = {"icepop": ("token_k1", "0.5_5"), "geo_mask": ("seq_mean_k1", "0.999_1.001")}


def rollout_is_level(args: Args) -> str:
    """--rollout-is; unset, token with --tis or --max-staleness above 0 (the decoupled objective weights each token by
    the proximal policy over the one that sampled it, Hilton et al. 2022, "Batch size-invariance for policy
    optimization"), else none."""
    if args.rollout_is is not None:
        return args.rollout_is
    return "token" if args.tis or args.max_staleness > 0 else "none"


def check_rollout_correction(args: Args) -> list[tuple[str, float, float]]:
    """The off-policy correction's flags, checked before any worker starts; --rollout-rs's criteria as (name, lower,
    upper): a k1 criterion bounds the ratio (lower_upper), a k2 or k3 one its value from above."""
    if args.tis and args.rollout_is not in (None, "token"):
        raise ValueError(f"--tis is short for --rollout-is token, but --rollout-is is {args.rollout_is}: pass one of them")
    if not args.rollout_is_threshold > 0:
        raise ValueError(f"--rollout-is-threshold {args.rollout_is_threshold}: the importance weight's bound must be above 0")
    names = [name.strip() for name in args.rollout_rs.split(",")] if args.rollout_rs else []
    thresholds = [value.strip() for value in args.rollout_rs_threshold.split(",")] if args.rollout_rs_threshold else []
    if thresholds and len(thresholds) != len(names):
        raise ValueError(
            f"--rollout-rs-threshold {args.rollout_rs_threshold}: {len(thresholds)} thresholds for the {len(names)} "
            f"criteria of --rollout-rs {args.rollout_rs!r}; give one per criterion, comma-separated"
        )
    criteria = []
    for name, threshold in zip(names, thresholds or [""] * len(names)):
        criterion, default = REJECTION_PRESETS.get(name, (name, ""))
        if criterion not in REJECTION_CRITERIA:
            raise ValueError(
                f"--rollout-rs: unknown criterion '{name}'; choose from {', '.join(REJECTION_CRITERIA)} or the presets "
                f"{', '.join(REJECTION_PRESETS)}"
            )
        threshold = threshold or default
        k1 = criterion.endswith("k1")
        try:
            bounds = [float(value) for value in threshold.split("_")]
        except ValueError:
            bounds = []
        if k1 and not (len(bounds) == 2 and 0 < bounds[0] <= 1 <= bounds[1]):
            raise ValueError(
                f"--rollout-rs-threshold '{threshold}' for {name}: a k1 criterion bounds the ratio pi_old / pi_rollout "
                "as lower_upper with 0 < lower <= 1 <= upper, e.g. 0.5_2.0"
            )
        if not k1 and not (len(bounds) == 1 and bounds[0] > 0):
            raise ValueError(f"--rollout-rs-threshold '{threshold}' for {name}: a k2 or k3 criterion takes one bound above 0")
        criteria.append((criterion, *bounds) if k1 else (criterion, -math.inf, bounds[0]))
    return criteria


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
    (rollout_is_weights)."""
    log_ratio = (log_prob - old_log_prob).clamp(-20, 20)
    ratio = log_ratio.exp()
    surrogate = -advantages * ratio
    surrogate_clipped = -advantages * ratio.clamp(1 - clip_low, 1 + clip_high)
    clipped_loss = torch.maximum(surrogate, surrogate_clipped)
    dual_clipped_loss = torch.minimum(clipped_loss, -advantages * clip_c)
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


def needs_old_log_prob_pass(args: Args, reward_reads_it: bool = False) -> bool:
    """Whether the step computes the policy's log-probs before its update (the old-log-prob pass): when more than one
    optimiser step sees the batch (after the first the policy is no longer the one that was), when --rollout-rs rejects
    tokens before the update counts them, or when the reward reads them (a KL to the reference in it). Else the update's
    own log-probs, held constant, are the old ones, and it measures what the pass would have (skipped_pass_metrics)."""
    return args.ppo_epochs > 1 or args.mini_batch_size < args.train_batch_size or bool(args.rollout_rs) or reward_reads_it


def actor_loss(batch, outputs, minibatch_tokens, minibatch_seqs, args: Args):
    """The policy's loss on one micro-batch, as its share of the mini-batch (see agg_loss)."""
    log_prob, entropy = outputs
    mask, counts = batch["response_mask"], (minibatch_tokens, minibatch_seqs)
    aggregate = partial(agg_loss, mask=mask, mode=args.loss_agg_mode, num_tokens=minibatch_tokens, num_seqs=minibatch_seqs)
    # Without an old-log-prob pass (one optimiser step sees the batch) the policy before this update is this one,
    # unchanged so far: its log-probs held constant are the old ones (the ratio is 1, and its gradient that of the ratio).
    old_log_prob = batch["old_log_probs"] if "old_log_probs" in batch else log_prob.detach()
    # The engine sampled from pi_rollout, not pi_old: other numerics, and older weights with --max-staleness, where the
    # decoupled objective (Hilton et al. 2022) clips around pi_old. --rollout-is weights the loss by pi_old / pi_rollout.
    is_weights, level = None, rollout_is_level(args)
    if level != "none":
        log_ratio = rollout_log_ratio(old_log_prob, batch["rollout_log_probs"])
        is_weights = rollout_is_weights(log_ratio, mask, level, args.rollout_is_threshold)
    clip = (args.clip_ratio_low, args.clip_ratio_high, args.clip_ratio_c)
    pg_loss, metrics = compute_policy_loss(
        old_log_prob, log_prob, batch["advantages"], mask, *clip, args.loss_agg_mode, *counts, is_weights
    )
    if "old_log_probs" not in batch:
        metrics |= skipped_pass_metrics(old_log_prob, batch["rollout_log_probs"], entropy, mask, *counts, args)
    loss = pg_loss - args.entropy_coef * aggregate(entropy)
    metrics["pg_loss"] = pg_loss.detach()
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
        demo_settings = dict(lr=6e-4, n=16, train_batch_size=32, mini_batch_size=8, total_steps=400, kl_coef=0.2)
        args = demo.apply(Args, args, **demo_settings)
    if args.n < 2 and not args.single_sample_groups:
        raise ValueError(
            f"--n {args.n}: the advantage compares each response with the others sampled for its prompt, so a group "
            "of one gets its raw score. Sample --n 2 or more, or pass --single-sample-groups to train so anyway"
        )
    rejection = check_rollout_correction(args)
    run = Run("rloo", args)
    policy = run.policy(use_reference=args.kl_coef > 0)
    log_prob_inputs = ("input_ids", "attention_mask", "position_ids", "responses")
    old_log_prob_pass = needs_old_log_prob_pass(args, reward_reads_it=args.kl_coef > 0)
    update_inputs = [*log_prob_inputs, "response_mask", "advantages", "rollout_log_probs"]
    if old_log_prob_pass:
        update_inputs.append("old_log_probs")
    correction = (rollout_is_level(args), args.rollout_is_threshold)

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
        update_mask = batch["response_mask"]
        if old_log_prob_pass:
            with timer("old_log_prob", metrics):
                batch |= policy.scatter("compute_log_prob", batch.select(*log_prob_inputs))
            # The engine's own log-probs against the trainer's: the gap --rollout-is corrects, too large when the engine
            # lags behind.
            metrics |= rollout_logprob_gap(batch, args.max_rollout_logprob_diff)
            # Rejected tokens and sequences leave the update through its mask, and its denominators with them.
            old_log_probs, rollout_log_probs = batch["old_log_probs"], batch["rollout_log_probs"]
            update_mask = rollout_rejection(rollout_log_ratio(old_log_probs, rollout_log_probs), update_mask, rejection)
            terms = rollout_corr_terms(old_log_probs, rollout_log_probs, batch["response_mask"], update_mask, *correction)
        if args.kl_coef > 0:
            with timer("ref_log_prob", metrics):
                batch |= policy.scatter("compute_ref_log_prob", batch.select(*log_prob_inputs))

        # 4. RLOO's advantage: the response's KL-penalised reward against the mean of the others', the same for each
        # of its tokens.
        with timer("advantages", metrics):
            response_mask, kl = batch["response_mask"], torch.zeros_like(batch["response_mask"])
            if args.kl_coef > 0:
                kl = kl_penalty(batch["old_log_probs"], batch["ref_log_probs"], args.kl_type)
            advantages = compute_rloo_advantages(kl_penalised_scores(scores, kl, response_mask, args.kl_coef), batch["uid"])
            batch["advantages"] = advantages[:, None] * response_mask
            metrics["actor/kl"] = ((kl * response_mask).sum() / response_mask.sum()).item()

        # 5. Policy update: clipped surrogate, over epochs x mini-batches x micro-batches.
        with timer("update", metrics):
            update_batch = batch.select(*update_inputs)
            update_batch["response_mask"] = update_mask
            actor_metrics = policy.scatter("update", update_batch, loss_fn=partial(actor_loss, args=args))[0]
        if not old_log_prob_pass:  # the pass's figures, measured by the update: the gap stops the run before the next step
            metrics |= rollout_gap_of_update(actor_metrics, batch["staleness"], args.max_rollout_logprob_diff)
            terms = {key: actor_metrics.pop(key) for key in list(actor_metrics) if key.startswith(ROLLOUT_CORR)}
        metrics |= {f"actor/{key}": value for key, value in actor_metrics.items()} | rollout_corr_metrics(terms)
        run.end_step(step, batch, scores, metrics)

    run.finish()
