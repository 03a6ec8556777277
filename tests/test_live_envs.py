"""Environments that live for their episode (common/env_processes.py): real environment processes holding a
subprocess, a socket and a temporary file per episode, closed on every ending and cleaned up after; many episodes'
waiting calls side by side; TRL's environment shape run unchanged. The model's turns come from test_tools.py's
scripted engine; the SIGTERM'd run is a real script's."""

import os
import signal
import time

import psutil
import pytest

from common.env_processes import EnvProcesses, EnvsInProcess
from common.envs import episode_spec, load_environments
from common.isolation import REPORTED_FAILURES
from helpers import TINY, metric_rows, start_script, wait_for_steps
from test_tools import COMPACT_TEMPLATE, batch_of, call, play, row

LIVE = '''
import os
import socket
import subprocess
import sys
import tempfile
import time

# A running total kept by a process of its own: the state an episode holds alive. The marker names it for the test.
TOTAL = "import sys\\ntotal = 0\\nfor line in sys.stdin:\\n    total += int(line)\\n    print(total, flush=True)\\n"
TOTAL += "# LIVE-ENV-TEST"


class Shell:
    """A subprocess that keeps a running total, a TCP socket on loopback and a temporary file, for the episode."""

    def reset(self, tag, marks, **row):
        self.tag, self.marks, self.stopped = tag, marks, False
        with open(os.path.join(marks, f"opened_{tag}"), "a") as mark:  # a character per reset
            mark.write("x")
        if tag == "bad_reset":
            raise KeyError("a reset that breaks")
        pipes = dict(stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.process = subprocess.Popen([sys.executable, "-c", TOTAL], **pipes)
        self.server = socket.create_server(("127.0.0.1", 0))
        self.client = socket.create_connection(self.server.getsockname())
        self.peer, _ = self.server.accept()
        self.scratch = tempfile.mkstemp()[1]
        return f" (episode {tag})" if tag == "told" else None

    def add(self, n: int) -> int:
        """Add to the total.

        Args:
            n: What to add.
        """
        self.process.stdin.write(f"{n}\\n")
        self.process.stdin.flush()
        total = self.process.stdout.readline().strip()
        self.client.sendall(total.encode() + b"\\n")  # through the socket and back: it too lives between turns
        return int(self.peer.recv(64).decode())

    def wait(self, seconds: int) -> str:
        """Wait until closed.

        Args:
            seconds: How long at most.
        """
        deadline = time.time() + seconds
        while not self.stopped and time.time() < deadline:
            time.sleep(0.05)
        return "woke"

    def get_reward(self) -> float:
        if self.tag == "bad_reward":
            raise ValueError("a reward that breaks")
        return 1.0

    def close(self):
        self.stopped = True
        if hasattr(self, "process"):
            self.process.kill()
            self.process.wait()
            for connection in (self.client, self.peer, self.server):
                connection.close()
        with open(os.path.join(self.marks, f"closed_{self.tag}"), "a") as mark:  # a character per close
            mark.write("x")
        if self.tag == "bad_close":
            raise OSError("a close that breaks")


class Unmakeable:
    """Cannot be made."""

    def __init__(self):
        raise RuntimeError("an environment that cannot be made")

    def noop(self) -> str:
        """Nothing."""
        return ""


class Napper:
    """Naps for as long as its row says."""

    def reset(self, nap, **row):
        self.nap = nap

    def sleep(self) -> str:
        """Nap."""
        time.sleep(self.nap)
        return "rested"


class TRLCounter:
    """TRL's environment_factory shape, as its documentation writes one: reset(**kwargs) that returns the
    observation joined to the prompt, tools that raise to tell the model its mistake."""

    def reset(self, **kwargs) -> str | None:
        self.counter = 0
        self.goal = int(kwargs["goal"])
        return f" Reach {self.goal}."

    def increment(self, step: int) -> int:
        """Increment the counter by a given step.

        Args:
            step: The value to add.

        Returns:
            The new value of the counter.
        """
        if step <= 0:
            raise ValueError("step must be positive")
        self.counter += step
        return self.counter

    def get_reward(self) -> float:
        return float(self.counter == self.goal)
'''


@pytest.fixture(scope="module")
def live_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("live") / "live.py"
    path.write_text(LIVE)
    return str(path)


def live_processes() -> list:
    return [p for p in psutil.process_iter(["cmdline"]) if "LIVE-ENV-TEST" in " ".join(p.info["cmdline"] or [])]


