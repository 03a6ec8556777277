"""How far the engine's samples are from the trainer's policy, and what an update does about it.

Per sampled token, r_t = pi_old(y_t) / pi_rollout(y_t): pi_old the policy before the update (with --max-staleness the
proximal policy of the decoupled objective), pi_rollout the engine's probability of its own sample (other numerics,
older weights). This room holds, as functions of tensors and the run's flags, without Ray and without side effects on
import:

- the engine's gap, |log pi_old - log pi_rollout| per token, checked against --max-rollout-logprob-diff;
- the importance weights of --rollout-is (the scripts multiply their per-token loss by them);
- the rejection of --rollout-rs (the scripts' update mask loses what it rejects), its criteria and presets;
- the diagnostics logged every step, computed by the driver after the old-log-prob pass or, where the pass is skipped,
  by the update as shares that the worker adds up (update_terms) and rollout_diagnostics reads back.

Against verl 0.9.1's rollout_corr_helper: `log_ppl_diff` (the mean over sequences of log ppl_trainer - log ppl_rollout)
means what verl's does. Three diagnostics differ from verl's idea of the same name and are named apart:
`chi2_centered_token` and `chi2_centered_seq` are mean((r - 1)^2), where verl's chi2_token and chi2_seq are
mean(r^2) - 1 (equal in expectation, not per batch); `rollout/ratio_std` and `_max` are r_t's untruncated, where
verl's rollout_is_std is the applied weights'; `emptied_seq_share` counts a sequence when none of its tokens is left,
where verl's sequence rejection share counts one when any token is rejected. A k1 rejection bound applies to
pi_old / pi_rollout; verl's token_k1 bounds the reciprocal (its `0.5_5` is this project's `0.2_2`).
"""

from __future__ import annotations

import math

import torch

from common.update_metrics import MAX

ROLLOUT_CORR = "rollout_corr/"
"""the prefix of the off-policy diagnostics"""
ROLLOUT_LOGPROB_DIFF = "rollout_logprob_diff"
"""|log pi_old - log pi_rollout| of the sampled tokens, their mean: the update's term where it stands in for the pass"""
ROLLOUT_LOGPROB_DIFF_MAX = ROLLOUT_LOGPROB_DIFF + MAX
REJECTION_CRITERIA = [f"{level}_{k}" for level in ("token", "seq_sum", "seq_mean", "seq_max") for k in ("k1", "k2", "k3")]
REJECTION_PRESETS = {"icepop": ("token_k1", "0.5_5"), "geo_mask": ("seq_mean_k1", "0.999_1.001")}
"""the named presets: a criterion and its default threshold"""


def rollout_log_ratio(old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor) -> torch.Tensor:
    """log r_t = log pi_old(y_t) - log pi_rollout(y_t), bounded at +-20 so that r_t, its products and its squares stay
    finite; without gradient. [batch, response_len]"""
    return (old_log_prob - rollout_log_prob).clamp(-20, 20).detach()


def rollout_is_weights(log_ratio: torch.Tensor, mask: torch.Tensor, level: str, threshold: float) -> torch.Tensor:
    """Importance weights, without gradient. token: w_t = min(r_t, C) (truncated importance sampling, Yao et al. 2025,
    "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training"); sequence: w_t = min(prod_t r_t, C) over
    the response's tokens in `mask`, the same on each of them (Liu et al. 2025, "When Speed Kills Stability")."""
    if level == "sequence":
        log_ratio = (log_ratio * mask).sum(-1, keepdim=True).clamp(-20, 20).expand_as(log_ratio)
    return log_ratio.exp().clamp(max=threshold).detach()


def rollout_is_level(args) -> str:
    """--rollout-is; unset, token with --tis or --max-staleness above 0 (the decoupled objective weights each token by
    the proximal policy over the one that sampled it, Hilton et al. 2022, "Batch size-invariance for policy
    optimization"), else none."""
    if args.rollout_is is not None:
        return args.rollout_is
    return "token" if args.tis or args.max_staleness > 0 else "none"


def loss_weights(batch, old_log_prob: torch.Tensor, args) -> torch.Tensor | None:
    """The weights of --rollout-is for an update's micro-batch (its `response_mask`, rejection applied), None without."""
    level = rollout_is_level(args)
    if level == "none":
        return None
    log_ratio = rollout_log_ratio(old_log_prob, batch["rollout_log_probs"])
    return rollout_is_weights(log_ratio, batch["response_mask"], level, args.rollout_is_threshold)


