"""The off-policy correction's options on the real model: which of them changes the outcome when the engine differs.

Runs algos/grpo_hybrid.py on SmolLM2-135M-Instruct's times tables (`--model-path smollm2`, its demo settings),
asynchronous: 1 policy worker training in fp32 and 1 rollout worker whose vllm engine generates in bf16, with
--max-staleness 4, so that samples come from an engine that differs twice over, in numbers and in weights. The
engine's gap bound is lifted (--max-rollout-logprob-diff 0): a bf16 engine is expected to differ. Each setting:

- `none`: no importance weight (the decoupled objective's clipping around the proximal policy only);
- `token-is`: the token-level truncated weight (the default of asynchronous steps);
- `sequence-is`: the sequence's product of ratios, truncated;
- `token-is+seq-mean-k3`: the token weight, and sequences whose mean k3 exceeds --k3-threshold rejected;
- `icepop`: token weights up to 5, tokens whose ratio leaves [0.5, 5] rejected.

Prints per run the held-out accuracy after the last step and the range over the steps of the diagnostics
(docs/off-policy-correction.md); --out writes every step's diagnostics and staleness as JSON, --plot draws the
mismatch KL (k3) and the effective sample size over the steps, from the runs or (--records) from JSONs that --out
wrote, a row of the picture per --max-staleness.

    python benchmarks/bench_rollout_correction.py                            # every setting, seeds 1 to 3
    python benchmarks/bench_rollout_correction.py --settings none icepop --seeds 1 --out correction.json
    python benchmarks/bench_rollout_correction.py --max-staleness 16 --settings none token-is --out k16.json
    python benchmarks/bench_rollout_correction.py --records correction.json k16.json --plot correction.png
"""

import argparse
import json
import subprocess
import sys
import tempfile
from operator import itemgetter
from pathlib import Path

from plot_runs import require_matplotlib

ROOT = Path(__file__).resolve().parents[1]


def settings(k3_threshold: float) -> dict[str, list[str]]:
    return {
        "none": ["--rollout-is", "none"],
        "token-is": ["--rollout-is", "token"],
        "sequence-is": ["--rollout-is", "sequence"],
        "token-is+seq-mean-k3": [
            "--rollout-is",
            "token",
            "--rollout-rs",
            "seq_mean_k3",
            "--rollout-rs-threshold",
            str(k3_threshold),
        ],
        "icepop": ["--rollout-is", "token", "--rollout-is-threshold", "5", "--rollout-rs", "icepop"],
    }


DIAGNOSTICS = ["kl_k3", "chi2_centered_seq", "ess", "weight_max", "rejected_token_share", "emptied_seq_share"]
KEPT = ("rollout_corr/", "rollout/staleness")  # every step's diagnostics, and how old its samples were


def run(flags: list[str], seed: int, steps: int, staleness: int) -> list[dict]:
    with tempfile.TemporaryDirectory() as folder:
        command = [
            *"--model-path smollm2 --rollout-engine vllm --rollout-dtype bfloat16 --compute-dtype float32".split(),
            *f"--num-workers 1 --rollout-workers 1 --max-staleness {staleness} --max-rollout-logprob-diff 0".split(),
            *f"--total-steps {steps} --test-freq {steps} --no-val-before-train --seed {seed}".split(),
            *flags,
        ]
        result = subprocess.run(
            [sys.executable, str(ROOT / "algos" / "grpo_hybrid.py"), *command], cwd=folder, capture_output=True, text=True
        )
        if result.returncode:
            sys.exit(f"{' '.join(flags)}, seed {seed} failed:\n{result.stderr[-3000:]}")
        [metrics] = Path(folder).glob("runs/*/metrics.jsonl")
        return [json.loads(line) for line in metrics.read_text().splitlines()]


