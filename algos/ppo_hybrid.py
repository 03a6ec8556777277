# PPO for language models: Ouyang et al. 2022, "InstructGPT" (https://arxiv.org/abs/2203.02155), with
# Schulman et al. 2017 (https://arxiv.org/abs/1707.06347) and GAE (https://arxiv.org/abs/1506.02438).
# An actor and a critic; token-level values and GAE; the KL to the reference is folded into the reward.
from dataclasses import dataclass
from functools import partial
from typing import Literal

import torch
import tyro

from common.rollout_correction import loss_weights, needs_old_log_prob_pass, update_terms
from common.run import RunArgs, flag


@dataclass
class Args(RunArgs):
    """The algorithm's flags; those every script shares (model, data, workers, batches, checkpoints) are in common/args.py"""

    gamma: float = 1.0
    """discount factor over response tokens"""
    lam: float = 1.0
    """GAE lambda"""
    clip_ratio_low: float = 0.2
    """PPO clip range below 1"""
    clip_ratio_high: float = 0.2
    """PPO clip range above 1"""
    clip_ratio_c: float = 3.0
    """dual-clip bound for negative advantages"""
    loss_agg_mode: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = "token-mean"
    """how per-token losses become one number"""
    kl_coef: float = 0.001
    """(initial) weight of the per-token KL(policy || reference) penalty in the reward; 0 skips the reference"""
    kl_type: Literal["kl", "abs", "mse", "low_var_kl"] = "kl"
    """KL estimator: k1, |k1|, k2, k3"""
    kl_ctrl: Literal["fixed", "adaptive"] = "fixed"
    """keep the KL coefficient fixed, or adapt it towards --kl-target (Ziegler et al. 2019)"""
    kl_target: float = 0.1
    """the adaptive controller's target KL per token"""
    kl_horizon: int = flag(10000, positive=True)
    """the adaptive controller's horizon, in samples"""
    entropy_coef: float = 0.0
    """entropy bonus"""
    critic_model_path: str | None = None
    """the critic's initial weights; by default the policy's (with a new value head)"""
    critic_lr: float = 1e-5
    """critic learning rate"""
    critic_warmup: int = 0
    """the first step that also updates the policy; the critic trains alone before it (as verl counts it: 0 and 1 both
    update the policy from step 1)"""
    cliprange_value: float = 0.5
    """values move at most this far from the old values before the loss is clipped"""
    critic_lora_rank: int = 0
    """LoRA rank for the critic; 0 trains every weight"""


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """Mean 0 and unit variance (Bessel-corrected) over the valid tokens."""
    count = mask.sum()
    mean = (values * mask).sum() / count
    variance = ((values - mean).square() * mask).sum() / (count - 1)
    return (values - mean) * torch.rsqrt(variance + eps)


def compute_gae(token_rewards: torch.Tensor, values: torch.Tensor, response_mask: torch.Tensor, gamma: float, lam: float):
    """Generalised advantage estimation over response tokens; returns (advantages, returns).

    A response ends at its last valid token: what follows holds no value and no
    reward. Tokens outside the mask (an environment's, in a multi-turn episode)
    are skipped: the model's token before them is followed by its token after.
    Returns are advantages + values before the advantages are whitened.
    """
    values, token_rewards = values * response_mask, token_rewards * response_mask
    advantages = torch.zeros_like(values)
    next_value, next_advantage = torch.zeros_like(values[:, 0]), torch.zeros_like(values[:, 0])
    for t in reversed(range(values.shape[1])):
        delta = token_rewards[:, t] + gamma * next_value - values[:, t]  # [batch]: r_t + gamma V_t+1 - V_t
        advantage = delta + gamma * lam * next_advantage  # A_t = delta_t + gamma lambda A_t+1
        valid = response_mask[:, t].bool()
        advantages[:, t] = torch.where(valid, advantage, 0.0)
        next_value = torch.where(valid, values[:, t], next_value)
        next_advantage = torch.where(valid, advantage, next_advantage)
    returns = (advantages + values) * response_mask
    return masked_whiten(advantages, response_mask) * response_mask, returns


def compute_value_loss(values, old_values, returns, mask, cliprange_value, agg_mode, num_tokens=None, num_seqs=None):
    """0.5 x the larger of the unclipped and clipped squared errors (PPO2's value clipping)."""
    clipped_values = old_values + (values - old_values).clamp(-cliprange_value, cliprange_value)
    unclipped_error, clipped_error = (values - returns).square(), (clipped_values - returns).square()
    loss = 0.5 * agg_loss(torch.maximum(unclipped_error, clipped_error), mask, agg_mode, num_tokens, num_seqs)
    clipfrac = agg_loss((clipped_error > unclipped_error).float(), mask, "token-mean", num_tokens)
    return loss, {"vf_clipfrac": clipfrac.detach()}


def update_kl_coef(kl_coef: float, current_kl: float, target_kl: float, n_steps: int, horizon: int) -> float:
    """The adaptive KL controller: beta <- beta x (1 + clip(KL/target - 1, -0.2, 0.2) x n_steps / horizon)."""
    proportional_error = min(max(current_kl / target_kl - 1, -0.2), 0.2)
    return kl_coef * (1 + proportional_error * n_steps / horizon)


def kl_penalised_rewards(scores: torch.Tensor, kl: torch.Tensor, response_mask: torch.Tensor, kl_coef: float) -> torch.Tensor:
    """Token rewards: -kl_coef x KL at every response token, plus the score at the last one (the model's last token:
    in a multi-turn episode the mask leaves the environment's tokens out)."""
    token_rewards = -kl_coef * kl * response_mask  # [batch, response_len]
    last = (response_mask * torch.arange(1, response_mask.shape[1] + 1)).argmax(-1)
    token_rewards[torch.arange(len(scores)), last] += scores
    return token_rewards


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