def test_a_live_environment_keeps_its_process_and_socket_between_turns_and_closes_on_every_ending(
    tool_tokenizer, live_file, tmp_path, capsys
):
    environments = load_environments(episode_spec(f"{live_file}:Shell,{live_file}:Unmakeable", None))
    marks = tmp_path / "marks"
    marks.mkdir()
    rows = {  # tag: (the model's turns, the ending)
        "answered": ([call("add", n=2), call("add", n=3), "5"], "answered"),
        "max_turns": ([call("add", n=1)] * 4, "max_turns"),
        "token_limit": (["y" * 320 + call("add", n=1)], "token_limit"),  # no room for the answer in 400 tokens
        "timeout": ([call("wait", seconds=60), "late"], "timeout"),
        "bad_reward": (["0"], "error"),
        "bad_reset": (["0"], "error"),
        "bad_close": (["0"], "error"),
        "told": (["0"], "answered"),
    }
    data = [row(f"episode {tag}?", tag=tag, marks=str(marks)) for tag in rows]
    data.append(row("episode unmakeable?", env="Unmakeable", tag="unmakeable", marks=str(marks)))
    batch = batch_of(tool_tokenizer, tmp_path, data, environments)
    script = {f"episode {tag}?": turns for tag, (turns, _) in rows.items()} | {"episode unmakeable?": ["0"]}
    REPORTED_FAILURES.clear()
    env_calls = EnvProcesses(environments.spec, 2, timeout=10)  # the "timeout" row waits 60 s; the others far less
    try:
        episodes = play(tool_tokenizer, batch, environments, script, env_calls, max_response_length=400)
        folders = [process.folder for process in env_calls.processes]
    finally:
        env_calls.close()
    assert episodes["ending"].tolist() == [ending for _, ending in rows.values()] + ["error"]
    assert episodes["episode_score"].tolist() == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0]
    answered = tool_tokenizer.decode(episodes["responses"][0])  # the running total, through the socket: both alive
    assert "<tool_response>\n2\n</tool_response>" in answered and "<tool_response>\n5\n</tool_response>" in answered
    told = tool_tokenizer.decode(episodes["prompts"][7][episodes["prompt_mask"][7].bool()])
    assert told.endswith("episode told? (episode told)<|im_end|>\n<|im_start|>assistant\n")  # reset's text, as TRL adds it
    # close() ran on every ending, the timeout's too (its call woke and ended, so its process stayed); the one that
    # could not be made had nothing to close
    assert sorted(name for name in os.listdir(marks) if name.startswith("closed_")) == sorted(f"closed_{tag}" for tag in rows)
    assert not live_processes() and not any(map(os.path.exists, folders)), "no child process or temporary file left"
    err = capsys.readouterr().err
    for kind in ("KeyError", "ValueError", "OSError", "RuntimeError"):  # reset, get_reward, close, the constructor
        assert err.count(f"the environment failed ({kind})") == 1


def test_closing_the_pool_closes_the_environments_it_holds(live_file, tmp_path):
    """What a run's stop does with episodes under way: their objects' close() runs before the processes end."""
    environments = load_environments(episode_spec(f"{live_file}:Shell", None))
    env_calls = EnvProcesses(environments.spec, 2, timeout=60)
    tickets = [env_calls.submit(f"stop/{i}", ("open", "Shell", {"tag": f"held{i}", "marks": str(tmp_path)})) for i in range(3)]
    outcomes = {}
    while len(outcomes) < len(tickets):
        outcomes |= env_calls.collect()
    assert all(outcome == ("ok", None) for outcome in outcomes.values()) and live_processes()
    folders = [process.folder for process in env_calls.processes]
    env_calls.close()
    closed = sorted(name for name in os.listdir(tmp_path) if name.startswith("closed_"))
    assert closed == ["closed_held0", "closed_held1", "closed_held2"]
    assert not live_processes() and not any(map(os.path.exists, folders))


