# DAPO: Yu et al. 2025 (https://arxiv.org/abs/2503.14476), a fork of grpo_hybrid.py with its four techniques:
# clip-higher, dynamic sampling, a token-level policy loss, and overlong reward shaping; no KL term.
from dataclasses import dataclass
from functools import partial
from typing import Literal

import numpy as np
import torch
import tyro

from common.rollout_correction import loss_weights, needs_old_log_prob_pass, update_terms
from common.run import RunArgs, flag


@dataclass
class Args(RunArgs):
    """The algorithm's flags; those every script shares (model, data, workers, batches, checkpoints) are in common/args.py"""

    norm_adv_by_std: bool = True
    """divide advantages by the group's std (False: Dr.GRPO)"""
    clip_ratio_low: float = 0.2
    """PPO clip range below 1"""
    clip_ratio_high: float = 0.28
    """PPO clip range above 1 (clip-higher: wider than below, so unlikely tokens can grow)"""
    clip_ratio_c: float = 10.0
    """dual-clip bound for negative advantages"""
    loss_agg_mode: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = "token-mean"
    """how per-token losses become one number"""
    kl_loss_coef: float = 0.0
    """weight of KL(policy || reference) in the loss; 0 skips the reference"""
    kl_loss_type: Literal["kl", "abs", "mse", "low_var_kl"] = "low_var_kl"
    """KL estimator: k1, |k1|, k2, k3"""
    entropy_coef: float = 0.0
    """entropy bonus"""
    single_sample_groups: bool = False
    """allow --n 1: each response is then its own group, and its advantage its raw score (no baseline)"""
    filter_groups: bool = True
    """dynamic sampling: drop prompts whose samples all got the same --filter-metric, sample more until the batch is full"""
    filter_metric: Literal["score", "seq_reward"] = "score"
    """what must vary within a group: the raw score (the paper's accuracy), or the shaped reward (score + overlong
    penalty), which also keeps groups whose samples differ only in length"""
    gen_batch_size: int | None = flag(None, positive=True)
    """prompts generated per round of dynamic sampling; default 3 x --train-batch-size"""
    max_gen_batches: int = flag(10, resumable=True)
    """most rounds of dynamic sampling per step (0: no bound)"""
    overlong_buffer_length: int = 256
    """overlong reward shaping: responses that run into the last this many tokens of --max-response-length are
    penalised, more the nearer the limit; 0 turns the shaping off (the recipe: 4096 of 20480)"""
    overlong_penalty_factor: float = 1.0
    """penalty at the limit itself"""
    n: int = flag(16, positive=True)
    """responses sampled per prompt (the recipe's 16)"""
    mini_batch_size: int = flag(2, positive=True)
    """prompts per optimiser step: the recipe's 16 optimiser steps per batch of 32 prompts (512 and 32 in the paper)"""
    weight_decay: float = 0.1
    """AdamW weight decay (the recipe's)"""
    lr_warmup_steps: int = 10
    """linear learning-rate warm-up, in training steps (the recipe's)"""


def compute_grpo_advantages(scores: torch.Tensor, group_ids: np.ndarray, norm_by_std: bool = True, eps: float = 1e-6):
    """(score - group mean) / (group std + eps), groups being the samples of one prompt.

    The std uses Bessel's correction; a group of one has mean 0 and std 1.
    """
    advantages = torch.empty_like(scores)  # [batch]
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


def filter_groups(values: torch.Tensor, group_ids: np.ndarray) -> np.ndarray:
    """Rows of the groups whose samples disagree (std > 0); a group of one sample is kept."""
    keep = np.zeros(len(group_ids), dtype=bool)  # [batch]
    for group in np.unique(group_ids):
        members = np.flatnonzero(group_ids == group)
        keep[members] = len(members) == 1 or bool(values[torch.as_tensor(members)].std() > 0)
    return keep


def overlong_penalty(response_lengths: torch.Tensor, max_response_length: int, buffer_length: int, penalty_factor: float):
    """0 up to max - buffer tokens, then falling linearly to -penalty_factor at the maximum."""
    excess = response_lengths - (max_response_length - buffer_length)  # [batch]
    return (-excess / buffer_length * penalty_factor).clamp(max=0)


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
    if args.kl_loss_coef > 0:
        kl = aggregate(kl_penalty(log_prob, batch["ref_log_probs"], args.kl_loss_type))
        loss = loss + args.kl_loss_coef * kl
        metrics["kl"] = kl.detach()
    return loss, metrics