def critic_loss(batch, values, minibatch_tokens, minibatch_seqs, args: Args):
    """The critic's loss on one micro-batch, as its share of the mini-batch (see agg_loss)."""
    mask, counts = batch["response_mask"], (minibatch_tokens, minibatch_seqs)
    return compute_value_loss(
        values, batch["values"], batch["returns"], mask, args.cliprange_value, args.loss_agg_mode, *counts
    )


if __name__ == "__main__":
    from common import demo
    from common.episodes import split_turn_rewards
    from common.rollout_correction import rejection_mask, rollout_diagnostics, update_figures
    from common.run import Run
    from common.tracking import timer
    from common.workers import CriticWorker
    from common.workers import LOG_PROB_INPUTS

    args = tyro.cli(Args)
    if args.model_path is None or not args.train_files:
        # 16 samples per prompt: an answer the warm start gives a few percent shows up in most groups, so RL finds it before
        # what it learns on other problems pushes it out of reach
        demo_settings = dict(
            lr=6e-4, n=16, train_batch_size=32, mini_batch_size=8, total_steps=400, critic_lr=1e-3, kl_coef=0.2
        )
        args = demo.apply(Args, args, **demo_settings)
    # The critic shares each accelerator with the policy: two worker groups per accelerator.
    run = Run(args, worker_groups=2)
    policy = run.policy(use_reference=args.kl_coef > 0)
    critic_settings = dict(
        model_path=args.critic_model_path or args.model_path, lr=args.critic_lr, lora_rank=args.critic_lora_rank
    )
    critic = run.workers(CriticWorker, "critic", **critic_settings)
    old_log_prob_pass = needs_old_log_prob_pass(args, reward_reads_it=args.kl_coef > 0)
    update_inputs = [*LOG_PROB_INPUTS, "response_mask", "advantages", "rollout_log_probs"]
    if old_log_prob_pass:
        update_inputs.append("old_log_probs")
    kl_coef = run.resume(kl_coef=args.kl_coef)["kl_coef"]

    for step in run.steps():
        metrics = {}

        # 1. Rollout: n samples of every prompt.
        # With --max-staleness the rollout workers generated it while the policy trained on the batches before.
        with timer("generate", metrics):
            batch = run.next_rollouts(args.n, metrics)

        # 2. Outcome reward: one score per response.
        with timer("reward", metrics):
            scores = run.score(batch, metrics)

        # 3. Log-probs of the sampled tokens under the policy that sampled them and under the reference; values.
        if old_log_prob_pass:
            with timer("old_log_prob", metrics):
                batch |= policy.scatter("compute_log_prob", batch.select(*LOG_PROB_INPUTS))
        if args.kl_coef > 0:
            with timer("ref_log_prob", metrics):
                batch |= policy.scatter("compute_ref_log_prob", batch.select(*LOG_PROB_INPUTS))
        with timer("values", metrics):
            batch |= critic.scatter("compute_values", batch.select(*LOG_PROB_INPUTS))

        # 4. Token rewards (score at the end, KL penalty at every token), then GAE against the critic's values.
        with timer("advantages", metrics):
            response_mask, kl = batch["response_mask"], torch.zeros_like(batch["response_mask"])
            if args.kl_coef > 0:
                kl = kl_penalty(batch["old_log_probs"], batch["ref_log_probs"], args.kl_type)
            outcome_scores, turn_rewards = split_turn_rewards(scores, batch)  # an episode's turns: each on its last token
            token_rewards = kl_penalised_rewards(outcome_scores, kl, response_mask, kl_coef) + turn_rewards
            advantages, returns = compute_gae(token_rewards, batch["values"], response_mask, args.gamma, args.lam)
            batch["advantages"], batch["returns"] = advantages, returns
            metrics["actor/kl_coef"], metrics["actor/kl"] = kl_coef, ((kl * response_mask).sum() / response_mask.sum()).item()
            if args.kl_ctrl == "adaptive":
                kl_coef = update_kl_coef(kl_coef, metrics["actor/kl"], args.kl_target, len(batch), args.kl_horizon)

        # 5. Critic update (clipped value loss), then the policy's (clipped surrogate) once the critic has warmed up.
        with timer("update_critic", metrics):
            critic_inputs = batch.select(*LOG_PROB_INPUTS, "response_mask", "values", "returns")
            critic_update = critic.update(critic_inputs, partial(critic_loss, args=args))
        metrics |= update_figures(critic_update, "critic/")
        values, returns = batch["values"][response_mask.bool()], returns[response_mask.bool()]
        metrics["critic/values_mean"] = values.mean().item()
        metrics["critic/explained_variance"] = (1 - (returns - values).var() / (returns.var() + 1e-8)).item()
        if step < args.critic_warmup:
            run.end_step(step, batch, scores, metrics, kl_coef=kl_coef)
            continue
        update_mask = rejection_mask(batch, args)  # --rollout-rs: rejected tokens and sequences leave the update
        with timer("update", metrics):
            update_batch = batch.select(*update_inputs)
            update_batch["response_mask"] = update_mask
            update = policy.update(update_batch, partial(actor_loss, args=args))
        # The engine's gap (too large: the run stops) and the off-policy diagnostics, measured by the pass or the update
        metrics |= rollout_diagnostics(batch, update_mask, update, args) | update_figures(update, "actor/")
        run.end_step(step, batch, scores, metrics, kl_coef=kl_coef)

    run.finish()
