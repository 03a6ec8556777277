"""The off-policy correction's menu (importance weights, rejection by divergence, diagnostics) against hand computations
on a small batch with padding and uneven lengths: common/rollout_correction.py, and where each script's loss takes it."""

import importlib
import math
import statistics

import pytest
import torch
from grpo_hybrid import agg_loss
from helpers import RL_SCRIPTS, run_script, stop_in_process

from common.args import RunArgs
from common.rollout_correction import (
    REJECTION_CRITERIA,
    ROLLOUT_CORR,
    check_rollout_correction,
    needs_old_log_prob_pass,
    rejection_criteria,
    rollout_corr_metrics,
    rollout_corr_terms,
    rollout_is_level,
    rollout_is_weights,
    rollout_log_ratio,
    rollout_rejection,
)
from common.update_metrics import accumulate

LN2, LN4 = math.log(2), math.log(4)
# Three responses of 3, 2 and 4 tokens; log r = log pi_old - log pi_rollout per token. Past each response the engine's
# log-probs are far off (log r 30), so any use of a padded position shows. Where r is 1/2, 2 or 4 the trainer's
# log-prob is 0, so that r is exact in floats and sits exactly on the bounds that tests put there.
MASK = torch.tensor([[1.0, 1.0, 1.0, 0.0], [1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0]])
LOG_RATIO = [[0.0, LN2, -LN2], [LN4, 0.0], [0.1, -0.1, 0.2, -0.2]]
OLD = torch.tensor([[-1.0, 0.0, 0.0, 0.0], [0.0, -0.2, 0.0, 0.0], [-0.3, -0.4, -0.6, -0.7]])
ROLLOUT = OLD - torch.tensor([row + [30.0] * (4 - len(row)) for row in LOG_RATIO])
TOKENS = [(i, t) for i, row in enumerate(LOG_RATIO) for t in range(len(row))]


def log_ratio():
    return rollout_log_ratio(OLD, ROLLOUT)


def criteria(rs, thresholds=""):
    return rejection_criteria(RunArgs(rollout_rs=rs, rollout_rs_threshold=thresholds))


def test_the_log_ratio_is_bounded_at_exp_20():
    bounded = rollout_log_ratio(torch.tensor([[0.0, -60.0]]), torch.tensor([[-50.0, 0.0]]))
    assert bounded.tolist() == [[20.0, -20.0]]
    weights = rollout_is_weights(bounded, torch.ones(1, 2), "token", threshold=1e30)
    assert weights[0].tolist() == pytest.approx([math.exp(20), math.exp(-20)], rel=1e-6)
    # a sequence's log-ratio sum is bounded too: 20 + 20 tokens' worth stays exp(20)
    sequence = rollout_is_weights(torch.full((1, 2), 20.0), torch.ones(1, 2), "sequence", threshold=1e30)
    assert sequence[0].tolist() == pytest.approx([math.exp(20)] * 2, rel=1e-6)
    terms = rollout_corr_terms(
        torch.tensor([[0.0, -60.0]]), torch.tensor([[-50.0, 0.0]]), torch.ones(1, 2), torch.ones(1, 2), "none", 2.0
    )
    assert all(math.isfinite(float(value)) for value in terms.values())


def test_tis_weights_are_capped_importance_ratios():
    old = torch.tensor([[0.0, -1.0, -2.0, -0.5]])
    rollout = torch.tensor([[0.0, -2.0, -0.5, -0.6]])
    weights = rollout_is_weights(old - rollout, torch.ones(1, 4), "token", threshold=2.0)
    # pi_old / pi_rollout = 1, e (capped to 2), e^-1.5, e^0.1
    torch.testing.assert_close(weights, torch.tensor([[1.0, 2.0, math.exp(-1.5), math.exp(0.1)]]))


