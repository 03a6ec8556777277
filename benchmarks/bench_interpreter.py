"""A real model learns a stateful tool: SmolLM2-135M-Instruct with a Python interpreter that keeps its variables for the
episode (common/python_env.py, `PythonInterpreter`), on sums of 5 to 7 three-digit numbers (reasoning-gym's
chain_sum, examples/reasoning_gym/interpreter_task.py): the base model, after a short warm start, after GRPO with the
interpreter; seeds 1-3; and with --trl-python, TRL 1.16's GRPOTrainer with the same class as its environment_factory,
from the same warm start at the same settings, side by side.

Each phase runs as a user runs it, in a process of its own:

1. the warm start, `sft_hybrid.py --model-path smollm2 --train-files sft_train.jsonl ... --total-steps 12`: transcripts
   that compute the sum in two calls of run_python, the second continuing from the first's variable `x`;
2. GRPO from its export, `grpo_hybrid.py --env common/python_env.py:PythonInterpreter --reward-fn
   examples/reasoning_gym/tasks.py:compute_score` (LoRA, 8 prompts x 4 samples a step, GRPO below);
3. with --trl-python, TRL's GRPOTrainer from the same export: `environment_factory=PythonInterpreter`, the same prompts,
   reward (the task's verifier on the last number of the last assistant turn) and settings. TRL offers every public
   method of an environment but reset and get_reward as a tool, `close` included, so TRL gets the class with `close`
   hidden (a subclass that sets it to None): its interpreters end at their next reset or when the run ends.

Every model (the base, each warm start, each GRPO export, TRL's merged model) is judged by one judge, outside both
trainers (`judge` below): the first --val-problems held-out problems (never in the transcripts nor in the RL prompts),
greedy, in bf16 where the CPU computes it natively (as --compute-dtype auto), token in token out as grpo_hybrid.py
plays an episode (the results framed by the chat template; at most GRPO["max_turns"] model turns and
GRPO["response_tokens"] tokens of response, a turn bounded only by what is left of them), each episode with an
interpreter of its own; scored by the task's verifier on the last turn. Reported: the held-out accuracy, the share of
episodes that called the tool (and, in the JSON, that called it more than once); the wall time of each phase's whole
process (start-up, validations, export) and its mean seconds a step (steps 2 on).

    python benchmarks/bench_interpreter.py                                        # seeds 1-3, hybridrl alone
    python benchmarks/bench_interpreter.py --seeds 1 --trl-python trl-env/bin/python

TRL is never a dependency of hybridrl: its environment is its own (`python -m venv trl-env && trl-env/bin/pip install
torch==2.13.0 trl==1.16.0 peft reasoning-gym==0.1.25`).
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_tool_learning import run_script  # noqa: E402
from demo_table import machine, write_table  # noqa: E402

ENV = f"{ROOT / 'common' / 'python_env.py'}:PythonInterpreter"
REWARD = f"{ROOT / 'examples' / 'reasoning_gym' / 'tasks.py'}:compute_score"
# GRPO's settings, given to TRL's GRPOTrainer too; the warm start's are the multiply demo's (common/demo.py).
GRPO = dict(
    prompts=8, samples=4, lora_rank=16, lora_alpha=32, lr=5e-4, kl=0.001, max_turns=4, prompt_tokens=320, response_tokens=192
)
SFT = dict(lora_rank=16, lora_alpha=32, lr=5e-4, batch=16)


def grpo_flags(steps: int) -> list[str]:
    settings = dict(GRPO, steps=steps)
    return [
        *["--env", ENV, "--reward-fn", REWARD, "--max-turns", str(GRPO["max_turns"])],  # paths may hold spaces
        *"--total-steps {steps} --test-freq {steps} --no-val-before-train".format_map(settings).split(),
        *"--train-batch-size {prompts} --mini-batch-size {prompts} --n {samples}".format_map(settings).split(),
        *"--lora-rank {lora_rank} --lora-alpha {lora_alpha} --lr {lr} --kl-loss-coef {kl}".format_map(settings).split(),
        *"--max-prompt-length {prompt_tokens} --max-response-length {response_tokens}".format_map(settings).split(),
        "--micro-batch-size",
        "16",
    ]


def sft_flags(steps: int) -> list[str]:
    settings = dict(SFT, steps=steps, prompt_tokens=GRPO["prompt_tokens"], response_tokens=GRPO["response_tokens"])
    return [
        *"--lora-rank {lora_rank} --lora-alpha {lora_alpha} --lr {lr} --micro-batch-size 16".format_map(settings).split(),
        *"--train-batch-size {batch} --mini-batch-size {batch}".format_map(settings).split(),
        *"--total-steps {steps} --test-freq {steps} --no-val-before-train --val-batch-size 100".format_map(settings).split(),
        *"--max-prompt-length {prompt_tokens} --max-response-length {response_tokens}".format_map(settings).split(),
        *"--chat-template chatml_tools".split(),
    ]


def judge(model_path: str, val_file: str, problems: int) -> dict:
    """The held-out accuracy of `model_path` (see the module's docstring), its tool-call shares and its episodes."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    sys.path.insert(0, str(ROOT / "examples" / "reasoning_gym"))
    from tasks import compute_score

    from common.pretrained import MODELS, resolve
    from common.python_env import PythonInterpreter
    from common.tools import CHAT_TEMPLATES, ToolResultFraming, call_tool, parse_tool_calls, tool_schema

    path = resolve(model_path) if model_path in MODELS else model_path
    tokenizer = AutoTokenizer.from_pretrained(path)
    if "<tool_call>" not in (tokenizer.chat_template or ""):  # the base model's plain ChatML: the warm start's template
        tokenizer.chat_template = (CHAT_TEMPLATES / "chatml_tools.jinja").read_text()
    bf16 = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()  # as --compute-dtype auto
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16 if bf16 else torch.float32).eval()
    rows = pq.read_table(val_file).slice(0, problems).to_pylist()
    envs = [PythonInterpreter() for _ in rows]
    schema = tool_schema(envs[0].run_python, "PythonInterpreter")
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    framing = ToolResultFraming(tokenizer, ["<|im_end|>"])
    prompts = [tokenizer.apply_chat_template(row["prompt"], tools=[schema], add_generation_prompt=True) for row in rows]
    prompts = [list(p["input_ids"] if isinstance(p, dict) or hasattr(p, "keys") else p) for p in prompts]
    response = [[] for _ in rows]
    calls, last = [0] * len(rows), [""] * len(rows)
    playing = list(range(len(rows)))
    try:
        for _ in range(GRPO["max_turns"]):
            if not playing:
                break
            contexts = [prompts[i] + response[i] for i in playing]
            width = max(map(len, contexts))
            ids = torch.tensor([[end] * (width - len(c)) + c for c in contexts])
            mask = torch.tensor([[0] * (width - len(c)) + [1] * len(c) for c in contexts])
            room = max(GRPO["response_tokens"] - len(response[i]) for i in playing)  # as grpo_hybrid.py: no bound a turn
            with torch.no_grad():
                greedy = dict(max_new_tokens=room, do_sample=False, eos_token_id=end, pad_token_id=end)
                out = model.generate(input_ids=ids, attention_mask=mask, **greedy)
            still = []
            for row, tokens in zip(playing, out[:, width:].tolist()):
                tokens = tokens[: tokens.index(end) + 1] if end in tokens else tokens
                tokens = tokens[: GRPO["response_tokens"] - len(response[row])]
                context = tokenizer.decode(prompts[row] + response[row])
                response[row] += tokens
                text = tokenizer.decode(tokens)
                last[row] = tokenizer.decode(tokens, skip_special_tokens=True)
                if not tokens or tokens[-1] != end:  # out of tokens
                    continue
                parsed = parse_tool_calls(tokenizer, text, context, [schema])
                if not parsed:
                    continue
                calls[row] += len(parsed)
                results = []
                for call in parsed:
                    if "error" in call:
                        results.append(call["error"])
                    elif call["name"] != "run_python":
                        results.append(f"error: there is no tool {call['name']}; the tools: run_python")
                    else:
                        results.append(call_tool(envs[row].run_python, schema, call["arguments"])[0])
                answer = framing(parsed, results, ended_with_eos=True)
                if len(response[row]) + len(answer) >= GRPO["response_tokens"]:
                    continue
                response[row] += answer
                still.append(row)
            playing = still
    finally:
        for env in envs:
            env.close()
    scores = [compute_score(row["data_source"], text, None, row["extra_info"])["score"] for row, text in zip(rows, last)]
    episodes = [dict(answer=text, calls=n, score=s) for text, n, s in zip(last, calls, scores)]
    return dict(
        accuracy=sum(scores) / len(rows),
        right=int(sum(scores)),
        problems=len(rows),
        tool_share=sum(n > 0 for n in calls) / len(rows),
        several_calls_share=sum(n > 1 for n in calls) / len(rows),
        episodes=episodes[:8],
    )


