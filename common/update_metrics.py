"""How an update adds up the figures its loss returns: one contract, written once.

A loss returns its figures as the micro-batch's shares (see agg_loss in the scripts); FSDPWorker._update adds them up
over micro-batches and ranks, except those whose names end in MAX or MIN, which keep the largest or the smallest.
(Without an old-log-prob pass the update measures the engine's gap and the off-policy diagnostics so:
common/rollout_correction.py names them and reads them back.)
"""

MAX, MIN = "_max", "_min"


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
