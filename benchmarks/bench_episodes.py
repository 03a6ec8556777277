"""Multi-turn rollouts on the real model, each episode on its own with its environment alive in the environment
processes: seconds per rollout, the engine's idle share and the context it computes again, with a tool that answers at
once and one that takes 0-2 s; and whether a rollout played twice with one seed repeats, as the episodes play by
default and in rounds (--deterministic), with a tool whose 0-2 s differ at every call.

The policy: SmolLM2-135M-Instruct after the demo's warm start with the multiply tool (`sft_hybrid.py --model-path
smollm2`, its defaults; built once and kept under $HYBRIDRL_CACHE/episodes-policy-v1, default ~/.cache/hybridrl), so
that its episodes call the tool. A rollout: 32 episodes (8 of the demo's RL prompts x 4 samples), up to --max-turns 3
model turns each, the demo's chatml_tools template and lengths (320 prompt tokens, 96 for the whole episode), sampled
at temperature 1, played by `common.episodes.run_episodes` (each episode goes on as soon as its own call answers). The
policy worker group is built as the training scripts build it (common/run.py: Run), on one CPU worker in bf16, once
per engine (hf, then vllm), and serves every setting:

- the tool: the built-in `multiply`, which answers at once, or benchmarks/episode_tools.py's, the same tool answering
  after a random 0-2 s (drawn from the call's arguments: the same call waits as long in every setting), or
  benchmarks/episode_tools_at_random.py's, waiting 0-2 s drawn anew at every call; each in environment processes of
  its own (common/env_processes.py: EnvProcesses), built once per engine. As many processes as a run starts by default
  (common/run.py: one per CPU core, at most 16; --env-workers), not one per episode: each holds the live objects of many
  episodes, each on a thread of its own, so the calls that sleep wait side by side.
- the play: as a run plays by default, each episode's turn starting as soon as its call answered, or in rounds as
  with --deterministic (run_episodes' lockstep: an engine takes every waiting turn at once when none of its episodes
  is generating or calling its tool), with the tool whose waits differ at every call.

Each setting plays one warm-up rollout, then --rollouts rollouts, the same prompts for every setting (rollout k draws
the run's k-th batch), each played twice with the same seed (the seed of a run's k-th play): `repeats` counts the
rollouts whose two plays gave the same tokens and log-probs, bit for bit. Per setting, the means over those plays of:
seconds per rollout; the engine's idle share, 1 - the seconds its engine generated (the worker's `engine_work()` after
the rollout less before it) / the rollout's wall time; the tokens prefilled again per model turn: the context tokens the
engine computed (`engine_work()`'s prefilled tokens: not taken from a cache) less the tokens no engine had seen before (each
distinct prompt's once, each environment answer's, and per turn after the first the last token sampled before it,
which the engine never ran), divided by the model turns; model turns and tool calls per episode. A rollout's seconds
vary with its samples (on the hf engine, a generate lasts as long as its longest response), so the table gives the
fastest and the slowest beside the mean. Printed and written (--out, a markdown table and its JSON beside it, which
keeps every rollout's figures). The loop that played a batch turn by turn (commit f3c0107), which this benchmark
compared until the environments became live objects, called them by a protocol that is gone; its figures are in
docs/changelog.md (2026-11-28).

    python benchmarks/bench_episodes.py                               # hf and vllm, 4 rollouts per setting
    python benchmarks/bench_episodes.py --engines hf --rollouts 1 --prompts 2
"""

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT))
from demo_table import stamp, write_table  # noqa: E402

POLICY_CACHE = "episodes-policy-v1"  # the warm start's export, under the demo's cache
TOOLS = {
    "instant": "multiply",
    "0-2 s": f"{ROOT / 'benchmarks' / 'episode_tools.py'}:multiply",
    "0-2 s anew": f"{ROOT / 'benchmarks' / 'episode_tools_at_random.py'}:multiply",
}
SETTINGS = [("instant", "default"), ("0-2 s", "default"), ("0-2 s anew", "default"), ("0-2 s anew", "rounds")]  # tool, play
SAMPLING = dict(do_sample=True, top_p=1.0, top_k=0)


def warm_started_policy() -> str:
    """The folder of SmolLM2 after `sft_hybrid.py --model-path smollm2` (its export), built at the first use."""
    from common.pretrained import cache_root

    ready = cache_root() / POLICY_CACHE
    if not ready.exists():
        cache_root().mkdir(parents=True, exist_ok=True)
        scratch = Path(tempfile.mkdtemp(dir=cache_root()))  # renamed when whole, so a crash never leaves half a model
        command = [sys.executable, str(ROOT / "algos" / "sft_hybrid.py"), "--model-path", "smollm2"]
        print(f"building the warm-started policy once: {shlex.join(command)}", flush=True)
        started = time.perf_counter()
        env = os.environ | {"PYTHONPATH": str(ROOT)}
        result = subprocess.run(command, cwd=scratch, env=env, capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"the warm start failed (its folder: {scratch}):\n{result.stderr[-3000:]}")
        [run_dir] = (scratch / "runs").iterdir()
        os.rename(run_dir / "model", ready)
        shutil.rmtree(scratch, ignore_errors=True)
        print(f"warm start: {time.perf_counter() - started:.0f} s, kept in {ready}", flush=True)
    return str(ready)


