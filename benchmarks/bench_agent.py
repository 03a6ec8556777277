"""An agent program against the same task through --tools: SmolLM2-135M-Instruct after the multiply tool's warm start,
trained with GRPO either way, on both engines, seeds 1-3; and what the endpoint costs at 1, 8 and 32 sessions at once.

The task is benchmarks/bench_tool_learning.py's (the demo's `multiply_tool` prompts, the `multiply` tool, its GRPO
settings and its 2-step warm start, one per seed). Each seed's warm start then trains twice per engine:

- `--tools multiply`: this project's loop of turns calls the tool;
- `--agent examples/agents/multiply_agent.py:solve`: the agent's own loop with the `openai` client calls it, and the
  run sees its chat completions alone (docs/agents.md).

Printed and written (--out, a markdown table and its JSON beside it): held-out accuracy before GRPO and after it, and
GRPO's mean seconds per step (its first step left out); then, for the endpoint's cost, seed 1's warm start on the hf
engine at 1, 8 and 32 sessions a step (1 x 1 with --single-sample-groups, 2 x 4, 8 x 4), on one worker: seconds per
step and the share of the play's time the engine stood idle (`env/engine_idle_share`), --agent beside --tools.

    python benchmarks/bench_agent.py                                  # seeds 1-3, hf and vllm
    python benchmarks/bench_agent.py --seeds 1 --engines hf --grpo-steps 2 --work /tmp/agent_bench   # resumable
"""

import argparse
import json
import sys
from pathlib import Path

import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_tool_learning import accuracies, grpo_flags, run_script  # noqa: E402
from demo_table import stamp, write_table  # noqa: E402

AGENT = ["--agent", str(ROOT / "examples" / "agents" / "multiply_agent.py") + ":solve", "--max-turns", "3"]
MODES = {"--tools": [], "--agent": AGENT}  # the tools' flags come with grpo_flags(tool=True)
PATIENT = ["--call-timeout", "300"]  # a step's 32 episodes in one generate may pass 60 s on a loaded 2-core machine
SESSIONS = {1: (1, 1), 8: (2, 4), 32: (8, 4)}  # sessions a step: (prompts, samples of each)


def finished(folder: Path, script: str, flags: list[str]) -> list[dict]:
    """The metrics of `script`'s run in `folder`, run now unless a run there finished already (--work resumes)."""
    runs = folder / "runs"
    if runs.is_dir():
        [run_dir] = runs.iterdir()
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        if (run_dir / "model").is_dir() or script == "grpo_hybrid.py" and any("val/accuracy" in r for r in rows[1:]):
            return rows
        for path in sorted(runs.rglob("*"), reverse=True):  # an unfinished run: started again
            path.unlink() if path.is_file() else path.rmdir()
        runs.rmdir()
    folder.mkdir(parents=True, exist_ok=True)
    return run_script(script, flags, folder)[0]


def mode_flags(mode: str, tool_flags: list[str]) -> list[str]:
    if mode == "--tools":
        return tool_flags
    without_tools = tool_flags[tool_flags.index("--max-turns") + 2 :]  # grpo_flags puts --tools and --max-turns first
    return [*MODES[mode], "--chat-template", "chatml_tools", *without_tools]


def step_seconds(rows: list[dict]) -> float:
    steps = [row["timing/step"] for row in rows if "timing/step" in row]
    return sum(steps[1:]) / max(1, len(steps) - 1)