def test_token_weights_are_the_ratio_truncated():
    weights = rollout_is_weights(log_ratio(), MASK, "token", threshold=2.0)
    expected = [[1.0, 2.0, 0.5], [2.0, 1.0], [min(math.exp(x), 2.0) for x in LOG_RATIO[2]]]  # r = 4 truncated to 2
    for i, t in TOKENS:
        assert weights[i, t].item() == pytest.approx(expected[i][t], rel=1e-6)
    assert not weights.requires_grad


@pytest.mark.parametrize("threshold, row_weights", [(2.0, [1.0, 2.0, 1.0]), (10.0, [1.0, 4.0, 1.0])])
def test_sequence_weights_are_the_product_over_the_response_truncated(threshold, row_weights):
    # products: 1 x 2 x 1/2 = 1; 4 x 1 = 4; e^(0.1 - 0.1 + 0.2 - 0.2) = 1
    weights = rollout_is_weights(log_ratio(), MASK, "sequence", threshold)
    for i, t in TOKENS:
        assert weights[i, t].item() == pytest.approx(row_weights[i], rel=1e-6)


KEEP_ALL = [[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]]


@pytest.mark.parametrize(
    "rs, thresholds, kept",
    [
        # r = 1, 2, 1/2 | 4, 1 | e^+-0.1, e^+-0.2: tokens outside [0.6, 1.9] go
        ("token_k1", "0.6_1.9", [[1, 0, 0, 0], [0, 1, 0, 0], [1, 1, 1, 1]]),
        ("token_k1", "0.5_4", KEEP_ALL),  # the bounds are inclusive
        # k2 = (log r)^2 / 2: 0, 0.24, 0.24 | 0.96, 0 | 0.005, 0.005, 0.02, 0.02
        ("token_k2", "0.1", [[1, 0, 0, 0], [0, 1, 0, 0], [1, 1, 1, 1]]),
        # k3 = r - 1 - log r: 0, 0.307, 0.193 | 1.614, 0 | below 0.03
        ("token_k3", "0.25", [[1, 0, 1, 0], [0, 1, 0, 0], [1, 1, 1, 1]]),
        # the products 1 | 4 | 1
        ("seq_sum_k1", "0.5_2", [[1, 1, 1, 0], [0, 0, 0, 0], [1, 1, 1, 1]]),
        # the geometric means 1 | 2 | 1
        ("seq_mean_k1", "0.5_1.9", [[1, 1, 1, 0], [0, 0, 0, 0], [1, 1, 1, 1]]),
        # a sequence with a token outside the bounds
        ("seq_max_k1", "0.6_1.9", [[0, 0, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]]),
        # k2 sums 0.48 | 0.96 | 0.05
        ("seq_sum_k2", "0.5", [[1, 1, 1, 0], [0, 0, 0, 0], [1, 1, 1, 1]]),
        # k2 means 0.16 | 0.48 | 0.0125
        ("seq_mean_k2", "0.1", [[0, 0, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]]),
        ("seq_max_k2", "0.5", [[1, 1, 1, 0], [0, 0, 0, 0], [1, 1, 1, 1]]),
        # k3 sums 0.5 | 1.614 | 0.05; means 0.167 | 0.807 | 0.0126; maxima 0.307 | 1.614 | 0.021
        ("seq_sum_k3", "0.4", [[0, 0, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]]),
        ("seq_mean_k3", "0.4", [[1, 1, 1, 0], [0, 0, 0, 0], [1, 1, 1, 1]]),
        ("seq_max_k3", "0.3", [[0, 0, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]]),
        # chained: IcePop's tokens, then the sequences by their mean k3
        ("token_k1,seq_mean_k3", "0.6_1.9,0.4", [[1, 0, 0, 0], [0, 0, 0, 0], [1, 1, 1, 1]]),
        # the presets: IcePop keeps r within [0.5, 5]; the geometric-mean mask keeps means within 0.1% of 1
        ("icepop", "", KEEP_ALL),
        ("geo_mask", "", [[1, 1, 1, 0], [0, 0, 0, 0], [1, 1, 1, 1]]),
        ("icepop,seq_sum_k1", ",0.5_2", [[1, 1, 1, 0], [0, 0, 0, 0], [1, 1, 1, 1]]),
    ],
)
def test_rejection_by_hand(rs, thresholds, kept):
    assert rollout_rejection(log_ratio(), MASK, criteria(rs, thresholds)).tolist() == kept


