"""What the tests share besides conftest.py's fixtures: running a script and reading its metrics, the probes that read
a worker's state, comparing weights after optimiser steps."""

import atexit
import contextlib
import io
import json
import os
import runpy
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections import defaultdict
from functools import partial
from pathlib import Path

import grpo_hybrid
import numpy as np
import torch
from ray import cloudpickle

from common.attention import register as register_flex
from common.attention import register_varlen
from common.dataproto import DataProto
from common.envs import Environments
from common.episodes import EpisodeLimits, run_episodes
from common.layouts import response_outputs, rows_of
from common.log_probs import response_log_probs
from common.memory import measured
from common.rewards import response_texts, score_texts
from common.workers import CriticWorker
from common.workers import PolicyWorker

# The probes travel to the workers by value: the workers have no tests folder to import them from.
cloudpickle.register_pickle_by_value(sys.modules[__name__])
cloudpickle.register_pickle_by_value(grpo_hybrid)

ROOT = Path(__file__).resolve().parents[1]
# The RL scripts, each a fork of another: every script in algos/ but the supervised warm start (sft_hybrid.py).
RL_SCRIPTS = sorted(path.stem for path in (ROOT / "algos").glob("*_hybrid.py") if path.stem != "sft_hybrid")
# Two steps on 2 workers, validating at each (test_scripts.py and the tests that run a script to its end).
SMALL_RUN = [
    "--total-steps",
    "2",
    "--train-batch-size",
    "8",
    "--mini-batch-size",
    "4",
    "--n",
    "4",
    "--test-freq",
    "1",
    "--num-workers",
    "2",
]
# A run that validates only at its end (the long runs, the faults); --total-steps is each test's.
TINY = ["--train-batch-size", "8", "--mini-batch-size", "4", "--n", "4", "--test-freq", "100", "--no-val-before-train"]
# conftest.py's uninterrupted GRPO run, which test_checkpoint.py's resumed runs must repeat: every checkpoint kept
EVERY_STEP_SAVED = ["--total-steps", "4", "--save-freq", "1", "--keep-last", "0"]
VLLM_FP32 = ["--rollout-engine", "vllm", "--rollout-dtype", "float32"]  # the trainer's precision on the CPU


def start_script(script: str, *flags, cwd, env=None) -> "subprocess.Popen | ServedRun":
    """algos/`script` started with `flags` in a session of its own, as a command typed in a terminal has: Ctrl-C reaches
    its whole process group. Forked from the script server of this environment (see script_server.py), or, with
    `env` (variables a library may read as it is imported), a new interpreter."""
    args = [sys.executable, str(ROOT / "algos" / script), *flags]
    if env:
        pipes = dict(stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        return subprocess.Popen(args, cwd=cwd, env={**os.environ, **env}, **pipes, start_new_session=True)
    return ServedRun(script_server(), args, cwd)


def run_script(script: str, *flags, cwd, env=None) -> subprocess.CompletedProcess:
    """algos/`script` run to its end with `flags` (`env` on top of this process's environment)."""
    process = start_script(script, *flags, cwd=cwd, env=env)
    try:
        stdout, stderr = process.communicate(timeout=600)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        raise
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)


def run_command(command: str, cwd) -> subprocess.CompletedProcess:
    """A command that a run printed for the user to type (`python algos/<script> FLAGS`), split as a shell splits it."""
    executable, script, *flags = shlex.split(command)
    assert executable == sys.executable and Path(script).parent == ROOT / "algos", command
    return run_script(Path(script).name, *flags, cwd=cwd)


_server: tuple[str, subprocess.Popen, str] | None = None  # the running script server: its environment, process, socket