def mean_of(rows: list[dict], key: str) -> float:
    values = [row[key] for row in rows if key in row]
    return sum(values) / max(1, len(values))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--engines", nargs="+", default=["hf", "vllm"], choices=["hf", "vllm"])
    parser.add_argument("--sft-steps", type=int, default=2, help="warm start steps (16 transcripts each)")
    parser.add_argument("--grpo-steps", type=int, default=4)
    parser.add_argument("--cost-steps", type=int, default=3, help="steps of each run that measures the endpoint's cost")
    parser.add_argument("--sessions", type=int, nargs="*", default=[1, 8, 32], choices=sorted(SESSIONS))
    parser.add_argument("--val-problems", type=int, default=32, help="held-out problems each validation answers")
    parser.add_argument("--work", default=None, help="the runs' folder: a run finished there is not run again")
    parser.add_argument("--out", default="bench_agent.md", help="the table; its JSON goes beside it (.json)")
    args = parser.parse_args()

    sys.path.insert(0, str(ROOT))
    from common import demo

    cpu, commit, date = stamp()
    work = Path(args.work or f"/tmp/bench_agent_{commit}")
    work.mkdir(parents=True, exist_ok=True)
    _, train_file, val_file = demo.prepare("multiply_tool")
    val_subset = work / "val.parquet"
    pq.write_table(pq.read_table(val_file).slice(0, args.val_problems), val_subset)
    data = ["--train-files", train_file, "--val-files", str(val_subset)]

    exports, results = {}, []
    for seed in args.seeds:
        sft_flags = ["--model-path", "smollm2", "--seed", str(seed), "--total-steps", str(args.sft_steps)]
        finished(work / f"sft_{seed}", "sft_hybrid.py", [*sft_flags, "--no-val-before-train"])
        [sft_run] = (work / f"sft_{seed}" / "runs").iterdir()
        exports[seed] = ["--model-path", str(sft_run / "model")]
        for engine in args.engines:
            for mode in MODES:
                flags = [*exports[seed], "--seed", str(seed), "--rollout-engine", engine, *data, *PATIENT]
                flags += mode_flags(mode, grpo_flags(args.grpo_steps))
                rows = finished(work / f"{engine}_{mode[2:]}_{seed}", "grpo_hybrid.py", flags)
                first, *_, last = accuracies(rows)
                result = dict(seed=seed, engine=engine, mode=mode, warm_start=first, grpo=last)
                result |= dict(step_seconds=step_seconds(rows), tool_call_share=mean_of(rows, "val/env/tool_call_share"))
                results.append(result)
                print(json.dumps(result), flush=True)

    costs = []
    for sessions in args.sessions:
        prompts, samples = SESSIONS[sessions]
        shape = ["--train-batch-size", str(prompts), "--mini-batch-size", str(prompts), "--n", str(samples)]
        shape += ["--single-sample-groups"] if samples == 1 else []
        shape += ["--num-workers", "1"]  # one engine serves every session (a session is not split over workers)
        for mode in MODES:
            flags = [*exports[args.seeds[0]], "--seed", str(args.seeds[0]), *data, "--no-val-before-train", *PATIENT]
            flags += [*mode_flags(mode, grpo_flags(args.cost_steps)), *shape, "--test-freq", "1000"]
            rows = finished(work / f"cost_{mode[2:]}_{sessions}", "grpo_hybrid.py", flags)
            cost = dict(sessions=sessions, mode=mode, step_seconds=step_seconds(rows))
            cost["idle"] = mean_of(rows, "env/engine_idle_share")
            costs.append(cost)
            print(json.dumps(cost), flush=True)

    lines = [
        f"{cpu}; at {commit} on {date}; {args.val_problems} held-out problems, greedy; GRPO {args.grpo_steps} steps of "
        "8 prompts x 4 samples from a 2-step warm start (one per seed)",
        "",
        "| engine | seed | held-out accuracy: warm start | after GRPO, `--tools` | after GRPO, `--agent` "
        "| seconds per step, `--tools` | seconds per step, `--agent` |",
        "|---|---|---|---|---|---|---|",
    ]
    by = {(r["engine"], r["seed"], r["mode"]): r for r in results}
    for engine in args.engines:
        for seed in args.seeds:
            tools, agent = by[(engine, seed, "--tools")], by[(engine, seed, "--agent")]
            lines.append(
                f"| {engine} | {seed} | {tools['warm_start']:.1%} | {tools['grpo']:.1%} | {agent['grpo']:.1%} "
                f"| {tools['step_seconds']:.1f} | {agent['step_seconds']:.1f} |"
            )
    if costs:
        lines += [
            "",
            "| sessions a step | seconds per step, `--tools` | `--agent` | engine idle, `--tools` | `--agent` |",
            "|---|---|---|---|---|",
        ]
        cost_by = {(c["sessions"], c["mode"]): c for c in costs}
        for sessions in args.sessions:
            tools, agent = cost_by[(sessions, "--tools")], cost_by[(sessions, "--agent")]
            lines.append(
                f"| {sessions} | {tools['step_seconds']:.1f} | {agent['step_seconds']:.1f} "
                f"| {tools['idle']:.0%} | {agent['idle']:.0%} |"
            )
    write_table(lines, args.out, dict(cpu=cpu, commit=commit, date=date, settings=vars(args), runs=results, costs=costs))
    print(f"the runs: {work}")