def test_the_presets_are_named_criteria():
    assert criteria("icepop") == [("token_k1", 0.5, 5.0)]
    assert criteria("geo_mask") == [("seq_mean_k1", 0.999, 1.001)]
    assert criteria("icepop", "0.8_1.25") == [("token_k1", 0.8, 1.25)]
    assert criteria("seq_mean_k3,token_k2", "0.1,0.2") == [("seq_mean_k3", -math.inf, 0.1), ("token_k2", -math.inf, 0.2)]


def test_rejected_tokens_and_sequences_leave_the_loss_and_its_denominator():
    loss = torch.arange(12.0).reshape(3, 4)
    kept = rollout_rejection(log_ratio(), MASK, criteria("token_k1,seq_mean_k3", "0.6_1.9,0.4"))  # see above
    # tokens left: (0, 0) and all four of row 2
    assert agg_loss(loss, kept, "token-mean").item() == pytest.approx((0 + 8 + 9 + 10 + 11) / 5)
    # a sequence rejected whole counts as no sequence: the mean is over the two left
    assert agg_loss(loss, kept, "seq-mean-token-mean").item() == pytest.approx((0 + 9.5) / 2)
    assert agg_loss(loss, kept, "seq-mean-token-sum").item() == pytest.approx((0 + 38) / 2)


def test_a_batch_rejected_whole_gives_no_nan():
    kept = torch.zeros_like(MASK)
    for mode in ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
        assert agg_loss(torch.ones(3, 4), kept, mode).item() == 0.0
    terms = rollout_corr_terms(OLD, ROLLOUT, MASK, kept, "sequence", 2.0)
    metrics = rollout_corr_metrics(terms)
    assert all(math.isfinite(value) for value in metrics.values())
    assert metrics[ROLLOUT_CORR + "rejected_token_share"] == 1.0
    assert metrics[ROLLOUT_CORR + "emptied_seq_share"] == 1.0


def hand_diagnostics(weights_of):
    """The diagnostics computed token by token in plain Python: `weights_of(i, t)` is the weight of token t of row i."""
    tokens = [(i, t, math.exp(LOG_RATIO[i][t])) for i, t in TOKENS]
    n = len(tokens)
    weights = [weights_of(i, t) for i, t, _ in tokens]
    seq_ratio = [math.exp(sum(row)) for row in LOG_RATIO]
    lengths = [len(row) for row in LOG_RATIO]
    old = [[OLD[i, t].item() for t in range(len(row))] for i, row in enumerate(LOG_RATIO)]
    rollout = [[o - x for o, x in zip(old[i], LOG_RATIO[i])] for i in range(3)]
    return {
        "weight_mean": sum(weights) / n,
        "weight_max": max(weights),
        "weight_min": min(weights),
        "ess": (sum(weights) ** 2) / (n * sum(w * w for w in weights)),
        "kl_k1": sum(-math.log(r) for _, _, r in tokens) / n,
        "kl_k3": sum(r - 1 - math.log(r) for _, _, r in tokens) / n,
        "chi2_centered_token": sum((r - 1) ** 2 for _, _, r in tokens) / n,
        "chi2_centered_seq": sum((r - 1) ** 2 for r in seq_ratio) / 3,
        "ppl_trainer": sum(math.exp(-sum(row) / len(row)) for row in old) / 3,
        "ppl_rollout": sum(math.exp(-sum(row) / len(row)) for row in rollout) / 3,
        "log_ppl_diff": sum(-sum(row) / length for row, length in zip(LOG_RATIO, lengths)) / 3,
    }