def script_server() -> str:
    """The socket of the script server for this process's environment, started (about 6 s) where it changed."""
    global _server
    # PYTEST_CURRENT_TEST: pytest changes it at each test, no import reads it
    environment = json.dumps({k: v for k, v in os.environ.items() if k != "PYTEST_CURRENT_TEST"}, sort_keys=True)
    if _server is None or _server[0] != environment:
        if _server is not None:
            _server[1].kill()
            _server[1].wait()
        path = os.path.join(tempfile.mkdtemp(prefix="script_server_"), "socket")
        log = open(path + ".log", "w+")
        server = subprocess.Popen([sys.executable, str(ROOT / "tests" / "script_server.py"), path], stdout=log, stderr=log)
        atexit.register(server.kill)
        deadline = time.time() + 120
        while not os.path.exists(path):  # the server names its socket `path` once it listens
            assert server.poll() is None and time.time() < deadline, f"the script server did not start: {log.read()}"
            time.sleep(0.05)
        _server = environment, server, path
    return _server[2]


class ServedRun:
    """subprocess.Popen's interface (pid, args, stdout, stderr, returncode, poll, wait, communicate, kill,
    send_signal) to a run forked by the script server: the pid is the run's own, its exit code the server's report."""

    def __init__(self, server: str, args: list[str], cwd):
        self.args, self.returncode = args, None
        stdout, out = os.pipe()
        stderr, err = os.pipe()
        self.connection = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.connection.connect(server)
        request = json.dumps(dict(argv=args, cwd=str(cwd), env=dict(os.environ)))
        socket.send_fds(self.connection, [request.encode()], [out, err])
        os.close(out)
        os.close(err)
        self.pid = int(self.connection.recv(64))
        self.stdout, self.stderr = open(stdout), open(stderr)

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.connection.settimeout(timeout)
            try:
                self.returncode = int(self.connection.recv(64))
            except (TimeoutError, BlockingIOError):  # BlockingIOError: timeout 0, and no exit code yet
                raise subprocess.TimeoutExpired(self.args, timeout) from None
            self.connection.close()
        return self.returncode

    def poll(self) -> int | None:
        try:
            return self.wait(0)
        except subprocess.TimeoutExpired:
            return None

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        """What the run writes to stdout and stderr until both close, once it ended."""
        deadline = None if timeout is None else time.time() + timeout
        if not hasattr(self, "_readers"):
            self._output = {}
            self._readers = [threading.Thread(target=self._read, args=(s,), daemon=True) for s in ("stdout", "stderr")]
            for reader in self._readers:
                reader.start()
        for reader in self._readers:
            reader.join(None if deadline is None else max(0, deadline - time.time()))
            if reader.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout)
        self.wait(None if deadline is None else max(0.01, deadline - time.time()))
        return self._output["stdout"], self._output["stderr"]

    def _read(self, stream: str) -> None:
        with getattr(self, stream) as pipe:
            self._output[stream] = pipe.read()

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, signum)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def metric_rows(run_dir: Path) -> list[dict]:
    """Each step's row of a run's metrics.jsonl."""
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def metrics_of(cwd) -> tuple[Path, list[dict]]:
    """The one run under `cwd`/runs, and its rows."""
    [run_dir] = (Path(cwd) / "runs").iterdir()
    return run_dir, metric_rows(run_dir)


def comparable(row):
    """Training metrics: not times, and not validation (the shorter run validates at its last step)."""
    return {
        k: v
        for k, v in row.items()
        if not k.startswith(("timing/", "perf/", "val/")) and not k.endswith("peak_memory_gb") and k != "wall_time"
    }