def test_waiting_calls_of_many_episodes_wait_side_by_side_on_the_default_pool(tool_tokenizer, live_file, tmp_path):
    environments = load_environments(episode_spec(f"{live_file}:Napper", None))
    naps = [2.0 * i / 63 for i in range(64)]  # 0 to 2 s
    script = {f"nap {i}?": [call("sleep"), "done"] for i in range(64)}
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    env_calls = EnvProcesses(environments.spec, min(cores, 16), timeout=10)  # the run's default pool (Run._start)
    seconds = {}
    try:
        for name, rows_naps in ("loading", naps[: len(env_calls.processes)]), ("instant", [0.0] * 64), ("napping", naps):
            rows = [row(f"nap {i}?", nap=nap) for i, nap in enumerate(rows_naps)]
            batch = batch_of(tool_tokenizer, tmp_path, rows, environments)
            start = time.perf_counter()
            episodes = play(tool_tokenizer, batch, environments, script, env_calls)
            seconds[name] = time.perf_counter() - start
            assert set(episodes["ending"]) == {"answered"} and sum(episodes["tool_calls"]) == len(rows)
    finally:
        env_calls.close()
    # the same play with instant tools is the driver's own work; naps side by side add the slowest (2 s), where calls
    # made one after another in each process would add tens of seconds (32 naps a process here), and the two longest
    # naps behind one another alone would pass the bound
    assert seconds["napping"] < seconds["instant"] + max(naps) + 1.0, seconds


def test_a_trl_environment_class_runs_unchanged(tool_tokenizer, live_file, tmp_path, capsys):
    environments = load_environments(episode_spec(f"{live_file}:TRLCounter", None))
    assert list(environments.schemas("TRLCounter")) == ["increment"]
    # TRL's field `environment` picks the environment; the other columns reach reset, as TRL passes them
    data = [row("count to 5.", goal=5, environment="TRLCounter"), row("count to 3.", goal=3)]
    batch = batch_of(tool_tokenizer, tmp_path, data, environments)
    script = {
        "count to 5.": [call("increment", step=2) + "\n" + call("increment", step=3), "5"],
        "count to 3.": [call("increment", step=-1), call("increment", step=3), "3"],
    }
    REPORTED_FAILURES.clear()
    for env_calls in EnvsInProcess(environments), EnvProcesses(environments.spec, 1):
        try:
            episodes = play(tool_tokenizer, batch, environments, script, env_calls)
        finally:
            env_calls.close()
        assert episodes["episode_score"].tolist() == [1.0, 1.0] and episodes["tool_errors"].tolist() == [0, 1]
        prompt = tool_tokenizer.decode(episodes["prompts"][0][episodes["prompt_mask"][0].bool()])
        assert "count to 5. Reach 5.<|im_end|>" in prompt
        raised = tool_tokenizer.decode(episodes["responses"][1][~episodes["response_mask"][1].bool()])
        assert "error: ValueError: step must be positive" in raised
    assert capsys.readouterr().err.count("a tool raised ValueError") == 1  # once per kind and run


def test_a_run_stopped_by_sigterm_closes_its_episodes_environments(ray_cluster, demo_files, live_file, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    marks = tmp_path / "marks"
    marks.mkdir()
    prompts = [[{"role": "user", "content": f"{i}+{i}="}] for i in range(8)]
    data = {"prompt": prompts, "ground_truth": [str(2 * i) for i in range(8)], "tag": [f"row{i}" for i in range(8)]}
    data |= {"data_source": ["addition"] * 8, "marks": [str(marks)] * 8}  # the environment scores; a reward is checked
    pq.write_table(pa.table(data), tmp_path / "train.parquet")
    (tmp_path / "compact.jinja").write_text(COMPACT_TEMPLATE)
    flags = ["--model-path", demo_files[0], "--train-files", str(tmp_path / "train.parquet"), "--env", f"{live_file}:Shell"]
    flags += ["--chat-template", str(tmp_path / "compact.jinja"), "--max-prompt-length", "32", "--max-response-length", "24"]
    flags += [*TINY, "--total-steps", "500", "--save-freq", "1000", "--reward-workers", "2"]
    process = start_script("grpo_hybrid.py", *flags, cwd=tmp_path)
    run_dir = wait_for_steps(tmp_path, 1, process)
    process.send_signal(signal.SIGTERM)  # the step under way ends, the run saves and stops
    _, stderr = process.communicate(timeout=120)
    assert process.returncode == 0, stderr[-3000:]
    assert len(metric_rows(run_dir)) >= 1
    opened = {name.removeprefix("opened_"): (marks / name).read_text() for name in os.listdir(marks) if "opened" in name}
    closed = {name.removeprefix("closed_"): (marks / name).read_text() for name in os.listdir(marks) if "closed" in name}
    assert opened == closed and len(opened) == 8, "every episode's close() ran, the step's under way too"
    assert not live_processes(), "nothing was left"
