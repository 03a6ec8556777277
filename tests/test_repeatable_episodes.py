"""Agentic runs that repeat and resume exactly (--deterministic): episodes whose environment holds a subprocess and
answers after a random 0-2 s, different in each run, give the same metrics and weights in two runs of a seed, and a
run stopped by SIGTERM mid-step and resumed equals the uninterrupted one; on both engines, GRPO and PPO, and with the
engines apart generating while the policy trains. What each turn samples is its own (InverseCDFSample's seeds)."""

import signal
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from common.checkpoint import complete_checkpoints
from common.hf_engine import InverseCDFSample
from helpers import TINY, VLLM_FP32, comparable, metric_rows, run_script, start_script, wait_for_steps
from test_tools import COMPACT_TEMPLATE

SLOW = '''
import random
import subprocess
import sys
import time

COUNT = "import sys\\nfor line in sys.stdin:\\n    print(len(line.split()), flush=True)\\n"


class Slow:
    """Answers each turn with its word count, counted by a subprocess of its own, after 0-2 s drawn from the machine's
    entropy (no seed reaches it: two runs wait differently)."""

    def reset(self, **row):
        pipes = dict(stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.process, self.counts = subprocess.Popen([sys.executable, "-c", COUNT], **pipes), []

    def step(self, text):
        time.sleep(random.SystemRandom().uniform(0, 2))
        self.process.stdin.write(" ".join(text.split()) + "\\n")
        self.process.stdin.flush()
        self.counts.append(int(self.process.stdout.readline()))
        return f" {self.counts[-1]} words"

    def turn_reward(self):
        return self.counts[-1] % 3 / 10

    def get_reward(self):
        return float(sum(self.counts) % 2)

    def close(self):
        self.process.kill()
        self.process.wait()
'''

AGENT = '''
import asyncio
import random


async def solve(row, client):
    """Two requests, the second extending the first, each after 0-1 s drawn from the machine's entropy."""
    messages = list(row["prompt"])
    for _ in range(2):
        await asyncio.sleep(random.SystemRandom().uniform(0, 1))
        reply = (await client.chat.completions.create(model="policy", messages=messages, max_tokens=8)).choices[0]
        messages += [{"role": "assistant", "content": reply.message.content}, {"role": "user", "content": "more"}]
    return float(len(reply.message.content) % 2)
'''

ASYNC = ["--num-workers", "1", "--rollout-workers", "1", "--max-staleness", "1"]  # a worker each: the tests share 4 CPUs


def test_a_seeded_row_draws_the_same_tokens_whatever_rows_share_its_batch():
    scores = torch.randn(5, 50, generator=torch.Generator().manual_seed(0))  # [rows, vocab]
    seeds = [11, 22, 33, 44, 55]

    def drawn(rows: list[int]) -> torch.Tensor:
        """[len(rows), 8] tokens drawn at 8 steps, torch's global generator disturbed between them."""
        sampler = InverseCDFSample([seeds[row] for row in rows])
        steps = []
        for step in range(8):
            torch.manual_seed(1000 + step + len(rows))
            steps.append(sampler(None, scores[rows]).argmax(-1))
        return torch.stack(steps, 1)

    together = drawn([0, 1, 2, 3, 4])
    assert torch.equal(drawn([4, 2, 0, 3, 1]), together[[4, 2, 0, 3, 1]])
    assert all(torch.equal(drawn([row])[0], together[row]) for row in range(5))
    assert len({tuple(row.tolist()) for row in together}) == 5, "each seed draws its own tokens"