def wait_for_steps(run_root: Path, steps: int, process, timeout=300):
    """The run folder under `run_root` once its metrics hold `steps` rows; fails where `process` ended before."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        files = list(run_root.glob("runs/*/metrics.jsonl"))
        if files and len(files[0].read_text().splitlines()) >= steps:
            return files[0].parent
        assert process.poll() is None, process.communicate()[1][-3000:]
        time.sleep(0.02)  # a tiny model's step can take 50 ms: a signal sent on the row lands close after it
    raise TimeoutError


def stop_in_process(script: str, *flags, cwd, monkeypatch) -> str:
    """Run algos/`script` in this process as `python algos/script FLAGS` would (no interpreter to start, its imports
    already made), expecting it to stop on bad input before it starts Ray: the error with its traceback, and what it
    wrote to stderr. Where it would start Ray instead, the test fails."""
    import common.worker_group

    def no_ray():
        raise AssertionError(f"{script} {' '.join(flags)} got as far as starting Ray")

    monkeypatch.setattr(common.worker_group, "init_ray", no_ray)
    monkeypatch.setattr(sys, "argv", [str(ROOT / "algos" / script), *flags])
    monkeypatch.setattr(sys, "excepthook", sys.excepthook)  # a Run sets its own
    monkeypatch.chdir(cwd)
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            runpy.run_path(sys.argv[0], run_name="__main__")
    except (Exception, SystemExit) as error:
        if isinstance(error, AssertionError):
            raise
        return "".join(traceback.format_exception(error)) + stderr.getvalue()
    raise AssertionError(f"{script} {' '.join(flags)} ran to its end")


ADAMW_EPS = 1e-8  # torch.optim.AdamW's default, which the workers keep


def assert_same_adamw_steps(weights: dict, expected: dict, gradients: list[dict], lr: float, atol: float) -> None:
    """Weights after len(gradients) AdamW steps from the same start, on two ways to the same gradients.

    Each step moves a weight by lr * m / (sqrt(v) + eps), on the first step lr * g / (|g| + eps): where every |g| is far
    above eps (100 eps: within 1% of lr * sign(g)), rounding in g barely moves the step, and the weights agree to
    `atol`. Where |g| is rounding noise (the gradient of a weight that exact arithmetic leaves still, such as a key
    bias under softmax), the kernels of the CPU pick the step's size and sign: there they agree to about lr per step
    and side, Adam's largest step in its first steps. A weight with no gradient (frozen) is the same on both sides."""
    for name, value in weights.items():
        if name not in gradients[0]:
            torch.testing.assert_close(value, expected[name], rtol=0, atol=0, msg=lambda m: f"{name}: {m}")
            continue
        settled = torch.stack([step[name].abs() > 100 * ADAMW_EPS for step in gradients]).all(0)
        torch.testing.assert_close(value[settled], expected[name][settled], rtol=1e-5, atol=atol, msg=lambda m: f"{name}: {m}")
        torch.testing.assert_close(value, expected[name], rtol=0, atol=2 * lr * len(gradients), msg=lambda m: f"{name}: {m}")


class Probe:
    """What the tests read from a worker, or change on it between calls."""

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter gathered whole, on the CPU (a collective: call every rank)."""
        self.model.reshard()  # FSDP2 keeps the root unsharded after a forward
        return {name: getattr(p, "full_tensor", p.detach)().cpu() for name, p in self.model.named_parameters()}

    def set(self, **settings) -> None:
        for name, value in settings.items():
            setattr(self, name, value)

    def set_temperature(self, temperature: float) -> None:
        """Sample at `temperature` and compute log-probs at it, as a run with --temperature does."""
        import dataclasses

        self.temperature = temperature
        self.engine_settings = dataclasses.replace(self.engine_settings, temperature=temperature)

    def get(self, name: str):
        return getattr(self, name)

    keep_gradients = False

    def _clip_grad_norm(self) -> float:
        """With `keep_gradients` set, each optimiser step's gradient, gathered whole (a collective), joins `gradients`."""
        if self.keep_gradients:
            trained = [(name, p.grad) for name, p in self.model.named_parameters() if p.grad is not None]
            self.gradients.append({name: getattr(grad, "full_tensor", grad.detach)().cpu() for name, grad in trained})
        return super()._clip_grad_norm()


