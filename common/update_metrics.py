"""The names of the figures an update's loss returns and the driver reads: one contract, written once.

A loss returns its figures as the micro-batch's shares (see agg_loss in the scripts); FSDPWorker._update adds them up
over micro-batches and ranks, except those whose names end in MAX or MIN, which keep the largest or the smallest.
Without an old-log-prob pass the update stands in for it and measures what it would have (rollout_gap_terms):
common/rollout.py's rollout_gap_of_update reads those by these names.
"""

import torch

MAX, MIN = "_max", "_min"
ROLLOUT_LOGPROB_DIFF = "rollout_logprob_diff"
"""|log pi_trainer - log pi_engine| of the sampled tokens, their mean"""
ROLLOUT_LOGPROB_DIFF_MAX = ROLLOUT_LOGPROB_DIFF + MAX
ROLLOUT_CORR = "rollout_corr/"
"""the prefix of the off-policy diagnostics' terms (rollout_corr_terms in the scripts, which also give the importance
weights' spread)"""


def accumulate(shares: dict, key: str, value: float) -> None:
    """Add a micro-batch's figure to its mini-batch's: a sum, or the extreme for the names ending in MAX or MIN."""
    if key not in shares:
        shares[key] = value
    elif key.endswith(MAX):
        shares[key] = max(shares[key], value)
    elif key.endswith(MIN):
        shares[key] = min(shares[key], value)
    else:
        shares[key] += value


def rollout_gap_terms(old_log_prob: torch.Tensor, rollout_log_prob: torch.Tensor, mask: torch.Tensor, num_tokens) -> dict:
    """What rollout_logprob_gap measures on the old-log-prob pass's batch, as the shares of a batch of `num_tokens`
    valid tokens: measured by an update whose own log-probs, held constant, are the old ones."""
    gap = (old_log_prob - rollout_log_prob).abs() * mask
    return {ROLLOUT_LOGPROB_DIFF: (gap.sum() / num_tokens).detach(), ROLLOUT_LOGPROB_DIFF_MAX: gap.max().detach()}