@pytest.fixture(scope="module")
def slow_task(tmp_path_factory, demo_files):
    """Flags of a multi-turn task: 8 prompts, each episode's environment Slow, two model turns."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = tmp_path_factory.mktemp("slow_task")
    (folder / "slow_env.py").write_text(SLOW)
    (folder / "compact.jinja").write_text(COMPACT_TEMPLATE)
    prompts = [[{"role": "user", "content": f"{i}+{i}="}] for i in range(8)]
    data = {"prompt": prompts, "ground_truth": [str(2 * i) for i in range(8)], "data_source": ["addition"] * 8}
    pq.write_table(pa.table(data), folder / "train.parquet")
    flags = ["--model-path", demo_files[0], "--train-files", str(folder / "train.parquet")]
    flags += ["--env", f"{folder / 'slow_env.py'}:Slow", "--chat-template", str(folder / "compact.jinja")]
    flags += ["--max-prompt-length", "32", "--max-response-length", "24", "--max-turns", "2", "--reward-workers", "2"]
    return [*flags, *TINY, "--lr-schedule", "constant", "--deterministic"]


def agent_task(slow_task: list[str]) -> list[str]:
    """The slow task's flags with an agent program of two requests in place of its environment."""
    folder = Path(slow_task[slow_task.index("--env") + 1].rpartition(":")[0]).parent
    (folder / "agent.py").write_text(AGENT)
    flags = list(slow_task)
    flags[flags.index("--env") : flags.index("--env") + 2] = ["--agent", f"{folder / 'agent.py'}:solve"]
    flags[flags.index("--max-prompt-length") + 1] = "64"  # a session that rewrites its history starts a longer prompt
    return flags


def repeatable(row: dict) -> dict:
    """A step's metrics but those of time: the engines' idle share, as the timings, is the environments' timing."""
    return {key: value for key, value in comparable(row).items() if key != "env/engine_idle_share"}


@pytest.mark.parametrize(
    "algo, engine",
    [("grpo", []), ("ppo", VLLM_FP32), ("ppo", ASYNC), ("grpo", [*VLLM_FP32, *ASYNC]), ("grpo", ["--agent"])],
    ids=["grpo-hf", "ppo-vllm", "ppo-hf-apart", "grpo-vllm-apart", "grpo-hf-agent"],
)
def test_two_runs_of_a_seed_and_a_resumed_one_play_the_same_episodes(ray_cluster, slow_task, tmp_path, algo, engine):
    flags = agent_task(slow_task) if engine == ["--agent"] else [*slow_task, *engine]
    (tmp_path / "straight").mkdir()
    result = run_script(f"{algo}_hybrid.py", *flags, "--total-steps", "3", "--save-freq", "1000", cwd=tmp_path / "straight")
    assert result.returncode == 0, result.stderr[-3000:]
    [straight] = (tmp_path / "straight" / "runs").iterdir()

    (tmp_path / "stopped").mkdir()
    stopped = dict(cwd=tmp_path / "stopped")
    process = start_script(f"{algo}_hybrid.py", *flags, "--total-steps", "500", "--save-freq", "1000", **stopped)
    run_dir = wait_for_steps(tmp_path / "stopped", 1, process)
    process.send_signal(signal.SIGTERM)  # the next step is under way: it ends, the run saves and stops
    _, stderr = process.communicate(timeout=300)
    assert process.returncode == 0, stderr[-3000:]
    [checkpoint] = complete_checkpoints(run_dir)
    assert int(checkpoint.name.removeprefix("step_")) < 3
    result = run_script(f"{algo}_hybrid.py", *flags, "--total-steps", "3", "--resume", "auto", **stopped)
    assert result.returncode == 0, result.stderr[-3000:]

    rows, straight_rows = metric_rows(run_dir), metric_rows(straight)
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert min(r["env/turns_mean"] for r in rows) > 1, "the episodes took more than one turn"
    assert [repeatable(r) for r in rows] == [repeatable(r) for r in straight_rows]
    weights, straight_weights = (load_file(folder / "model" / "model.safetensors") for folder in (run_dir, straight))
    assert weights.keys() == straight_weights.keys()
    assert all(torch.equal(weights[name], straight_weights[name]) for name in weights)
