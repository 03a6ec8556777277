"""TRL's GRPOTrainer against algos/grpo_hybrid.py on the real model and task, at equal work, one after the other.

Both train SmolLM2-135M-Instruct (`--model-path smollm2`) on the times tables (common/demo.py) with a LoRA
adapter of rank 16 (alpha 32, every linear layer) at learning rate 2e-4: 8 prompts x 8 samples per step, at most 16
new tokens at temperature 1, one optimiser step per generated batch, KL to the adapter-disabled reference (k3,
coefficient 0.001), the same reward (the response's last number). hybridrl runs its demo's defaults (2 CPU workers,
the hf engine, --compute-dtype auto); TRL runs in one process with torch's threads over every core, without the
gradient checkpointing its GRPOConfig turns on by default, in fp32 and in bf16 (`bf16=True`). Printed: seconds
per step (mean over the steps after the first), where each phase goes, and the peak resident memory of each process.

TRL is never a dependency of hybridrl: give it an environment of its own and name its Python:

    python -m venv trl-env && trl-env/bin/pip install torch==2.13.0 && trl-env/bin/pip install trl peft
    python benchmarks/bench_trl.py --trl-python trl-env/bin/python --steps 6
"""

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPTS, SAMPLES, NEW_TOKENS, LORA_RANK, LORA_ALPHA, LR, KL = 8, 8, 16, 16, 32, 2e-4, 0.001


def run(command: list[str], **kwargs) -> subprocess.CompletedProcess:
    result = subprocess.run(command, capture_output=True, text=True, **kwargs)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed:\n{result.stderr[-3000:]}")
    return result


def run_hybridrl(flags: list[str], env: dict) -> dict:
    """The GRPO script's own per-phase timers, from its metrics.jsonl; the peak memory of its driver and workers."""
    folder = Path(tempfile.mkdtemp(prefix="bench_trl_hybridrl_"))
    # The script under runpy, to read its own peak: its Ray workers are its children, which RUSAGE_CHILDREN would count.
    measured = (
        "import resource, runpy, sys; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__'); "
        "print('driver peak kB', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)"
    )
    result = run([sys.executable, "-c", measured, str(ROOT / "algos" / "grpo_hybrid.py"), *flags], cwd=folder, env=env)
    driver_gb = int(result.stdout.split("driver peak kB")[-1]) / 2**20
    [run_dir] = (folder / "runs").iterdir()
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][1:]
    phases = sorted({key for row in rows for key in row if key.startswith("timing/")} - {"timing/validate", "timing/save"})
    mean = {key.removeprefix("timing/"): sum(row.get(key, 0.0) for row in rows) / len(rows) for key in phases}
    # Each worker method's peak, from its own start (see common/memory.measured), the largest over ranks and steps.
    methods = sorted({key for row in rows for key in row if key.startswith("perf/peak_memory_gb/policy/")})
    worker = ", ".join(f"{key.rsplit('/', 1)[1]} {max(row[key] for row in rows):.2f}" for key in methods)
    response = sum(row["response/length_mean"] for row in rows) / len(rows)
    memory = f"driver {driver_gb:.2f} GB; a worker's, by method: {worker} GB"
    return dict(step=mean.pop("step"), phases=mean, memory=memory, response_length=response)


def run_trl(trl_python: str, steps: int, bf16: bool, model_path: str, train_file: str, sizes: dict | None = None) -> dict:
    """TRL's run in its own environment; `sizes` changes trl_worker's keyword arguments."""
    command = [trl_python, __file__, "--trl-worker", "--steps", str(steps), "--model", model_path, "--data", train_file]
    result = run(command + (["--bf16"] if bf16 else []) + ["--sizes", json.dumps(sizes or {})])
    return json.loads(result.stdout.strip().splitlines()[-1])


