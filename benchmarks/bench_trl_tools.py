"""TRL's GRPOTrainer with `tools=[multiply]` against algos/grpo_hybrid.py with `--tools multiply`, at equal settings.

Both start from the same warm-started SmolLM2-135M-Instruct, the export of a seed's warm start in
benchmarks/bench_tool_learning.py's run (it carries the ChatML tool template `chatml_tools`), and train on the same
prompts (the multiplication tool's train.parquet, common/demo.py) with that run's GRPO settings (GRPO in
bench_tool_learning.py): 8 prompts x 4 samples a step at temperature 1, as many steps, a LoRA adapter of rank 16
(alpha 32, every linear layer, no dropout) at learning rate 5e-4, KL to the adapter-disabled reference (coefficient
0.001), at most 96 tokens of response, two rounds of tool calls (3 model turns), one optimiser step per generated batch
in micro-batches of 16, bf16 (what --compute-dtype auto takes on a CPU with AVX512-BF16), the same reward (the last
number of the last assistant turn against the product). TRL runs in one process with torch's threads over every core;
hybridrl ran its 2 CPU workers. hybridrl's figures are read from bench_tool_learning.py's JSON; TRL's trained model
(its adapter merged, saved with its tokenizer) is judged as that run judged ours: grpo_hybrid.py's validation before its
first step, on the same held-out problems, greedy.

TRL reads a model's tool calls with a response template it knows for a few chat templates (Qwen, Llama, ...), and
refuses any other one at start-up; the exact error is printed. The run then gives TRL's tokenizer the framing
grpo_hybrid.py reads calls with (common/tools.py's TOOL_CALL_FRAMING, a transformers response template), so that both
parse the same `<tool_call>` JSON.

TRL is never a dependency of hybridrl: give it an environment of its own and name its Python:

    python -m venv trl-env && trl-env/bin/pip install torch==2.13.0 trl==1.16.0 peft
    python benchmarks/bench_tool_learning.py --seeds 1       # writes bench_tool_learning.json
    python benchmarks/bench_trl_tools.py --trl-python trl-env/bin/python --seed 1
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_tool_learning import GRPO, grpo_flags, run_script  # noqa: E402
from demo_table import machine  # noqa: E402


def trl_worker(steps: int, seed: int, model_path: str, train_file: str, out: str) -> None:
    """Runs in TRL's environment: GRPOTrainer for `steps` steps, timing each; the merged model saved in `out`."""
    import pyarrow.parquet as pq
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    sys.path.insert(0, str(ROOT))
    from common.rewards import last_number_reward
    from common.tools import TOOL_CALL_FRAMING, multiply

    rows = pq.read_table(train_file).to_pylist()
    data = Dataset.from_list([{"prompt": row["prompt"], "truth": row["reward_model"]["ground_truth"]} for row in rows])

    def reward(completions, truth, **kwargs):
        # the episode's last assistant turn, as hybridrl's multiply_tool reward reads it
        last = [[message for message in completion if message["role"] == "assistant"][-1] for completion in completions]
        return [last_number_reward(message.get("content") or "", answer) for message, answer in zip(last, truth)]

    config = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="bench_trl_tools_"),
        per_device_train_batch_size=16,  # grpo_flags' --micro-batch-size
        gradient_accumulation_steps=GRPO["prompts"] * GRPO["samples"] // 16,  # one optimiser step per generated batch
        num_generations=GRPO["samples"],
        max_completion_length=GRPO["response_tokens"],
        max_tool_calling_iterations=GRPO["max_turns"] - 1,
        temperature=1.0,
        learning_rate=GRPO["lr"],
        beta=GRPO["kl"],
        num_iterations=1,
        max_steps=steps,
        gradient_checkpointing=False,
        disable_dropout=True,
        bf16=True,
        use_cpu=not torch.cuda.is_available(),
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        seed=seed,
    )
    lora = LoraConfig(
        r=GRPO["lora_rank"],
        lora_alpha=GRPO["lora_alpha"],
        target_modules="all-linear",
        lora_dropout=0.0,
        task_type="CAUSAL_LM",
    )
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    kwargs = dict(model=model_path, reward_funcs=reward, args=config, train_dataset=data, peft_config=lora, tools=[multiply])
    try:
        trainer = GRPOTrainer(processing_class=tokenizer, **kwargs)
        refusal = None
    except ValueError as error:  # a chat template TRL has no response template for
        refusal = f"{type(error).__name__}: {error}"
        print(f"TRL refused the export's tokenizer: {refusal}", file=sys.stderr)
        tokenizer.response_template = TOOL_CALL_FRAMING
        trainer = GRPOTrainer(processing_class=tokenizer, **kwargs)
    per_step = []

    class StepTimes(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            self.started = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            per_step.append(time.perf_counter() - self.started)

    trainer.add_callback(StepTimes())
    trainer.train()
    trainer.model.merge_and_unload().to(torch.float32).save_pretrained(out)
    tokenizer.save_pretrained(out)
    logged = [row for row in trainer.state.log_history if "reward" in row]
    print(
        json.dumps(
            dict(
                step_seconds=per_step,
                refusal=refusal,
                reward=[row["reward"] for row in logged],
                tool_calls=[row.get("tools/call_frequency") for row in logged],
            )
        )
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trl-python", help="the Python of an environment with TRL installed")
    parser.add_argument("--results", default="bench_tool_learning.json", help="bench_tool_learning.py's JSON")
    parser.add_argument("--seed", type=int, default=1, help="the seed of bench_tool_learning.py's run to compare with")
    parser.add_argument("--out", default="bench_trl_tools.json")
    parser.add_argument("--trl-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--data", help=argparse.SUPPRESS)
    parser.add_argument("--save", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.trl_worker:
        trl_worker(args.steps, args.seed, args.model, args.data, args.save)
        sys.exit()
    if not args.trl_python:
        parser.error("--trl-python is missing: the Python of an environment with TRL (see above)")

    import pyarrow.parquet as pq

    sys.path.insert(0, str(ROOT))
    from common import demo

    cpu = machine()
    print(cpu, flush=True)
    results = json.loads(Path(args.results).read_text())
    [ours] = [result for result in results["seeds"] if result["seed"] == args.seed]
    steps, problems = results["settings"]["grpo_steps"], results["settings"]["val_problems"]
    work = Path(tempfile.mkdtemp(prefix="bench_trl_tools_"))
    _, train_file, val_file = demo.prepare("multiply_tool")
    val_subset = work / "val.parquet"
    pq.write_table(pq.read_table(val_file).slice(0, problems), val_subset)

    saved = work / "trl_model"
    command = [
        args.trl_python,
        __file__,
        "--trl-worker",
        "--model",
        ours["export"],
        "--data",
        train_file,
        "--save",
        str(saved),
    ]
    log = work / "trl.log"
    print(f"TRL's output, written as it runs (its steps and their step_time): {log}", flush=True)
    started = time.perf_counter()
    with open(log, "w") as output:  # written as it runs, so that a run stopped early still shows how far it got
        unbuffered = {**os.environ, "PYTHONUNBUFFERED": "1"}
        result = subprocess.run(
            [*command, "--steps", str(steps), "--seed", str(args.seed)], stdout=output, stderr=output, env=unbuffered
        )
    trl_seconds = time.perf_counter() - started
    lines = log.read_text().splitlines()
    if result.returncode != 0:
        raise RuntimeError(f"TRL's run failed (log in {log}):\n" + "\n".join(lines[-40:]))
    [trl] = [json.loads(line) for line in lines if line.startswith('{"step_seconds"')]
    # TRL's model judged as bench_tool_learning.py judged ours: grpo_hybrid.py's validation before its first step
    folder = work / "trl_after"
    folder.mkdir()
    data = ["--train-files", train_file, "--val-files", str(val_subset)]
    small = ["--train-batch-size", "2", "--mini-batch-size", "2", "--n", "2"]
    rows, _, _ = run_script("grpo_hybrid.py", ["--model-path", str(saved), *data, *grpo_flags(1), *small], folder)
    trl_after = rows[0]["val/accuracy"]
    trl_step = sum(trl["step_seconds"][1:]) / len(trl["step_seconds"][1:])  # the first step is left out, as ours

    summary = dict(
        cpu=cpu,
        seed=args.seed,
        export=ours["export"],
        hybridrl=ours,
        trl=dict(after=trl_after, step_seconds=trl_step, wall_seconds=trl_seconds, **trl),
    )
    Path(args.out).write_text(json.dumps(summary, indent=1) + "\n")
    print(f"\n{cpu}; {steps} steps of 8 prompts x 4 samples from the warm start of seed {args.seed}\n")
    print(f"| trainer | held-out accuracy ({problems} problems, greedy) before | after | seconds per step (steps 2 on) |")
    print("|---|---|---|---|")
    print(f"| hybridrl grpo_hybrid.py | {ours['warm_start']:.1%} | {ours['grpo']:.1%} | {ours['grpo_step_seconds']:.1f} |")
    print(f"| TRL GRPOTrainer | {ours['warm_start']:.1%} | {trl_after:.1%} | {trl_step:.1f} |")
    if trl["refusal"]:
        print(f"\nTRL refused the export's chat template, then ran with hybridrl's response template: {trl['refusal']}")