def judged(model_path: str, val_file: str, problems: int) -> dict:
    """`judge` in a process of its own (this file with --judge), with its wall time."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    command = [sys.executable, __file__, "--judge", model_path, "--val-file", val_file, "--val-problems", str(problems)]
    started = time.perf_counter()
    result = subprocess.run(command, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"judging {model_path} failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.splitlines()[-1]) | dict(judge_seconds=time.perf_counter() - started)


def trl_worker(steps: int, seed: int, model_path: str, train_file: str, out: str) -> None:
    """Runs in TRL's environment: GRPOTrainer with environment_factory=PythonInterpreter for `steps` steps, timing each;
    the merged model saved in `out`."""
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "examples" / "reasoning_gym"))
    from tasks import compute_score

    from common.python_env import PythonInterpreter
    from common.tools import TOOL_CALL_FRAMING

    data = Dataset.from_list(pq.read_table(train_file).to_pylist())  # every column, which reset gets

    def reward(completions, data_source, extra_info, **kwargs):
        last = [[message for message in completion if message["role"] == "assistant"][-1] for completion in completions]
        return [
            compute_score(source, message.get("content") or "", None, info)["score"]
            for message, source, info in zip(last, data_source, extra_info)
        ]

    # TRL offers every public method but reset and get_reward as a tool: close is hidden from it.
    environment = type("PythonInterpreter", (PythonInterpreter,), {"close": None})
    config = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="bench_interpreter_trl_"),
        per_device_train_batch_size=16,
        gradient_accumulation_steps=max(1, GRPO["prompts"] * GRPO["samples"] // 16),  # one optimiser step a batch
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
    kwargs = dict(model=model_path, reward_funcs=reward, args=config, train_dataset=data, peft_config=lora)
    kwargs["environment_factory"] = environment
    try:
        trainer = GRPOTrainer(processing_class=tokenizer, **kwargs)
        refusal = None
    except ValueError as error:  # a chat template TRL has no response template for (bench_trl_tools.py)
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
    tool_calls = [row.get("tools/call_frequency") for row in logged]
    rewards = [row["reward"] for row in logged]
    print(json.dumps(dict(step_seconds=per_step, refusal=refusal, reward=rewards, tool_calls=tool_calls)))


def run_trl(trl_python: str, steps: int, seed: int, export: str, train_file: str, work: Path) -> dict:
    saved, log = work / f"trl_model_{seed}", work / f"trl_{seed}.log"
    command = [trl_python, __file__, "--trl-worker", "--model", export, "--data", train_file, "--save", str(saved)]
    command += ["--prompts", str(GRPO["prompts"])]
    print(f"TRL's output, written as it runs: {log}", flush=True)
    started = time.perf_counter()
    with open(log, "w") as output:
        unbuffered = {**os.environ, "PYTHONUNBUFFERED": "1"}
        result = subprocess.run(
            [*command, "--steps", str(steps), "--seed", str(seed)], stdout=output, stderr=output, env=unbuffered
        )
    seconds = time.perf_counter() - started
    lines = log.read_text().splitlines()
    if result.returncode != 0:
        raise RuntimeError(f"TRL's run failed (log in {log}):\n" + "\n".join(lines[-40:]))
    [trl] = [json.loads(line) for line in lines if line.startswith('{"step_seconds"')]
    return trl | dict(wall_seconds=seconds, model=str(saved), step_mean=sum(trl["step_seconds"][1:]) / (steps - 1))


def cell(result: dict | None) -> str:
    if result is None:
        return ""
    return f"{result['accuracy']:.1%} ({result['right']}/{result['problems']}); calls {result['tool_share']:.0%}"


def phase_base(results: dict, files: dict, args, work: Path) -> None:
    results["base"] = judged("smollm2", files["val"], args.val_problems)
    print(f"base model: {cell(results['base'])}", flush=True)


def phase_sft(result: dict, files: dict, args, work: Path) -> None:
    if "export" in result:  # trained by an earlier run of this command that stopped before the judge
        result["warm_start"] = judged(result["export"], files["val"], args.val_problems)
        print(f"seed {result['seed']}: warm start {cell(result['warm_start'])}", flush=True)
        return
    folder = work / f"sft_{result['seed']}"
    folder.mkdir()
    data = ["--train-files", files["sft_train"], "--val-files", files["sft_val"]]
    flags = ["--model-path", "smollm2", "--seed", str(result["seed"]), *data, *sft_flags(args.sft_steps)]
    _, run_dir, seconds = run_script("sft_hybrid.py", flags, folder)
    result |= dict(sft_seconds=seconds, export=str(run_dir / "model"))
    args.save()
    result["warm_start"] = judged(result["export"], files["val"], args.val_problems)
    print(f"seed {result['seed']}: warm start {cell(result['warm_start'])} ({seconds:.0f} s)", flush=True)


def phase_grpo(result: dict, files: dict, args, work: Path) -> None:
    if "grpo_model" not in result:  # else trained by an earlier run of this command that stopped before the judge
        folder = work / f"grpo_{result['seed']}"
        folder.mkdir()
        # its own validation at the last step on 8 held-out problems alone: the judge's is the one reported
        few = work / "val_8.parquet"
        pq.write_table(pq.read_table(files["val"]).slice(0, 8), few)
        data = ["--train-files", files["train"], "--val-files", str(few), "--val-batch-size", "8"]
        flags = ["--model-path", result["export"], "--seed", str(result["seed"]), *data, *grpo_flags(args.grpo_steps)]
        rows, run_dir, seconds = run_script("grpo_hybrid.py", flags, folder)
        steps = [row for row in rows if "timing/step" in row]
        result |= dict(
            grpo_model=str(run_dir / "model"),
            grpo_seconds=seconds,
            grpo_step_seconds=sum(row["timing/step"] for row in steps[1:]) / max(1, len(steps) - 1),  # the first left out
            grpo_reward=[row.get("train/reward_mean") for row in steps],
            grpo_tool_calls=[row.get("env/tool_calls") for row in steps],
        )
        args.save()
    result["grpo"] = judged(result["grpo_model"], files["val"], args.val_problems)
    print(f"seed {result['seed']}: GRPO {cell(result['grpo'])} ({result['grpo_seconds']:.0f} s)", flush=True)


def phase_trl(result: dict, files: dict, args, work: Path) -> None:
    if "trl_log" not in result:  # trained by an earlier run of this command that stopped before the judge
        trl = run_trl(args.trl_python, args.grpo_steps, result["seed"], result["export"], files["train"], work)
        result |= dict(trl_seconds=trl["wall_seconds"], trl_step_seconds=trl["step_mean"], trl_log=trl)
        args.save()
    result["trl"] = judged(result["trl_log"]["model"], files["val"], args.val_problems)
    print(f"seed {result['seed']}: TRL {cell(result['trl'])} ({result['trl_seconds']:.0f} s)", flush=True)


def table(results: dict, args, cpu: str) -> list[str]:
    seeds = [results[str(seed)] for seed in args.seeds if str(seed) in results]

    def row(name, key, wall, per_step=None):
        walls = ", ".join(f"{r[wall]:.0f} s" for r in seeds if wall in r)
        steps = ", ".join(f"{r[per_step]:.1f}" for r in seeds if per_step in r)
        return f"| {name} | {' | '.join(cell(r.get(key)) for r in seeds)} | {walls} | {steps} |"

    base = results.get("base")
    lines = [
        f"{cpu}; the first {args.val_problems} held-out problems, greedy, every model judged alike; calls: the share of "
        f"episodes that ran the tool; GRPO and TRL: {GRPO['prompts']} prompts x {GRPO['samples']} samples a step",
        "",
        "| SmolLM2-135M-Instruct | " + " | ".join(f"seed {r['seed']}" for r in seeds) + " | wall time | seconds a step |",
        "|---|" + "---|" * len(seeds) + "---|---|",
        f"| the base model | {' | '.join(cell(base) for _ in seeds)} | | |",
        row(f"after a warm start of {args.sft_steps} steps (`sft_hybrid.py`)", "warm_start", "sft_seconds"),
        row(f"then GRPO, {args.grpo_steps} steps (`grpo_hybrid.py --env`)", "grpo", "grpo_seconds", "grpo_step_seconds"),
        row(f"then TRL's `GRPOTrainer` instead, {args.grpo_steps} steps", "trl", "trl_seconds", "trl_step_seconds"),
    ]
    return lines


PHASES = dict(base=phase_base, sft=phase_sft, grpo=phase_grpo, trl=phase_trl)

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, nargs="+", default=[1, 2, 3])
    parser.add_argument("--sft-steps", type=int, default=12, help="warm start steps (16 transcripts each)")
    parser.add_argument("--grpo-steps", type=int, default=8)
    parser.add_argument("--prompts", type=int, default=GRPO["prompts"], help="prompts a GRPO step (4 samples each)")
    parser.add_argument("--val-problems", type=int, default=64, help="held-out problems each judgement answers")
    parser.add_argument("--trl-python", help="the Python of an environment with TRL: its GRPOTrainer runs beside ours")
    parser.add_argument(
        "--phases", nargs="+", choices=list(PHASES), default=list(PHASES), help="what to run now (trl needs --trl-python)"
    )
    parser.add_argument(
        "--work", help="the folder of the runs and their results.json; a phase already there is not run again (default: new)"
    )
    parser.add_argument("--out", default="bench_interpreter.md", help="the table; its JSON goes beside it (.json)")
    parser.add_argument("--judge", help=argparse.SUPPRESS)
    parser.add_argument("--val-file", help=argparse.SUPPRESS)
    parser.add_argument("--trl-worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--steps", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--data", help=argparse.SUPPRESS)
    parser.add_argument("--save", help=argparse.SUPPRESS)
    args = parser.parse_args()
    GRPO["prompts"] = args.prompts
    if args.judge:
        print(json.dumps(judge(args.judge, args.val_file, args.val_problems)))
        sys.exit()
    if args.trl_worker:
        trl_worker(args.steps, args.seed, args.model, args.data, args.save)
        sys.exit()
    phases = [p for p in args.phases if p != "trl" or args.trl_python]

    sys.path.insert(0, str(ROOT / "examples" / "reasoning_gym"))
    import interpreter_task

    cpu = machine()
    print(cpu, flush=True)
    work = Path(args.work or tempfile.mkdtemp(prefix="bench_interpreter_"))
    work.mkdir(parents=True, exist_ok=True)
    saved = work / "results.json"
    results = json.loads(saved.read_text()) if saved.exists() else {}
    files = interpreter_task.write(str(work / "data"))
    args.save = lambda: saved.write_text(json.dumps(results, indent=1) + "\n")
    for phase in phases:
        for seed in [None] if phase == "base" else args.seeds:
            result = results if seed is None else results.setdefault(str(seed), dict(seed=seed))
            done = "base" in results if seed is None else {"sft": "warm_start"}.get(phase, phase) in result
            if done or (phase in ("grpo", "trl") and "export" not in result):
                continue
            PHASES[phase](result, files, args, work)
            args.save()
    settings = {k: v for k, v in vars(args).items() if k != "save"} | {"grpo": GRPO, "sft": SFT}
    write_table(table(results, args, cpu), args.out, dict(cpu=cpu, settings=settings, results=results))
    print(f"the runs: {work}")