def trl_worker(
    steps: int,
    bf16: bool,
    model_path: str,
    train_file: str,
    prompts: int = PROMPTS,
    samples: int = SAMPLES,
    new_tokens: int = NEW_TOKENS,
    micro_batch: int = PROMPTS * SAMPLES,
) -> None:
    """Runs in TRL's environment: GRPOTrainer for `steps` steps, timing each step and its phases; on the GPU if there
    is one, each optimiser step over `prompts` x `samples` sequences in micro-batches of `micro_batch`."""
    import pyarrow.parquet as pq
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    sys.path.insert(0, str(ROOT))
    from common.rewards import last_number_reward

    rows = pq.read_table(train_file).to_pylist()
    data = Dataset.from_list([{"prompt": row["prompt"], "truth": row["reward_model"]["ground_truth"]} for row in rows])

    def reward(completions, truth, **kwargs):
        return [last_number_reward(completion[0]["content"], answer) for completion, answer in zip(completions, truth)]

    config = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="bench_trl_"),
        per_device_train_batch_size=micro_batch,
        gradient_accumulation_steps=prompts * samples // micro_batch,  # one optimiser step per generated batch
        num_generations=samples,
        max_completion_length=new_tokens,
        temperature=1.0,
        learning_rate=LR,
        beta=KL,
        num_iterations=1,
        max_steps=steps,
        gradient_checkpointing=False,
        disable_dropout=True,
        bf16=bf16,
        use_cpu=not torch.cuda.is_available(),
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        seed=1,
    )
    lora = LoraConfig(r=LORA_RANK, lora_alpha=LORA_ALPHA, target_modules="all-linear", lora_dropout=0.0, task_type="CAUSAL_LM")
    trainer = GRPOTrainer(model=model_path, reward_funcs=reward, args=config, train_dataset=data, peft_config=lora)

    spent = {"generate": 0.0, "log_probs_and_reward": 0.0}

    def timed(name, method, minus=None):
        def call(*args, **kwargs):
            started, before = time.perf_counter(), spent[minus] if minus else 0.0
            try:
                return method(*args, **kwargs)
            finally:
                spent[name] += time.perf_counter() - started - ((spent[minus] - before) if minus else 0.0)

        return call

    trainer._generate_single_turn = timed("generate", trainer._generate_single_turn)
    # everything between generating and training: the reward, the reference's (and any old) log-probs
    trainer._generate_and_score_completions = timed(
        "log_probs_and_reward", trainer._generate_and_score_completions, minus="generate"
    )
    per_step = []

    class StepTimes(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            self.started, self.before = time.perf_counter(), dict(spent)

        def on_step_end(self, args, state, control, **kwargs):
            step = time.perf_counter() - self.started
            phases = {name: spent[name] - self.before[name] for name in spent}
            per_step.append(dict(step=step, **phases, update=step - sum(phases.values())))

    trainer.add_callback(StepTimes())
    trainer.train()
    measured = per_step[1:]
    mean = {key: sum(step[key] for step in measured) / len(measured) for key in measured[0]}
    if torch.cuda.is_available():
        memory = f"GPU {torch.cuda.max_memory_allocated() / 2**30:.2f} GB"
    else:
        memory = f"one process {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GB"
    lengths = [row["completions/mean_length"] for row in trainer.state.log_history if "completions/mean_length" in row]
    response = sum(lengths[1:]) / len(lengths[1:])
    print(json.dumps(dict(step=mean.pop("step"), phases=mean, memory=memory, response_length=response)))


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trl-python", help="the Python of an environment with TRL installed")
    parser.add_argument("--steps", type=int, default=6, help="steps of each run; the first is left out of the means")
    parser.add_argument("--trl-dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    parser.add_argument("--extra-flags", nargs=argparse.REMAINDER, default=[], help="flags added to the GRPO script")
    parser.add_argument("--trl-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--bf16", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--data", help=argparse.SUPPRESS)
    parser.add_argument("--sizes", default="{}", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.trl_worker:
        trl_worker(args.steps, args.bf16, args.model, args.data, **json.loads(args.sizes))
        sys.exit()
    if not args.trl_python:
        parser.error("--trl-python is missing: the Python of an environment with TRL (see above)")
    if args.steps < 2:
        parser.error("--steps must be at least 2: the first step is left out of the means")

    sys.path.insert(0, str(ROOT))
    from common import demo, pretrained
    from demo_table import machine

    print(machine(), flush=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    model_path, (_, train_file, _) = pretrained.prepare("smollm2"), demo.prepare("times_tables")
    flags = ["--model-path", "smollm2", "--total-steps", str(args.steps), "--test-freq", str(args.steps)]
    results = {"hybridrl grpo_hybrid.py": run_hybridrl([*flags, "--no-val-before-train", *args.extra_flags], env)}
    for dtype in args.trl_dtypes:
        bf16 = dtype == "bfloat16"
        results[f"TRL GRPOTrainer, {dtype}"] = run_trl(args.trl_python, args.steps, bf16, model_path, train_file)
    ours = results["hybridrl grpo_hybrid.py"]["step"]
    print(f"\n{PROMPTS} prompts x {SAMPLES} samples, {NEW_TOKENS} new tokens, LoRA {LORA_RANK}, steps 2-{args.steps}\n")
    print("| run | seconds per step | hybridrl's speed against it | phases (seconds) | peak memory |")
    print("|---|---|---|---|---|")
    for name, result in results.items():
        phases = ", ".join(f"{phase} {seconds:.1f}" for phase, seconds in result["phases"].items())
        print(f"| {name} | {result['step']:.1f} | {result['step'] / ours:.2f}x | {phases} | {result['memory']} |")
