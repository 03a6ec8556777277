"""The console a person reads (common/console.py): Ray workers' repeated warnings shown once, hints hidden, and all of
it in the run's folder."""

import io
import subprocess
import sys
import threading

from common.console import Console, Screen
from helpers import ROOT

DRIVER = """
import logging, sys, time, warnings
from pathlib import Path
import ray
from common.console import start_console
from common.worker_group import init_ray

init_ray()
start_console(Path(sys.argv[1]))

@ray.remote
def load(worker):
    logger = logging.getLogger("vllm.model_executor.models.utils")
    vllm_format = "(MainProcess pid=%(process)d) %(levelname)s [utils.py:333] %(message)s"
    logging.basicConfig(stream=sys.stdout, format=vllm_format, force=True)
    for name in ("embed_tokens.weight", "layers.0.mlp.up_proj.weight", "layers.1.mlp.up_proj.weight", "norm.weight"):
        logger.warning("Attempted to load weight %s with dtype torch.float32 into parameter with dtype torch.bfloat16", name)
    logger.warning("libtcmalloc is not found in LD_PRELOAD. For best performance, please follow ...")
    warnings.warn("a library's deprecation, once per process")
    print(f"worker {'AB'[worker]} ready")

ray.get([load.remote(worker) for worker in range(2)])
print("the run's own line")
# Ray forwards the workers' lines on its own time: wait for the last each worker wrote to its stdout and its stderr
log, deadline = Path(sys.argv[1], "console.log"), time.time() + 120
while (log.read_text().count("ready") < 2 or "UserWarning" not in log.read_text()) and time.time() < deadline:
    time.sleep(0.2)
sys.stdout.flush()
ray.shutdown()
"""


def test_workers_repeated_warnings_show_once_hints_never_and_the_log_keeps_all(ray_cluster, tmp_path):
    """Two Ray tasks each warn per tensor as vLLM's weight loader does, hint at a library to preload, and raise a
    Python warning, forwarded by Ray to a driver that started the console: the console shows the per-tensor warning
    and the Python warning once, the hint never, the workers' and the run's own lines; console.log in the run's
    folder has every line."""
    result = subprocess.run(
        [sys.executable, "-c", DRIVER, str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr[-3000:]
    console = (result.stdout + result.stderr).splitlines()
    log = (tmp_path / "console.log").read_text()
    assert sum("Attempted to load weight" in line for line in console) == 1
    assert sum("UserWarning: a library's deprecation" in line for line in console) == 1
    assert not any("LD_PRELOAD" in line for line in console)
    assert "the run's own line" in console and sum("ready" in line for line in console) == 2
    assert log.count("libtcmalloc is not found in LD_PRELOAD") >= 1 and "the run's own line" in log
    assert log.count("Attempted to load weight") >= 4  # Ray folds some repeats into "[repeated Nx across cluster]"


def test_a_line_another_thread_writes_midway_stays_apart(tmp_path):
    """`print` writes its text and its newline apart; Ray's thread that forwards the workers' lines may write between
    the two. Both lines are shown whole, each judged alone: the worker's hint hidden, the run's line shown."""
    shown = io.StringIO()
    console = Console(shown, (tmp_path / "console.log").open("w"))
    console.write("the run's own line")
    worker = threading.Thread(target=console.write, args=("(RolloutWorker pid=7) libtcmalloc is not found in LD_PRELOAD\n",))
    worker.start()
    worker.join()
    console.write("\n")
    assert shown.getvalue() == "the run's own line\n"


def test_fsdp2s_warning_on_the_peft_models_view_is_logged_not_shown(tmp_path):
    """FSDP2 (torch 2.13) warns, in each worker, that the PEFT model returns a view: nothing a user can act on."""
    shown, log = io.StringIO(), io.StringIO()
    console = Console(shown, log)
    prefix = "\x1b[36m(PolicyWorker pid=6555)\x1b[0m "
    fsdp_state = "/venv/lib/python3.11/site-packages/torch/distributed/fsdp/_fully_shard/_fsdp_state.py:331"
    console.write(
        f"{prefix}{fsdp_state}: UserWarning: FSDP2-wrapped module (FSDPPeftModelForCausalLM) returned a view tensor. An "
        "in-place op on this view (e.g., `x += y`) will silently drop the pre-backward hook and skip the all-gather\n"
    )
    console.write(f"{prefix}  output = self._register_pre_backward_hook(output)\n")
    assert shown.getvalue() == "" and log.getvalue().count("(PolicyWorker pid=6555)") == 2


def test_vllms_notes_and_the_source_line_under_a_hidden_warning_are_logged_not_shown(tmp_path):
    """vLLM's CPU backend notes an SSM cache it does not use and, from each worker, that its own code calls a deprecated
    torch name; Python prints the warning's source line under it, two workers' lines may interleave, and where Ray
    folds one worker's repeat of another's warning away, two source lines follow one warning. None of it is shown; a
    worker's indented line that follows no hidden warning (a traceback's) is."""
    shown, log = io.StringIO(), io.StringIO()
    console = Console(shown, log)
    first, second = "\x1b[36m(PolicyWorker pid=1)\x1b[0m ", "\x1b[36m(PolicyWorker pid=2)\x1b[0m "
    dispatcher = "/venv/lib/python3.11/site-packages/vllm/triton_utils/dispatcher.py:138"
    deprecated = "FutureWarning: `torch.distributed.reduce_op` is deprecated, please use `torch.distributed.ReduceOp` instead"
    ssm = "Reset SSM cache type to float32 for accelerated GDN mamba backend 'none'."
    lines = [
        f"{first}{dispatcher}: {deprecated}",
        f"{second}{dispatcher}: {deprecated}",
        f'{first}  if hasattr(value, "__dict__"):',
        f'{second}  if hasattr(value, "__dict__"):',
        f'{second}  wrapper = lookup(vars(value).get("kernel"))',
        f"{first}(MainProcess pid=1) WARNING 11-28 05:03:06 [cpu.py:317] {ssm}",
        f"{first}Traceback (most recent call last):",
        f'{first}  File "/run/algos/grpo_hybrid.py", line 1, in <module>',
    ]
    for line in lines:
        console.write(line + "\n")
    assert shown.getvalue().splitlines() == lines[-2:]
    assert log.getvalue().splitlines() == lines


def test_a_line_shown_while_the_progress_bar_stands_goes_above_it():
    """A worker's line that Ray writes to stdout while the bar stands on stderr's last line would join the bar's line:
    it goes on a line of its own, the bar drawn again below it; the bar's own newline ends it."""
    shown, log, screen = io.StringIO(), io.StringIO(), Screen()
    stdout, stderr = Console(shown, log, screen), Console(shown, log, screen)
    stderr.write("\rgrpo:   0%|          | 0/3")
    stdout.write("(PolicyWorker pid=1) worker ready\n")
    stderr.write("\rgrpo:  33%|###       | 1/3")
    stderr.write("\n")
    stdout.write("held-out accuracy: 9.7% at the last validation\n")
    assert shown.getvalue() == (
        "\rgrpo:   0%|          | 0/3\n(PolicyWorker pid=1) worker ready\n\rgrpo:   0%|          | 0/3"
        "\rgrpo:  33%|###       | 1/3\nheld-out accuracy: 9.7% at the last validation\n"
    )