@pytest.mark.parametrize(
    "level, weights_of",
    [
        ("none", lambda i, t: math.exp(LOG_RATIO[i][t])),
        ("token", lambda i, t: min(math.exp(LOG_RATIO[i][t]), 2.0)),
        ("sequence", lambda i, t: [1.0, 2.0, 1.0][i]),
    ],
)
def test_diagnostics_by_hand(level, weights_of):
    kept = rollout_rejection(log_ratio(), MASK, criteria("token_k1", "0.6_1.9"))  # 3 of 9 tokens, no sequence whole
    metrics = rollout_corr_metrics(rollout_corr_terms(OLD, ROLLOUT, MASK, MASK, level, 2.0))
    expected = {ROLLOUT_CORR + key: value for key, value in hand_diagnostics(weights_of).items()}
    expected |= {ROLLOUT_CORR + "rejected_token_share": 0.0, ROLLOUT_CORR + "emptied_seq_share": 0.0}
    # r_t untruncated whatever the level: its spread over the tokens and its largest, r = 4
    ratios = [math.exp(LOG_RATIO[i][t]) for i, t in TOKENS]
    expected["rollout/ratio_std"] = statistics.pstdev(ratios)
    expected["rollout/ratio_max"] = 4.0
    assert metrics == pytest.approx(expected, rel=1e-5, abs=1e-7)
    rejecting = rollout_corr_metrics(rollout_corr_terms(OLD, ROLLOUT, MASK, kept, "none", 2.0))
    assert rejecting[ROLLOUT_CORR + "rejected_token_share"] == pytest.approx(3 / 9)
    assert rejecting[ROLLOUT_CORR + "emptied_seq_share"] == 0.0


def test_the_updates_shares_add_up_to_the_batchs_diagnostics():
    """Without the old-log-prob pass each micro-batch measures its share; the worker adds them up (extremes: keeps
    the largest or smallest), which gives the figures of the whole batch."""
    whole = rollout_corr_terms(OLD, ROLLOUT, MASK, MASK, "token", 2.0)
    shares = {}
    for rows in (slice(0, 1), slice(1, 3)):
        part = rollout_corr_terms(OLD[rows], ROLLOUT[rows], MASK[rows], MASK[rows], "token", 2.0, MASK.sum(), 3)
        for key, value in part.items():
            accumulate(shares, key, float(value))
    assert rollout_corr_metrics(shares) == pytest.approx(rollout_corr_metrics(whole), rel=1e-6)


def test_with_the_engine_equal_to_the_trainer_nothing_changes():
    """fp32 on both sides, no staleness: every weight 1, nothing rejected, the loss the uncorrected one."""
    every_criterion = ",".join(REJECTION_CRITERIA)
    thresholds = ",".join("0.5_2" if name.endswith("k1") else "0.01" for name in every_criterion.split(","))
    log_ratio = rollout_log_ratio(OLD, OLD)
    assert rollout_rejection(log_ratio, MASK, criteria(every_criterion, thresholds)).tolist() == KEEP_ALL
    for level in ("token", "sequence"):
        assert (rollout_is_weights(log_ratio, MASK, level, threshold=2.0) == 1).all()
    metrics = rollout_corr_metrics(rollout_corr_terms(OLD, OLD, MASK, MASK, "sequence", 2.0))
    for key in ("weight_mean", "weight_max", "weight_min", "ess"):
        assert metrics[ROLLOUT_CORR + key] == 1.0
    zero = ("kl_k1", "kl_k3", "chi2_centered_token", "chi2_centered_seq", "log_ppl_diff", "rejected_token_share")
    for key in (*zero, "emptied_seq_share"):
        assert metrics[ROLLOUT_CORR + key] == 0.0
    assert metrics[ROLLOUT_CORR + "ppl_trainer"] == metrics[ROLLOUT_CORR + "ppl_rollout"]
    assert metrics["rollout/ratio_std"] == 0.0 and metrics["rollout/ratio_max"] == 1.0