if __name__ == "__main__":
    from common import demo
    from common.dataproto import DataProto
    from common.rollout_correction import rejection_mask, rollout_diagnostics, update_figures
    from common.run import Run
    from common.tracking import timer
    from common.workers import LOG_PROB_INPUTS

    args = tyro.cli(Args)
    if args.model_path is None or not args.train_files:
        demo_settings = dict(
            lr=6e-4, train_batch_size=32, mini_batch_size=8, total_steps=150, overlong_buffer_length=1, kl_loss_coef=0.2
        )
        args = demo.apply(Args, args, **demo_settings, gen_batch_size=96, max_gen_batches=30)
    if args.n < 2 and not args.single_sample_groups:
        raise ValueError(
            f"--n {args.n}: the advantage compares each response with the others sampled for its prompt, so a group "
            "of one gets its raw score. Sample --n 2 or more, or pass --single-sample-groups to train so anyway"
        )
    if not 0 <= args.overlong_buffer_length < args.max_response_length:
        raise ValueError(
            f"--overlong-buffer-length {args.overlong_buffer_length} with --max-response-length "
            f"{args.max_response_length}: the buffer is the last part of the limit, so it must be smaller than the "
            "limit (0 turns the shaping off)"
        )
    prompts_per_round = args.gen_batch_size or 3 * args.train_batch_size
    run = Run(args, prompts_per_batch=prompts_per_round if args.filter_groups else None)
    policy = run.policy(use_reference=args.kl_loss_coef > 0)
    old_log_prob_pass = needs_old_log_prob_pass(args)
    update_inputs = [*LOG_PROB_INPUTS, "response_mask", "advantages", "rollout_log_probs"]
    if old_log_prob_pass:
        update_inputs.append("old_log_probs")
    if args.kl_loss_coef > 0:
        update_inputs.append("ref_log_probs")

    for step in run.steps():
        metrics = {}

        # 1-2. Rollout and reward in rounds; dynamic sampling keeps prompts whose samples disagree (others have no advantage).
        # With --max-staleness the rollout workers generated each round while the policy trained on the batches before.
        kept, generated_prompts = [], 0
        while sum(map(len, kept)) < args.train_batch_size * args.n:
            if args.max_gen_batches and len(kept) == args.max_gen_batches:
                raise RuntimeError(
                    f"dynamic sampling kept {sum(map(len, kept)) // args.n} of {args.train_batch_size} prompts in {len(kept)} "
                    "rounds: nearly every group agrees, the data may be too easy or too hard for this model. Raise "
                    "--max-gen-batches (0: no bound) or --gen-batch-size"
                )
            with timer("generate", metrics):
                round_batch = run.next_rollouts(args.n, metrics)
            with timer("reward", metrics):
                round_batch["score"] = run.score(round_batch, metrics)
                lengths = round_batch["response_mask"].sum(-1)
                round_batch["seq_reward"] = round_batch["score"]
                if args.overlong_buffer_length > 0:
                    penalty = overlong_penalty(
                        lengths, args.max_response_length, args.overlong_buffer_length, args.overlong_penalty_factor
                    )
                    round_batch["seq_reward"] = round_batch["score"] + penalty
            generated_prompts += len(round_batch) // args.n
            keep = filter_groups(round_batch[args.filter_metric], round_batch["uid"]) if args.filter_groups else slice(None)
            kept.append(round_batch[keep])
        batch = DataProto.concat(kept)[: args.train_batch_size * args.n]
        scores, response_lengths = batch["score"], batch["response_mask"].sum(-1)
        metrics["train/num_gen_batches"] = len(kept)
        metrics["train/filtered_prompt_ratio"] = 1 - sum(map(len, kept)) / args.n / generated_prompts
        metrics["reward/overlong_penalty_mean"] = (batch["seq_reward"] - scores).mean().item()
        overlong = response_lengths > args.max_response_length - args.overlong_buffer_length
        metrics["response/overlong_ratio"] = overlong.float().mean().item()

        # 3. Log-probs of the sampled tokens under the policy that sampled them, and under the reference.
        if old_log_prob_pass:
            with timer("old_log_prob", metrics):
                batch |= policy.scatter("compute_log_prob", batch.select(*LOG_PROB_INPUTS))
        if args.kl_loss_coef > 0:
            with timer("ref_log_prob", metrics):
                batch |= policy.scatter("compute_ref_log_prob", batch.select(*LOG_PROB_INPUTS))

        # 4. GRPO's advantage: the response's score relative to its group, the same for each of its tokens.
        with timer("advantages", metrics):
            advantages = compute_grpo_advantages(batch["seq_reward"], batch["uid"], args.norm_adv_by_std)
            batch["advantages"] = advantages[:, None] * batch["response_mask"]  # [batch, response_len]

        # 5. Policy update: clipped surrogate + KL loss, over epochs x mini-batches x micro-batches.
        update_mask = rejection_mask(batch, args)  # --rollout-rs: rejected tokens and sequences leave the update
        with timer("update", metrics):
            update_batch = batch.select(*update_inputs)
            update_batch["response_mask"] = update_mask
            update = policy.update(update_batch, partial(actor_loss, args=args))
        # The engine's gap (too large: the run stops) and the off-policy diagnostics, measured by the pass or the update
        metrics |= rollout_diagnostics(batch, update_mask, update, args) | update_figures(update, "actor/")
        run.end_step(step, batch, scores, metrics)

    run.finish()
