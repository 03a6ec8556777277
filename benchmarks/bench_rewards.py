"""Reward throughput: the reward processes against calling the reward in the driver, one response after another.

Two rewards, each on the same responses:
- `math`: the built-in math-verify reward on long worked answers (CPU-bound: parsing LaTeX), and
- `remote`: a reward that waits `--remote-latency` seconds per response, as a call to a verifier service or a
  code sandbox does (bound by waiting, not by the CPU).

For each it prints responses per second in the driver's process (`--reward-workers 0`, the scoring before the
reward processes existed) and with each number of processes in `--workers`, and the speed-up.

    python benchmarks/bench_rewards.py
    python benchmarks/bench_rewards.py --responses 1024 --workers 1 2 4 8 16
"""

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.isolation import CallProcesses, InProcessCalls  # noqa: E402
from common.rewards import REWARD_CALLS, load_reward_fn  # noqa: E402


def long_answer(rng: random.Random) -> tuple[str, str]:
    """A worked answer of about 7,000 characters (some 2,000 tokens), 48 equations, ending in a boxed fraction; and
    its truth."""
    steps = []
    for _ in range(48):
        a, b, c = rng.randint(2, 99), rng.randint(2, 99), rng.randint(2, 9)
        steps.append(
            f"Next we substitute $x = {a}$ into $f(x) = \\frac{{x^2 + {b}}}{{{c}}}$, which gives "
            f"$f({a}) = \\frac{{{a * a + b}}}{{{c}}}$, and we keep this value for the sum below. "
        )
    p, q = rng.randint(1, 50), rng.randint(51, 99)
    right = rng.random() < 0.5
    answer = f"\\frac{{{p}}}{{{q}}}" if right else f"\\frac{{{p + 1}}}{{{q}}}"
    return "".join(steps) + f"Therefore the answer is $\\boxed{{{answer}}}$.", f"\\frac{{{p}}}{{{q}}}"


def throughput(rewards, samples: list[tuple]) -> float:
    rewards(samples)  # every process has started and imported what the reward imports
    started = time.perf_counter()
    outcomes = rewards(samples)
    elapsed = time.perf_counter() - started
    failed = sum(outcome[0] != "ok" for outcome in outcomes)
    if failed:
        raise RuntimeError(f"{failed} of {len(samples)} calls failed or timed out: {outcomes[0]}")
    return len(samples) / elapsed


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--responses", type=int, default=256, help="responses scored per measurement")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2, 8], help="reward processes to measure")
    parser.add_argument("--remote-latency", type=float, default=0.05, help="seconds the `remote` reward waits")
    args = parser.parse_args()
    if args.responses < 1 or min(args.workers) < 1 or args.remote_latency < 0:
        parser.error("--responses and --workers must be at least 1, --remote-latency at least 0")

    rng = random.Random(0)
    answers = [long_answer(rng) for _ in range(args.responses)]
    folder = tempfile.mkdtemp()
    remote = Path(folder, "remote.py")
    remote.write_text(
        "import time\n"
        "def score(data_source, solution_str, ground_truth, extra_info):\n"
        f"    time.sleep({args.remote_latency})\n"
        "    return 1.0\n"
    )
    rewards = {"math": None, "remote": f"{remote}:score"}
    print(f"{args.responses} responses of {sum(len(a) for a, _ in answers) // len(answers)} characters on average")
    print(f"{'reward':<8} {'processes':>10} {'responses/s':>12} {'speed-up':>9}")
    for name, spec in rewards.items():
        source = "math" if spec is None else "remote"
        samples = [(source, text, truth, {}) for text, truth in answers]
        baseline = throughput(InProcessCalls(load_reward_fn(spec), spec, REWARD_CALLS, timeout=10), samples)
        print(f"{name:<8} {'0 (driver)':>10} {baseline:>12.1f} {1.0:>8.2f}x")
        for workers in args.workers:
            pool = CallProcesses(spec, workers, REWARD_CALLS, timeout=10)
            try:
                rate = throughput(pool, samples)
            finally:
                pool.close()
            print(f"{name:<8} {workers:>10} {rate:>12.1f} {rate / baseline:>8.2f}x")