@pytest.mark.parametrize("script", RL_SCRIPTS)
@pytest.mark.parametrize("rollout_is", ["token", "sequence"])
def test_each_scripts_loss_with_the_engine_equal_to_the_trainer_is_the_uncorrected_loss(script, rollout_is):
    from common.dataproto import DataProto

    module = importlib.import_module(script)
    generator = torch.Generator().manual_seed(0)
    log_prob = -torch.rand(3, 4, generator=generator)
    batch = {
        "response_mask": MASK,
        "advantages": torch.randn(3, 1, generator=generator) * MASK,
        "old_log_probs": log_prob - 0.1 * torch.rand(3, 4, generator=generator),
        "ref_log_probs": log_prob - 0.3,
    }
    losses = []
    for setting in ("none", rollout_is):
        engine = batch["old_log_probs"] if setting != "none" else batch["old_log_probs"] - 0.5  # unread without weights
        tensors = DataProto.from_dict(batch | {"rollout_log_probs": engine})
        loss, _ = module.actor_loss(tensors, (log_prob, torch.rand(3, 4)), MASK.sum(), 3, module.Args(rollout_is=setting))
        losses.append(loss.item())
    assert losses[1] == pytest.approx(losses[0], rel=1e-6)


@pytest.mark.parametrize("script", RL_SCRIPTS)
def test_each_scripts_loss_weighs_each_token_by_its_sequences_weight(script):
    from common.dataproto import DataProto

    module = importlib.import_module(script)
    advantages = torch.tensor([[1.0], [-1.0], [0.5]]) * MASK
    batch = {"response_mask": MASK, "advantages": advantages, "old_log_probs": OLD, "rollout_log_probs": ROLLOUT}
    batch["ref_log_probs"] = OLD
    args = module.Args(rollout_is="sequence", rollout_is_threshold=2.0, entropy_coef=0.0)
    loss, _ = module.actor_loss(DataProto.from_dict(batch), (OLD.clone(), torch.zeros(3, 4)), MASK.sum(), 3, args)
    # the ratio pi / pi_old is 1 and unclipped: each token's loss is -advantage x its sequence's weight (1, 4 -> 2, 1)
    per_token = -advantages * torch.tensor([[1.0], [2.0], [1.0]])
    expected = agg_loss(per_token, MASK, args.loss_agg_mode)
    assert loss.item() == pytest.approx(expected.item(), rel=1e-6)


@pytest.mark.parametrize(
    "flags, message",
    [
        (dict(rollout_rs="token_k9"), "--rollout-rs: unknown criterion 'token_k9'"),
        (dict(rollout_rs="token_k1,seq_mean_k3", rollout_rs_threshold="0.5_2"), "1 thresholds for the 2 criteria"),
        (dict(rollout_rs="token_k1", rollout_rs_threshold="2"), "a k1 criterion bounds the ratio"),
        (dict(rollout_rs="token_k1", rollout_rs_threshold="1.5_2"), "0 < lower <= 1 <= upper"),
        (dict(rollout_rs="seq_sum_k3", rollout_rs_threshold="0.1_0.2"), "a k2 or k3 criterion takes one bound above 0"),
        (dict(rollout_rs="token_k2"), "a k2 or k3 criterion takes one bound above 0"),
        (dict(rollout_rs="seq_max_k2", rollout_rs_threshold="x"), "takes one bound above 0"),
        (dict(tis=True, rollout_is="sequence"), "--tis is short for --rollout-is token"),
        (dict(rollout_is_threshold=0.0), "--rollout-is-threshold 0.0"),
    ],
)
def test_bad_flags_are_clear_errors(flags, message):
    with pytest.raises(ValueError, match=message):
        check_rollout_correction(RunArgs(**flags))


BAD_THRESHOLDS = ["--model-path", "no-model", "--train-files", "no-file.parquet", "--n", "4", "--rollout-rs", "seq_mean_k3",
                  "--rollout-rs-threshold", "0.1,0.2"]
BAD_THRESHOLDS_MESSAGE = "2 thresholds for the 1 criteria of --rollout-rs 'seq_mean_k3'"