def rollout_rejection(log_ratio: torch.Tensor, mask: torch.Tensor, criteria: list[tuple[str, float, float]]):
    """`mask` without the tokens and sequences that a criterion (name, lower, upper) rejects. Per token, Schulman's
    estimators ("Approximating KL divergence"): k1 = log r_t, bounded as the ratio is (IcePop: Ling Team 2025, "Every
    Step Evolves"), k2 = (log r_t)^2 / 2, k3 = r_t - 1 - log r_t. A sequence criterion judges the sum of its tokens'
    values, their mean (seq_mean_k1: the ratio's geometric mean) or their max (any token out of bounds). The
    rejections of several criteria add up."""
    kept, valid = mask.clone(), mask.bool()
    for name, lower, upper in criteria:
        _, *aggregate, estimator = name.split("_")
        values = {"k1": log_ratio, "k2": 0.5 * log_ratio.square(), "k3": log_ratio.exp() - 1 - log_ratio}[estimator]
        low, high = (math.log(lower), math.log(upper)) if estimator == "k1" else (lower, upper)
        if aggregate == ["sum"]:
            values = (values * mask).sum(-1, keepdim=True)  # [batch, 1]
        elif aggregate == ["mean"]:
            values = (values * mask).sum(-1, keepdim=True) / mask.sum(-1, keepdim=True).clamp(min=1)  # [batch, 1]
        rejected = (values < low) | (values > high)
        if aggregate == ["max"]:
            rejected = (rejected & valid).any(-1, keepdim=True)
        kept = kept * ~rejected
    return kept


def rejection_criteria(args) -> list[tuple[str, float, float]]:
    """--rollout-rs's criteria as (name, lower, upper), with --rollout-rs-threshold's bounds or the presets': a k1
    criterion bounds the ratio (lower_upper), a k2 or k3 one its value from above. A ValueError names a bad one."""
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


def check_rollout_correction(args) -> None:
    """The correction's flags, checked before any worker starts (common/args.py's check_args)."""
    if args.tis and args.rollout_is not in (None, "token"):
        raise ValueError(f"--tis is short for --rollout-is token, but --rollout-is is {args.rollout_is}: pass one of them")
    if not args.rollout_is_threshold > 0:
        raise ValueError(f"--rollout-is-threshold {args.rollout_is_threshold}: the importance weight's bound must be above 0")
    rejection_criteria(args)


def rejection_mask(batch, args) -> torch.Tensor:
    """The update's mask: `response_mask` without what --rollout-rs rejects (which needs the old-log-prob pass)."""
    criteria = rejection_criteria(args)
    if not criteria:
        return batch["response_mask"]
    log_ratio = rollout_log_ratio(batch["old_log_probs"], batch["rollout_log_probs"])
    return rollout_rejection(log_ratio, batch["response_mask"], criteria)


def needs_old_log_prob_pass(args, reward_reads_it: bool = False) -> bool:
    """Whether the step computes the policy's log-probs before its update (the old-log-prob pass): when more than one
    optimiser step sees the batch (after the first the policy is no longer the one that was), when --rollout-rs rejects
    tokens before the update counts them, or when the reward reads them (a KL to the reference in it). Else the update's
    own log-probs, held constant, are the old ones, and it measures what the pass would have (update_terms)."""
    return args.ppo_epochs > 1 or args.mini_batch_size < args.train_batch_size or bool(args.rollout_rs) or reward_reads_it


def _token_mean(values: torch.Tensor, mask: torch.Tensor, num_tokens=None) -> torch.Tensor:
    """sum(values x mask) / num_tokens: with the batch's `num_tokens`, a micro-batch's share of its mean (the scripts'
    agg_loss "token-mean")."""
    num_tokens = max(mask.sum() if num_tokens is None else num_tokens, 1)
    return (values * mask).sum(-1).sum() / num_tokens