class PolicyProbe(Probe, PolicyWorker):
    def load_of(self, data: DataProto) -> tuple[int, int, int]:
        """The rows, tokens and distinct prompts this rank was dealt."""
        return len(data), int(data["attention_mask"].sum()), len(data["prompts"].unique(dim=0))

    def fsdp_units(self) -> int:
        from torch.distributed.fsdp import FSDPModule

        return sum(isinstance(module, FSDPModule) for module in self.model.modules())

    def micro_batch_loads(self, data: DataProto) -> tuple[list[int], list[int]]:
        """The tokens of each micro-batch, and every row they take."""
        parts = self.micro_batches(data)
        return [int(data[rows]["attention_mask"].sum()) for rows in parts], sorted(np.concatenate(parts).tolist())

    def compute_setup(self) -> tuple[str, str, list[str]]:
        """The compute dtype, the micro-batch layout, and the dtypes of the master weights."""
        self.model.reshard()  # unsharded, FSDP2 shows the gathered copies, in the compute dtype
        return str(self.compute_dtype), self.layout, sorted({str(p.dtype) for p in self.model.parameters()})

    @measured
    def hold(self, gigabytes: float) -> None:
        """Fill `gigabytes` of memory for the length of the call."""
        torch.ones(int(gigabytes * 2**30) // 4)

    def parameter_layouts(self) -> dict[str, str]:
        """How the adapter's and the base model's weights lie on this rank: sharded or whole, and their dtype."""
        self.model.reshard()
        layouts = defaultdict(set)
        for name, p in self.model.named_parameters():
            layout = f"{'sharded' if hasattr(p, 'full_tensor') else 'whole'} {p.dtype}"
            layouts["adapter" if "lora_" in name else "base"].add(layout)
        return {part: "/".join(sorted(kinds)) for part, kinds in layouts.items()}


class CriticProbe(Probe, CriticWorker):
    pass


LOG_PROB_INPUTS = ("input_ids", "attention_mask", "position_ids", "responses")


def local_log_probs(model, batch: DataProto) -> torch.Tensor:
    """Log-probs of the responses in one process, without FSDP."""
    responses = batch["responses"]
    logits = model(
        input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], position_ids=batch["position_ids"]
    ).logits[:, -responses.shape[1] - 1 : -1]
    return torch.log_softmax(logits.float(), -1).gather(-1, responses.unsqueeze(-1)).squeeze(-1)


def local_model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


SAMPLING = dict(do_sample=True, top_p=1.0, top_k=0)
LONGEST_PROMPT = 4000  # the episodes' --max-prompt-length: more than any test's prompt with what a reset adds


def play(policy, prompts, env_calls, envs, tokenizer, eos, max_turns=3, max_response_length=12, n=4):
    """`n` episodes of each prompt; `envs`: Environments, or one environment class."""
    batch = prompts.repeat(n, interleave=True)
    envs = envs if isinstance(envs, Environments) else Environments.of(envs)
    limits = EpisodeLimits(max_turns, LONGEST_PROMPT, max_response_length)
    return batch | run_episodes(policy, batch, env_calls, envs, tokenizer, eos, limits, SAMPLING)


def turns_of(mask: torch.Tensor) -> list[tuple[int, int]]:
    """(start, end) of each run of the model's tokens."""
    spans, start = [], None
    for t, own in enumerate(mask.tolist() + [0.0]):
        if own and start is None:
            start = t
        if not own and start is not None:
            spans.append((start, t))
            start = None
    return spans


FP32_GAP = 1e-4  # engine and trainer in fp32: float rounding only


def train(policy, batch, steps=3, advantages=None):
    """`steps` updates on `batch` with one advantage per sample: `advantages`, or from -1 to 1 along the batch."""
    if advantages is None:
        advantages = torch.tensor(np.linspace(-1, 1, len(batch)), dtype=torch.float32)
    batch["advantages"] = advantages[:, None] * batch["response_mask"]
    inputs = batch.select(*LOG_PROB_INPUTS, "response_mask", "old_log_probs", "advantages")
    for _ in range(steps):
        policy.scatter("update", inputs, loss_fn=partial(grpo_hybrid.actor_loss, args=grpo_hybrid.Args(kl_loss_coef=0.0)))


def gap(batch, name="old_log_probs"):
    mask = batch["response_mask"].bool()
    return (batch[name] - batch["rollout_log_probs"]).abs()[mask].max().item()