@pytest.mark.parametrize("script", RL_SCRIPTS)
def test_each_script_checks_the_flags_before_any_worker_starts(script, tmp_path, monkeypatch):
    assert BAD_THRESHOLDS_MESSAGE in stop_in_process(f"{script}.py", *BAD_THRESHOLDS, cwd=tmp_path, monkeypatch=monkeypatch)


def test_the_command_line_stops_on_the_flags(tmp_path):
    result = run_script("grpo_hybrid.py", *BAD_THRESHOLDS, cwd=tmp_path)
    assert result.returncode != 0 and BAD_THRESHOLDS_MESSAGE in result.stderr
    assert "Started a local Ray instance" not in result.stderr + result.stdout


def test_the_tis_flags_are_short_names():
    assert rollout_is_level(RunArgs(tis=True)) == "token"
    assert rollout_is_level(RunArgs()) == "none"
    assert rollout_is_level(RunArgs(max_staleness=2)) == "token"  # the decoupled objective's weight
    assert rollout_is_level(RunArgs(max_staleness=2, rollout_is="none")) == "none"


def test_the_old_log_prob_pass_runs_when_the_step_reads_it():
    one_step = dict(train_batch_size=8, mini_batch_size=8)
    assert not needs_old_log_prob_pass(RunArgs(**one_step))
    assert needs_old_log_prob_pass(RunArgs(**one_step), reward_reads_it=True)  # a KL to the reference in the reward
    assert needs_old_log_prob_pass(RunArgs(train_batch_size=8, mini_batch_size=4))
    assert needs_old_log_prob_pass(RunArgs(**one_step, ppo_epochs=2))
    assert needs_old_log_prob_pass(RunArgs(**one_step, rollout_rs="icepop"))  # rejection precedes the update's counts


def test_the_steps_diagnostics_are_the_same_with_or_without_the_pass():
    """rollout_diagnostics reads the pass's log-probs from the batch, or the terms that the update measured instead
    (update_terms, the shares of two micro-batches added up as the worker does); rejection_mask rejects from the pass's."""
    from common.dataproto import DataProto
    from common.rollout_correction import rejection_mask, rollout_diagnostics, update_figures, update_terms

    args = RunArgs(rollout_is="token", max_rollout_logprob_diff=0.0)  # the gaps here are the test's, not a stale engine
    staleness = torch.zeros(3, dtype=torch.long)
    passed = DataProto.from_dict(
        {"response_mask": MASK, "old_log_probs": OLD, "rollout_log_probs": ROLLOUT, "staleness": staleness}
    )
    assert rejection_mask(passed, args) is passed["response_mask"]
    rejecting = RunArgs(rollout_rs="token_k1", rollout_rs_threshold="0.6_1.9")
    expected = rollout_rejection(log_ratio(), MASK, criteria("token_k1", "0.6_1.9"))
    assert rejection_mask(passed, rejecting).tolist() == expected.tolist()
    from_pass = rollout_diagnostics(passed, MASK, {"pg_loss": 1.0}, args)
    update = {}
    for rows in (slice(0, 1), slice(1, 3)):
        micro_batch = DataProto.from_dict({"response_mask": MASK[rows], "rollout_log_probs": ROLLOUT[rows]})
        entropy = torch.zeros_like(MASK[rows])
        for key, value in update_terms(micro_batch, OLD[rows], entropy, MASK.sum(), 3, args).items():
            accumulate(update, key, float(value))
    assert update_terms(passed, OLD, torch.zeros_like(MASK), MASK.sum(), 3, args) == {}  # the driver measures them
    skipped = passed.select("response_mask", "rollout_log_probs", "staleness")
    from_update = rollout_diagnostics(skipped, MASK, update, args)
    assert from_update == pytest.approx(from_pass, rel=1e-5)
    assert rollout_diagnostics(skipped, MASK, update, args) == from_update  # read, not taken out: the same twice
    assert update_figures(update, "actor/") == {"actor/entropy": update["entropy"]}  # the terms are the diagnostics'