def plot(records: list[dict], out: Path) -> None:
    """The mismatch KL (k3) and the effective sample size of each run against the step, a row per --max-staleness."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    import matplotlib.pyplot as plt

    stalenesses = sorted({record["max_staleness"] for record in records})
    kind = itemgetter("setting", "max_staleness")
    figure, axes = plt.subplots(len(stalenesses), 2, figsize=(12, 4 * len(stalenesses)), squeeze=False)
    colours = {}
    for record in records:
        row = axes[stalenesses.index(record["max_staleness"])]
        colour = colours.setdefault(record["setting"], f"C{len(colours)}")
        same = [other for other in records if kind(other) == kind(record)]
        label = f"{record['setting']}: " + ", ".join(f"{other['accuracy']:.0%}" for other in same)
        steps = range(1, len(record["steps"]) + 1)
        for ax, name in zip(row, ("kl_k3", "ess")):
            values = [step[f"rollout_corr/{name}"] for step in record["steps"]]
            ax.plot(steps, values, color=colour, label=label if record is same[0] else None)
    for staleness, row in zip(stalenesses, axes):
        row[0].set(xlabel="step", ylabel="KL(rollout || trainer), k3 estimator", yscale="log")
        row[1].set(xlabel="step", ylabel="effective sample size (1: every weight equal)")
        row[0].set_title(f"--max-staleness {staleness}")
        row[0].legend(title="setting: held-out accuracy of each seed", fontsize="small")
    figure.tight_layout()
    figure.savefig(out, dpi=100)
    print(f"drew {len(records)} runs into {out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--max-staleness", type=int, default=4)
    parser.add_argument("--k3-threshold", type=float, default=0.01, help="the mean k3 above which a sequence is rejected")
    parser.add_argument("--settings", nargs="+", default=None, help="some of: none token-is sequence-is ...")
    parser.add_argument("--out", type=Path, help="every step's diagnostics, as JSON")
    parser.add_argument("--plot", type=Path, help="a picture of the mismatch KL and the ESS over the steps")
    parser.add_argument("--records", type=Path, nargs="+", help="draw --plot from these --out JSONs instead of running")
    options = parser.parse_args()
    if options.plot:
        require_matplotlib()
    if options.records:
        if not options.plot:
            parser.error("--records draws a picture: pass --plot too")
        plot([record for path in options.records for record in json.loads(path.read_text())], options.plot)
        return
    menu = settings(options.k3_threshold)
    chosen = options.settings or list(menu)
    unknown = sorted(set(chosen) - set(menu))
    if unknown:
        parser.error(f"--settings: unknown {', '.join(unknown)}; choose from {', '.join(menu)}")
    print(
        f"GRPO, SmolLM2-135M-Instruct, times tables, {options.steps} steps, vllm bf16 engine against the fp32 trainer, "
        f"--max-staleness {options.max_staleness}; diagnostics as min-max over the steps"
    )
    print("| setting | seed | held-out accuracy | " + " | ".join(DIAGNOSTICS) + " |")
    print("|---|---|---|" + "---|" * len(DIAGNOSTICS))
    records = []
    for setting in chosen:
        for seed in options.seeds:
            rows = [row for row in run(menu[setting], seed, options.steps, options.max_staleness) if row["step"] > 0]
            ranges = []
            for name in DIAGNOSTICS:
                values = [row[f"rollout_corr/{name}"] for row in rows]
                ranges.append(f"{min(values):.3g}-{max(values):.3g}")
            print(f"| {setting} | {seed} | {rows[-1]['val/accuracy']:.1%} | " + " | ".join(ranges) + " |", flush=True)
            steps = [{key: value for key, value in row.items() if key.startswith(KEPT)} for row in rows]
            accuracy = rows[-1]["val/accuracy"]
            records.append(
                dict(setting=setting, seed=seed, max_staleness=options.max_staleness, accuracy=accuracy, steps=steps)
            )
    if options.out:
        options.out.write_text(json.dumps(records, indent=1))
    if options.plot:
        plot(records, options.plot)


if __name__ == "__main__":
    main()