def rollout_corr_terms(old_log_prob, rollout_log_prob, mask, kept, level, threshold, num_tokens=None, num_seqs=None):
    """The diagnostics' terms over every sampled token in `mask` (rejected or not; `kept` is what rejection left), as
    the shares of a batch of `num_tokens` tokens and `num_seqs` sequences that add up over micro-batches and ranks, and
    the extremes (*_max, *_min) that the worker keeps. w: --rollout-is's weights, r_t with none.
    KL(pi_rollout || pi_old) = mean(-log r) (k1) and mean(r - 1 - log r) (k3); ppl = exp(-mean log-prob) per sequence
    under either policy, and log ppl_trainer - log ppl_rollout; chi2_centered = mean((r - 1)^2) per token and per
    sequence (r: the product over the response); rollout_diagnostics finishes them."""
    log_ratio = rollout_log_ratio(old_log_prob, rollout_log_prob)  # [batch, response_len]
    ratio, valid, has_tokens = log_ratio.exp(), mask.bool(), mask.bool().any(-1)
    weights = rollout_is_weights(log_ratio, kept, level, threshold) if level != "none" else ratio
    num_seqs = has_tokens.sum() if num_seqs is None else num_seqs
    lengths = mask.sum(-1).clamp(min=1)  # [batch]
    seq_log_ratio = (log_ratio * mask).sum(-1)  # [batch]
    terms = {
        "weight_mean": _token_mean(weights, mask, num_tokens),
        "weight_sq_mean": _token_mean(weights.square(), mask, num_tokens),
        "weight_max": torch.where(valid, weights, 0).max(),
        "weight_min": torch.where(valid, weights, math.inf).min(),
        "rejected_token_share": _token_mean(1 - kept, mask, num_tokens),
        "emptied_seq_share": (has_tokens & ~kept.bool().any(-1)).sum() / num_seqs,
        "kl_k1": _token_mean(-log_ratio, mask, num_tokens),
        "kl_k3": _token_mean(ratio - 1 - log_ratio, mask, num_tokens),
        "ppl_trainer": (-(old_log_prob * mask).sum(-1) / lengths).exp()[has_tokens].sum() / num_seqs,
        "ppl_rollout": (-(rollout_log_prob * mask).sum(-1) / lengths).exp()[has_tokens].sum() / num_seqs,
        "log_ppl_diff": (-seq_log_ratio / lengths).sum() / num_seqs,
        "chi2_centered_token": _token_mean((ratio - 1).square(), mask, num_tokens),
        "chi2_centered_seq": ((seq_log_ratio.clamp(-20, 20).exp() - 1).square() * has_tokens).sum() / num_seqs,
        "ratio_max": torch.where(valid, ratio, 0).max(),
    }
    return {ROLLOUT_CORR + key: value.detach() for key, value in terms.items()}


def rollout_corr_metrics(terms: dict) -> dict:
    """The diagnostics from rollout_corr_terms' terms (added up over micro-batches and ranks where the update measured
    them): ESS = (sum w)^2 / (n sum w^2) = mean(w)^2 / mean(w^2), 1 for equal weights and 1/n for one that outweighs all
    others; r_t's spread untruncated, std^2 = mean((r - 1)^2) - (mean(r) - 1)^2, and its largest, as rollout/ratio_std
    and _max; the rest as they are."""
    metrics = {key: float(value) for key, value in terms.items()}
    metrics[ROLLOUT_CORR + "ess"] = metrics[ROLLOUT_CORR + "weight_mean"] ** 2 / metrics.pop(ROLLOUT_CORR + "weight_sq_mean")
    mean_r_minus_1 = metrics[ROLLOUT_CORR + "kl_k3"] - metrics[ROLLOUT_CORR + "kl_k1"]  # mean(r - 1 - log r) - mean(-log r)
    metrics["rollout/ratio_std"] = max(metrics[ROLLOUT_CORR + "chi2_centered_token"] - mean_r_minus_1**2, 0.0) ** 0.5
    metrics["rollout/ratio_max"] = metrics.pop(ROLLOUT_CORR + "ratio_max")
    return metrics


def rollout_gap_terms(old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, mask: torch.Tensor, num_tokens) -> dict:
    """What rollout_logprob_gap measures, as the shares of a batch of `num_tokens` valid tokens: mean and max of
    |log pi_old - log pi_rollout|."""
    gap = (old_log_prob - rollout_log_prob).abs() * mask  # [batch, response_len]
    return {ROLLOUT_LOGPROB_DIFF: (gap.sum() / num_tokens).detach(), ROLLOUT_LOGPROB_DIFF_MAX: gap.max().detach()}


def update_terms(batch, old_log_prob, entropy, num_tokens, num_seqs, args) -> dict:
    """Where the old-log-prob pass was skipped, what it would have measured, measured by the update that stands in for
    it (its own log-probs, held constant, are the old ones) as this micro-batch's shares: entropy, the engine's gap and
    the diagnostics' terms. Nothing where the pass ran (the driver measures them)."""
    if "old_log_probs" in batch:
        return {}
    mask, rollout_log_prob = batch["response_mask"], batch["rollout_log_probs"]
    gap = rollout_gap_terms(old_log_prob, rollout_log_prob, mask, num_tokens)
    level, threshold = rollout_is_level(args), args.rollout_is_threshold
    corr = rollout_corr_terms(old_log_prob, rollout_log_prob, mask, mask, level, threshold, num_tokens, num_seqs)
    return {"entropy": _token_mean(entropy, mask, num_tokens).detach()} | gap | corr