def env_processes() -> int:
    """The environment processes a run starts by default (common/run.py): one per CPU core, at most 16."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()  # not on macOS
    return min(cores, 16)


def wait_until_loaded(pool) -> None:
    """Every process of `pool` (EnvProcesses) done loading the tool, so that none still loads while a rollout is timed:
    an episode without an environment object (--tools alone) opened on each (an open goes to the least busy process),
    answered once its process is ready, then finished."""
    keys = [f"loading/{slot}" for slot in range(len(pool.processes))]
    for request in [("open", "", {}), ("finish", False)]:
        tickets = {pool.submit(key, request) for key in keys}
        while tickets:
            outcomes = pool.collect()
            for outcome in outcomes.values():
                if outcome[0] != "ok":
                    raise RuntimeError(f"an environment process failed to load the tool: {outcome}")
            tickets -= outcomes.keys()


def rollout(policy, play, batch, seed: int) -> tuple[dict, object]:
    """One rollout of `batch`'s episodes by `play(policy, batch, seed)`: its seconds, the engine's (rank 0's) work, and
    what it played; and the played batch."""
    [before] = policy.broadcast("engine_work")
    started = time.perf_counter()
    out = play(policy, batch, seed)
    seconds = time.perf_counter() - started
    [after] = policy.broadcast("engine_work")
    work = {key: after[key] - before[key] for key in ("seconds", "prefilled_tokens")}
    prompts = {tuple(p[m.bool()].tolist()) for p, m in zip(batch["prompts"], batch["prompt_mask"])}
    episode_tokens = out["attention_mask"][:, batch["prompts"].shape[1] :].sum()  # the model's and the environment's
    turns = sum(out["turns"])
    # what no engine had seen: the distinct prompts, the environment's answers, each later turn's last sampled token
    unseen = sum(map(len, prompts)) + int(episode_tokens - out["response_mask"].sum()) + turns - len(out)
    return dict(
        seconds=seconds,
        engine_seconds=work["seconds"],
        prefilled_tokens=work["prefilled_tokens"],
        unseen_tokens=unseen,
        episodes=len(out),
        turns=turns,
        tool_calls=sum(out["tool_calls"]),
        model_tokens=int(out["response_mask"].sum()),
        # what the loop reports of itself, beside the figures above
        loop_idle_share=out["engine_idle_share"][0],
        loop_computed_again=sum(out["computed_again"]),
    ), out


def same_play(first, second) -> bool:
    """Whether two plays of a batch gave the same tokens, masks and log-probs, bit for bit."""
    import torch

    keys = ("responses", "response_mask", "rollout_log_probs")
    return all(first[key].shape == second[key].shape and torch.equal(first[key], second[key]) for key in keys)


def summary(rollouts: list[dict]) -> dict:
    mean = lambda key: sum(r[key] for r in rollouts) / len(rollouts)  # noqa: E731
    episodes, turns = mean("episodes"), mean("turns")
    return dict(
        repeats=sum(r["repeated"] for r in rollouts[::2]),
        seconds=mean("seconds"),
        seconds_range=(min(r["seconds"] for r in rollouts), max(r["seconds"] for r in rollouts)),
        idle_share=sum(1 - r["engine_seconds"] / r["seconds"] for r in rollouts) / len(rollouts),
        prefilled_again_per_turn=(mean("prefilled_tokens") - mean("unseen_tokens")) / turns,
        turns_per_episode=turns / episodes,
        tool_calls_per_episode=mean("tool_calls") / episodes,
    )


def measure(engine: str, args, model_path: str, train_file: str, work: Path) -> list[dict]:
    """Every setting on `engine`, its worker group, environment processes and prompts built once for all of them."""
    from common.env_processes import EnvProcesses
    from common.envs import episode_spec, load_environments
    from common.episode_play import EpisodeLimits, seed_of
    from common.episodes import run_episodes
    from common.run import Run, RunArgs

    lengths = dict(max_prompt_length=320, max_response_length=96)  # the demo's (common/demo.py: WARM_START_DEFAULTS)
    run_args = RunArgs(
        model_path=model_path,
        train_files=[train_file],
        runs_dir=str(work / "runs"),
        tools=[TOOLS["instant"]],  # renders the prompts; both tools have its schema
        chat_template="chatml_tools",
        max_turns=args.max_turns,
        num_workers=1,
        rollout_engine=engine,
        compute_dtype="bfloat16",
        train_batch_size=args.prompts,
        mini_batch_size=args.prompts,
        n=args.samples,
        reward_workers=1,  # the run's own reward and environment processes, unused here
        seed=args.seed,
        **lengths,
    )
    screen = sys.stdout, sys.stderr  # a Run sends this process's output to its folder too, until it is torn down
    run = Run(run_args)
    policy = run.policy()
    try:
        batches = [run.rollouts.next_prompts().repeat(args.samples, interleave=True) for _ in range(1 + args.rollouts)]
        environments = {tool: load_environments(episode_spec(None, [spec])) for tool, spec in TOOLS.items()}
        if len({json.dumps(e.schemas(""), sort_keys=True) for e in environments.values()}) != 1:
            raise RuntimeError("benchmarks/episode_tools.py's multiply has another schema than the built-in's")
        limits = EpisodeLimits(args.max_turns, lengths["max_prompt_length"], lengths["max_response_length"])
        results = []
        for tool, mode in SETTINGS:
            envs = environments[tool]
            pool = EnvProcesses(envs.spec, args.env_workers or env_processes(), run_args.reward_timeout)  # one at a time
            try:
                wait_until_loaded(pool)
                play = lambda group, batch, seed: run_episodes(  # noqa: B023, E731
                    group, batch, pool, envs, run.tokenizer, run.eos_token_ids, limits, SAMPLING, seed=seed,
                    lockstep=mode == "rounds",
                )
                started = time.perf_counter()
                rollout(policy, play, batches[0], seed_of(args.seed, 0))  # warm-up
                rollouts = []
                for k, batch in enumerate(batches[1:], start=1):
                    seed = seed_of(args.seed, k)
                    (first, first_out), (second, second_out) = (rollout(policy, play, batch, seed) for _ in "ab")
                    rollouts += [first | dict(repeated=same_play(first_out, second_out)), second]
                results.append(dict(engine=engine, tool=tool, play=mode, **summary(rollouts), rollouts=rollouts))
                print(
                    f"{engine}, {tool} tool, {mode}: {results[-1]['seconds']:.1f} s per rollout, repeated "
                    f"{results[-1]['repeats']} of {args.rollouts} ({time.perf_counter() - started:.0f} s with the warm-up)",
                    flush=True,
                )
            finally:
                pool.close()
        return results
    finally:
        run.tracker.close()
        run.scorer.close()
        run.rollouts.close()
        policy.shutdown()
        run.pool.shutdown()
        sys.stdout, sys.stderr = screen


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", nargs="+", default=["hf", "vllm"], choices=["hf", "vllm"])
    parser.add_argument("--rollouts", type=int, default=4, help="measured rollouts per setting, after one warm-up")
    parser.add_argument("--prompts", type=int, default=8, help="prompts per rollout")
    parser.add_argument("--samples", type=int, default=4, help="episodes per prompt")
    parser.add_argument("--max-turns", type=int, default=3)
    parser.add_argument(
        "--env-workers", type=int, help="environment processes per tool (default: a run's, one per CPU core, at most 16)"
    )
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--out", default="bench_episodes.md", help="the table; its JSON goes beside it (.json)")
    args = parser.parse_args()
    if min(args.rollouts, args.prompts, args.samples, args.max_turns, args.env_workers or 1) < 1:
        parser.error("--rollouts, --prompts, --samples, --max-turns and --env-workers count from 1")

    from common import demo
    from common.engine_registry import check_rollout
    from common.engines import EngineSettings

    for engine in args.engines:  # vLLM installed, before the hf engine's settings are measured
        check_rollout(EngineSettings(name=engine))

    cpu, commit, date = stamp()
    model_path = warm_started_policy()
    _, train_file, _ = demo.prepare("multiply_tool")
    work = Path(tempfile.mkdtemp(prefix="bench_episodes_"))
    results = []
    for engine in args.engines:
        results += measure(engine, args, model_path, train_file, work)

    command = shlex.join(["python", "benchmarks/bench_episodes.py", *sys.argv[1:]])
    lines = [
        f"`{command}` at {commit}, {date}; {cpu}; {args.prompts * args.samples} episodes a rollout ({args.prompts} prompts "
        f"x {args.samples}), up to {args.max_turns} model turns, {args.env_workers or env_processes()} environment processes; "
        f"means over {args.rollouts} rollouts after a warm-up",
        "",
        "| engine | tool | play | seconds per rollout (fastest-slowest) | engine idle | prefilled again per model turn "
        "| model turns per episode | tool calls per episode | played twice, the same |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        low, high = r["seconds_range"]
        lines.append(
            f"| {r['engine']} | {r['tool']} | {r['play']} | {r['seconds']:.1f} ({low:.1f}-{high:.1f}) | {r['idle_share']:.0%} "
            f"| {r['prefilled_again_per_turn']:.0f} | {r['turns_per_episode']:.2f} | {r['tool_calls_per_episode']:.2f} "
            f"| {r['repeats']} of {args.rollouts} |"
        )
    summary_json = dict(cpu=cpu, commit=commit, date=date, command=command, settings=vars(args), results=results)
    write_table(lines, args.out, summary_json)