def uneven_batch(vocab_size: int, scale: int = 1) -> DataProto:
    """Left-padded prompts of 1 to 7 tokens and right-padded responses of 1 to 6 (`scale` times as long); rows 4 and 5
    sample the prompts of rows 0 and 1 again, row 6 that of row 0 a third time."""
    prompt_lengths, response_lengths = torch.tensor([7, 3, 5, 1, 7, 3, 7]) * scale, torch.tensor([6, 1, 3, 2, 4, 6, 2]) * scale
    prompt, response = 7 * scale, 6 * scale
    prompt_mask = (torch.arange(prompt)[None] >= prompt - prompt_lengths[:, None]).long()
    response_mask = (torch.arange(response)[None] < response_lengths[:, None]).long()
    attention_mask = torch.cat([prompt_mask, response_mask], -1)
    input_ids = torch.randint(3, vocab_size, attention_mask.shape, generator=torch.Generator().manual_seed(0))
    input_ids[[4, 5, 6], :prompt] = input_ids[[0, 1, 0], :prompt]
    input_ids = input_ids * attention_mask
    return DataProto.from_dict(
        {
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "position_ids": (attention_mask.cumsum(-1) - 1).clamp(min=0),
            "responses": input_ids[:, prompt:],
        }
    )


def long_batch(vocab_size: int) -> DataProto:
    """The uneven batch at twenty times its lengths: prompts of 20 to 140 tokens, responses of 20 to 120;
    its packed rows span several of FlexAttention's 128-token blocks, some of them full, some partial, some empty."""
    return uneven_batch(vocab_size, scale=20)


def outputs_of(model_path: str, device: str, dtype: torch.dtype, attention: str, layout: str, flex_from: int | None = None):
    """The log-probs, entropies and gradients of a loss over the long batch (long_batch), the model's weights in `dtype`
    loaded with `attention`, its micro-batch in `layout` (through block masks from `flex_from` tokens wide)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype, attn_implementation=attention).to(device)
    batch = long_batch(model.config.vocab_size).to(device)
    mask = batch["attention_mask"][:, 140:].bool()
    with torch.no_grad():
        logits = response_outputs(model.eval(), batch, layout, language_model=True, flex_from=flex_from)
        log_probs, entropy = response_log_probs(logits.float(), batch["responses"][mask], 1.0, with_entropy=True)
    logits = response_outputs(model.train(), batch, layout, language_model=True, flex_from=flex_from)
    trained, _ = response_log_probs(logits.float(), batch["responses"][mask], 1.0, with_entropy=False)
    (-(trained * torch.linspace(-1, 1, len(trained), device=device)).mean()).backward()
    gradients = {name: p.grad.float().cpu() for name, p in model.named_parameters()}
    return rows_of(log_probs, mask).cpu(), rows_of(entropy, mask).cpu(), gradients


def flex_against_padded(model_path: str, device: str, layout: str):
    """(padded, through block masks) each as outputs_of, the model in fp32; with gradients, the block masks where
    runs_flex lets them run (not on the CPU)."""
    attention = register_flex()
    padded = outputs_of(model_path, device, torch.float32, attention, "padded")
    return [padded, outputs_of(model_path, device, torch.float32, attention, layout, flex_from=0)]


def varlen_against_padded(model_path: str, device: str, dtype: torch.dtype):
    """(padded through SDPA, packed in one row through the varlen attention), each as outputs_of, weights in `dtype`."""
    padded = outputs_of(model_path, device, dtype, "sdpa", "padded")
    return [padded, outputs_of(model_path, device, dtype, register_varlen(), "one row")]


def score(batch: DataProto, tokenizer, rewards, max_error_share: float = 1.0):
    """One score per response of `batch` as the run's Scorer gives a rule's (score_texts of response_texts), as a
    tensor, with the counts and each response's extra keys."""
    scores, metrics, extras = score_texts(response_texts(batch, tokenizer), batch, rewards, max_error_share)
    return torch.tensor(scores, dtype=torch.float32), metrics, extras