def rollout_diagnostics(batch, update_mask: torch.Tensor, update: dict, args) -> dict:
    """The step's gap and diagnostics, whether or not the old-log-prob pass ran: from the pass's log-probs in `batch`
    (`update_mask`: what rejection left), or from the terms that the update returned (read from `update`, which keeps
    them: update_figures leaves them out). The gap stops the run when the engine holds other weights than the
    policy's (check_rollout_gap)."""
    bound = args.max_rollout_logprob_diff
    if "old_log_probs" in batch:
        old_log_prob, rollout_log_prob, mask = batch["old_log_probs"], batch["rollout_log_probs"], batch["response_mask"]
        correction = (rollout_is_level(args), args.rollout_is_threshold)
        return rollout_logprob_gap(batch, bound) | rollout_corr_metrics(
            rollout_corr_terms(old_log_prob, rollout_log_prob, mask, update_mask, *correction)
        )
    gap = rollout_gap_of_update(update, batch["staleness"], bound)
    return gap | rollout_corr_metrics({key: value for key, value in update.items() if key.startswith(ROLLOUT_CORR)})


def update_figures(update: dict, prefix: str) -> dict:
    """The update's own figures under `prefix` (actor/): all but the terms it measured for rollout_diagnostics in place
    of the old-log-prob pass (update_terms)."""
    terms = (ROLLOUT_CORR, ROLLOUT_LOGPROB_DIFF)
    return {prefix + key: value for key, value in update.items() if not key.startswith(terms)}


def rollout_logprob_gap(batch, bound: float) -> dict:
    """How far the engine's log-probs of its own samples are from the trainer's (`old_log_probs`), per token: mean and
    max. check_rollout_gap checks the samples generated from the weights the trainer holds (`staleness` 0, every one
    unless --max-staleness): those from older weights differ by the updates since, by design, and the probe after each
    weight sync checks their engines instead (check_probe)."""
    mask = batch["response_mask"].bool()
    gap = (batch["old_log_probs"] - batch["rollout_log_probs"]).abs()
    fresh = mask & (batch["staleness"] == 0)[:, None] if "staleness" in batch else mask
    if fresh.any():
        check_rollout_gap(gap[fresh].mean().item(), bound)
    return {"rollout/logprob_diff_mean": gap[mask].mean().item(), "rollout/logprob_diff_max": gap[mask].max().item()}


def rollout_gap_of_update(update: dict, staleness: torch.Tensor, bound: float) -> dict:
    """rollout_logprob_gap's figures where the update measured them (rollout_gap_terms, read from `update`). The gap
    is checked only when every sample came from the weights the trainer holds (`staleness` 0)."""
    gap, gap_max = update[ROLLOUT_LOGPROB_DIFF], update[ROLLOUT_LOGPROB_DIFF_MAX]
    if staleness.max() == 0:
        check_rollout_gap(gap, bound)
    return {"rollout/logprob_diff_mean": gap, "rollout/logprob_diff_max": gap_max}


def check_rollout_gap(mean: float, bound: float) -> dict:
    """The mean gap between the engine's log-probs of its samples and the trainer's, checked against `bound`.

    Float rounding and the engine's other kernels explain a small gap. A mean gap above `bound` (0: no bound) means the
    engine samples from other weights than the policy's, stale or never loaded, and stops the run.
    """
    if bound and mean > bound:
        raise RuntimeError(
            f"the rollout engine does not hold the policy's weights: its log-probs of its own samples differ from the "
            f"trainer's by {mean:.3g} per token on average, beyond --max-rollout-logprob-diff {bound}. Look in the workers' "
            "log for weights the engine did not receive; with LoRA, check that the engine serves the adapter, or send "
            "merged weights with --lora-sync merged. Raise the bound only for an engine that computes in lower precision."
        )
    return {"rollout/logprob_diff_mean": mean}


def check_probe(version: int, trainer_probe: torch.Tensor, engine_probes: list[torch.Tensor], bound: float) -> dict:
    """The probe's log-probs under the weights of update `version`, as the trainer and as each rollout worker computes
    them after receiving those weights (common/split_engines.py, SplitEngines.send_weights): a mean gap above `bound`
    means an engine generates from other weights, and stops the run as check_rollout_gap does."""
    gap = max((probe - trainer_probe).abs().mean().item() for probe in engine_probes)
    try:
        check_rollout_gap(gap, bound)
    except RuntimeError as error:
        raise RuntimeError(f"after the weights of update {version} reached the rollout workers, {error}") from None
    return {"rollout/probe_logprob_diff": gap}
