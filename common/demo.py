"""The built-in demos: a tiny model, a task, and a short supervised warm start.

A randomly initialised model rewarded with 0/1 collapses onto its most common
answer; a brief supervised warm start on some of the problems gives RL
something to improve. RL then trains on every problem and is judged on the
ones the warm start never saw. The tasks: single-digit addition, and with
`--env calculator` two-digit multiplication, which the tiny model cannot do
alone but can with the calculator tool (common/envs.py). A real model's tasks
have files only: the times tables, and the multiplication tool's transcripts
and prompts (sft_hybrid.py's demo, then RL). Everything is cached on disk under
$HYBRIDRL_CACHE (default ~/.cache/hybridrl), so a second run starts at once.

The addition warm start also teaches the model what it does not know: on the
held-out prompts it learns to spread its guesses evenly over the 19 answers (0
to 18), so that no held-out answer is ever shown as the right one. A warm start
on the known half alone guesses the other half with a confidence that hangs on
the floats of the initialisation, hence on the CPU: where it was confidently
wrong, RL never sampled the right answer, and the run ended near 80% on one CPU
and 92% on another. Spread evenly, every answer is sampled from the first step
on any CPU, and the scripts' demos keep the policy near that reference (a KL
coefficient of 0.2) so that a problem RL has not solved yet stays open instead
of collapsing onto a wrong answer.
"""

from __future__ import annotations

import os
import random
import shutil
import string
import tempfile
from pathlib import Path

import torch

CACHE_VERSION = "demo-v4"
CALCULATOR_CACHE_VERSION = "calculator-v1"
DEMO_SEED = 0
WARM_START_STEPS = 150
WARM_START_LR = 3e-3
CALCULATOR_WARM_PROBLEMS = 200
CALCULATOR_WARM_START_STEPS = 50
TIMES_TABLES_CACHE_VERSION = "times-tables-v1"
MULTIPLY_TOOL_CACHE_VERSION = "multiply-tool-v2"
# Transcripts for the warm start (and its held-out loss), prompts for RL and its held-out accuracy: disjoint problems.
MULTIPLY_TOOL_SIZES = {"sft_train": 2000, "sft_val": 100, "train": 1000, "val": 200}
MULTIPLY_QUESTIONS = (
    "What is {a} * {b}?",
    "Compute {a} times {b}.",
    "What is the product of {a} and {b}?",
    "Multiply {a} by {b}.",
)


def addition_problems() -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """All single-digit sums, split in half: (warm-start problems, held-out problems)."""
    problems = [(a, b) for a in range(10) for b in range(10)]
    random.Random(DEMO_SEED).shuffle(problems)
    return problems[:50], problems[50:]


def build_tiny_model(path: str, seed: int = DEMO_SEED) -> None:
    """A character-level tokenizer and a small Qwen2 initialised at random from `seed`, saved as an ordinary HF
    folder."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    specials = ["<pad>", "<eos>", "<unk>"]
    characters = [c for c in string.printable if c not in "\x0b\x0c\r"]
    vocab = {token: i for i, token in enumerate(specials + characters)}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens(specials)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    config = Qwen2Config(
        vocab_size=len(vocab),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        # head size 32: the smallest vLLM's CPU attention takes
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=128,
        tie_word_embeddings=True,
        pad_token_id=vocab["<pad>"],
        eos_token_id=vocab["<eos>"],
        bos_token_id=None,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    model.generation_config.eos_token_id = vocab["<eos>"]
    model.generation_config.pad_token_id = vocab["<pad>"]
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)


def multiplication_problems() -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """Products of two two-digit numbers that have four digits (the tiny model copies a fixed-length answer far more
    easily): (warm-start problems, held-out problems), 200 of each."""
    problems = [(a, b) for a in range(32, 100) for b in range(32, 100)]
    random.Random(DEMO_SEED).shuffle(problems)
    return problems[:CALCULATOR_WARM_PROBLEMS], problems[CALCULATOR_WARM_PROBLEMS : 2 * CALCULATOR_WARM_PROBLEMS]


def times_tables_problems() -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """Products of 2..19 by 2..9, split in half at random: (training problems, held-out problems). Asked as a bare
    "17 * 6 =", SmolLM2-135M-Instruct answers 15% of them right, greedily: it mostly talks around the question. Asked
    to "reply with the number only" it gets 54% right: it knows many products but does not answer directly."""
    problems = [(a, b) for a in range(2, 20) for b in range(2, 10)]
    random.Random(DEMO_SEED).shuffle(problems)
    return problems[:72], problems[72:]


def multiply_tool_problems() -> dict[str, list[tuple[int, int]]]:
    """Products of a 3-digit by a 2-digit number, too large for SmolLM2-135M to compute in its head, drawn without
    repeats into MULTIPLY_TOOL_SIZES' parts."""
    problems = random.Random(DEMO_SEED).sample([(a, b) for a in range(100, 1000) for b in range(10, 100)], 3300)
    parts, start = {}, 0
    for name, size in MULTIPLY_TOOL_SIZES.items():
        parts[name], start = problems[start : start + size], start + size
    return parts


def multiply_tool_transcript(a: int, b: int, question: str) -> list[dict]:
    """The user asks, the assistant calls the tool (OpenAI's and transformers' `tool_calls`), the tool answers, the
    assistant gives the number."""
    call = {"type": "function", "function": {"name": "multiply", "arguments": {"a": a, "b": b}}}
    return [
        {"role": "user", "content": question},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "name": "multiply", "content": str(a * b)},
        {"role": "assistant", "content": str(a * b)},
    ]


def calculator_transcript(a: int, b: int) -> list[tuple[str, bool]]:
    """An episode that uses the calculator well, as (text, written by the model) pieces after the prompt."""
    return [(f"[{a}*{b}]", True), (f"{a * b};", False), (str(a * b), True)]


def warm_start(
    path: str, examples: list[tuple[str, list[tuple[str, bool]]]], steps: int, memorise: list | None = None
) -> None:
    """Supervised fine-tuning on (prompt, pieces) examples, full batch, in this process: the loss covers the pieces
    the model writes, each followed by EOS when it is the last. With `memorise` (examples too), `steps` at least and
    then until the model answers each of them greedily, up to `steps` more: where the steps stop short of that depends
    on the CPU's floats."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(DEMO_SEED)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    input_ids, labels = sft_batch(tokenizer, examples)
    optimizer = torch.optim.AdamW(model.parameters(), lr=WARM_START_LR)
    check = sft_batch(tokenizer, memorise) if memorise else None
    step = 0
    while step < steps or (check is not None and not answers_greedily(model, *check, tokenizer)):
        if step == 2 * steps:
            raise RuntimeError(f"the warm start does not answer its {len(memorise)} problems greedily after {step} steps")
        loss = model(input_ids=input_ids, attention_mask=attention(input_ids, labels, tokenizer), labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        step += 1
    model.save_pretrained(path)


def sft_batch(tokenizer, examples: list[tuple[str, list[tuple[str, bool]]]]) -> tuple[torch.Tensor, torch.Tensor]:
    """The examples' tokens, padded, and their labels: the written pieces and the last EOS, -100 elsewhere."""
    sequences = []
    for prompt, pieces in examples:
        ids = tokenizer(prompt)["input_ids"]
        labels = [-100] * len(ids)
        for text, written in pieces:
            piece = tokenizer(text)["input_ids"]
            ids, labels = ids + piece, labels + (piece if written else [-100] * len(piece))
        sequences.append((ids + [tokenizer.eos_token_id], labels + [tokenizer.eos_token_id]))
    longest = max(len(ids) for ids, _ in sequences)
    input_ids = torch.full((len(sequences), longest), tokenizer.pad_token_id)
    labels = torch.full((len(sequences), longest), -100)
    for i, (ids, targets) in enumerate(sequences):
        input_ids[i, : len(ids)] = torch.tensor(ids)
        labels[i, : len(ids)] = torch.tensor(targets)
    return input_ids, labels


def attention(input_ids: torch.Tensor, labels: torch.Tensor, tokenizer) -> torch.Tensor:
    return (labels != -100) | (input_ids != tokenizer.pad_token_id)  # the EOS the pad token may equal is a label


@torch.no_grad()
def answers_greedily(model, input_ids: torch.Tensor, labels: torch.Tensor, tokenizer) -> bool:
    """Whether every labelled token is the model's most likely after those before it: greedy decoding writes them."""
    logits = model(input_ids=input_ids, attention_mask=attention(input_ids, labels, tokenizer)).logits[:, :-1]
    written = labels[:, 1:] != -100
    return bool((logits.argmax(-1)[written] == labels[:, 1:][written]).all())


def write_task(path: Path, problems: list[tuple[int, int]], operator: str = "+", data_source: str | None = None) -> None:
    """Verl-style rows "a+b=" (or "a*b="); with `data_source` given, "a * b =" rows of that data source."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    source = data_source or ("addition" if operator == "+" else "multiplication")
    spaced = " " if data_source else ""
    rows = [
        {
            "prompt": [{"role": "user", "content": f"{a}{spaced}{operator}{spaced}{b}{spaced}="}],
            "data_source": source,
            "reward_model": {"ground_truth": str(a + b if operator == "+" else a * b)},
            "extra_info": {"a": a, "b": b},
        }
        for a, b in problems
    ]
    pq.write_table(pa.Table.from_pylist(rows), path)


def build_addition(folder: Path, model_seed: int) -> None:
    warm, held_out = addition_problems()
    build_tiny_model(str(folder / "model"), model_seed)
    known = [(f"{a}+{b}=", [(str(a + b), True)]) for a, b in warm]
    # First its half alone, which sets the prompts apart: started on both halves at once, the model stayed on the
    # even spread for every prompt from one initialisation in four.
    warm_start(str(folder / "model"), known, WARM_START_STEPS)
    # Then each held-out prompt once with every answer 0..18 and each known problem as often, so that every prompt
    # weighs the same: the model keeps its half and spreads its guesses evenly over the answers on the other.
    answers = range(19)
    unknown = [(f"{a}+{b}=", [(str(answer), True)]) for a, b in held_out for answer in answers]
    warm_start(str(folder / "model"), known * len(answers) + unknown, WARM_START_STEPS, memorise=known)
    write_task(folder / "train.parquet", warm + held_out)
    write_task(folder / "val.parquet", held_out)


def build_calculator(folder: Path, model_seed: int) -> None:
    warm, held_out = multiplication_problems()
    build_tiny_model(str(folder / "model"), model_seed)
    examples = [(f"{a}*{b}=", calculator_transcript(a, b)) for a, b in warm]
    warm_start(str(folder / "model"), examples, CALCULATOR_WARM_START_STEPS)
    write_task(folder / "train.parquet", warm + held_out, "*")
    write_task(folder / "val.parquet", held_out, "*")


def build_times_tables(folder: Path, model_seed: int) -> None:
    """The task files only: the model is a real one (common/pretrained.py), so `model_seed` has no use here."""
    train, held_out = times_tables_problems()
    write_task(folder / "train.parquet", train, "*", data_source="times_tables")
    write_task(folder / "val.parquet", held_out, "*", data_source="times_tables")


def build_multiply_tool(folder: Path, model_seed: int) -> None:
    """The multiplication tool's files, for any model (`model_seed` has no use here): transcripts for the warm start
    (sft_train.jsonl, sft_val.jsonl: `messages` with `tool_calls`, and `tools`) and prompts for RL (train.parquet,
    val.parquet: data source multiply_tool, the product as ground truth; the tool comes from `--tools multiply`)."""
    import json

    import pyarrow as pa
    import pyarrow.parquet as pq
    from transformers.utils import get_json_schema

    from common.tools import multiply

    tools = [get_json_schema(multiply)]
    for name, problems in multiply_tool_problems().items():
        questions = [MULTIPLY_QUESTIONS[i % len(MULTIPLY_QUESTIONS)].format(a=a, b=b) for i, (a, b) in enumerate(problems)]
        transcripts = [multiply_tool_transcript(a, b, question) for (a, b), question in zip(problems, questions)]
        if name.startswith("sft"):
            rows = [{"messages": messages, "tools": tools} for messages in transcripts]
            (folder / f"{name}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
            continue
        rows = [
            {
                "prompt": messages[:1],  # the user's question
                "data_source": "multiply_tool",
                "reward_model": {"ground_truth": str(a * b)},
                "extra_info": {"a": a, "b": b},
            }
            for messages, (a, b) in zip(transcripts, problems)
        ]
        pq.write_table(pa.Table.from_pylist(rows), folder / f"{name}.parquet")


def prepare(task: str = "addition", model_seed: int = DEMO_SEED) -> tuple[str, str, str]:
    """Build (or reuse) the files of `task` ("addition", "calculator", "times_tables" or "multiply_tool") and, but
    for the real model's tasks, the warm-started tiny model: (model, train file, val file).

    `model_seed` draws another random initialisation of the tiny model, hence another warm-started model, as another
    CPU's floats would: benchmarks/demo_spread.py builds such starts, each in a cache folder of its own
    ($HYBRIDRL_CACHE), since the scripts take whatever model the cache holds."""
    from common.pretrained import cache_root

    root = cache_root()
    version = {
        "addition": CACHE_VERSION,
        "calculator": CALCULATOR_CACHE_VERSION,
        "times_tables": TIMES_TABLES_CACHE_VERSION,
        "multiply_tool": MULTIPLY_TOOL_CACHE_VERSION,
    }
    build = {
        "addition": build_addition,
        "calculator": build_calculator,
        "times_tables": build_times_tables,
        "multiply_tool": build_multiply_tool,
    }
    ready = root / version[task]
    if not (ready / "val.parquet").exists():
        root.mkdir(parents=True, exist_ok=True)
        # Built in a scratch folder and renamed when whole, so a crash never leaves a half cache.
        scratch = Path(tempfile.mkdtemp(dir=root))
        build[task](scratch, model_seed)
        try:
            os.rename(scratch, ready)
        except OSError:  # another process finished first
            shutil.rmtree(scratch, ignore_errors=True)
    return str(ready / "model"), str(ready / "train.parquet"), str(ready / "val.parquet")


# The real model's task: LoRA, as a user trains a real model on a small machine; the prompts' chat template is about
# 40 tokens, and 16 new tokens hold a direct answer ("17 * 6 = 102") with room to spare.
TIMES_TABLES_DEFAULTS = dict(
    lora_rank=16,
    lora_alpha=32,
    lr=2e-4,
    train_batch_size=8,
    n=8,
    mini_batch_size=8,
    micro_batch_size=64,
    total_steps=20,
    max_prompt_length=64,
    max_response_length=16,
    test_freq=5,
    val_batch_size=72,
)


def apply(args_cls, args, **settings):
    """Parse the command line again, with a built-in demo's model, data and defaults; flags the user wrote still win.

    Without --model-path: the tiny model on the addition task with the script's `settings` (on the user's
    --train-files, if any), or with `--env calculator` the multiplication task with the calculator tool. With a
    packaged real model (`--model-path smollm2`, see common/pretrained.py) and no --train-files: that model on the
    times tables, with TIMES_TABLES_DEFAULTS in place of the tiny model's `settings`. Any other --model-path is
    returned as it is.
    """
    import tyro

    from common.pretrained import MODELS
    from common.args import check_torchvision

    if args.model_path is not None and args.model_path not in MODELS:
        return args
    if args.env not in (None, "calculator") or (args.env and args.model_path):
        raise ValueError(
            f"--env {args.env} needs --model-path and --train-files: only --env calculator has a built-in demo, on the "
            "tiny model"
        )
    check_torchvision()  # building the model imports transformers' models
    if args.model_path in MODELS:
        _, train_file, val_file = prepare("times_tables")
        print(f"built-in demo: {args.model_path} on the times tables; demo defaults {TIMES_TABLES_DEFAULTS}")
        files = dict(train_files=[train_file], val_files=[val_file])
        return tyro.cli(args_cls, default=args_cls(model_path=args.model_path, **files, **TIMES_TABLES_DEFAULTS))
    model_path, train_file, val_file = prepare("addition" if args.env is None else "calculator")
    print(f"built-in demo: tiny model at {model_path}, {args.env or 'addition'} task; demo defaults {settings}")
    # Prompts like "7+8=" and answers like "15" plus EOS: every micro-batch fits in one forward. At the demo's
    # learning rates a tiny model's held-out accuracy swings by several points from one validation to the next
    # near the end; a learning rate that decays to 0 lets it settle. With the calculator, an episode like
    # "[37*48]" "1776;" "1776" plus EOS.
    # fp32: on an 81k-parameter model casting to bf16 costs more than it saves, and the demo table was measured so.
    task = dict(
        max_prompt_length=8, max_response_length=4, micro_batch_size=256, lr_schedule="cosine", compute_dtype="float32"
    )
    if args.env == "calculator":
        task |= dict(max_response_length=20, max_turns=3)
        settings |= dict(total_steps=100)  # it learns the tool within 25 steps
    demo_defaults = args_cls(model_path=model_path, train_files=[train_file], val_files=[val_file], **(task | settings))
    return tyro.cli(args_cls, default=demo_defaults)


# sft_hybrid.py's demo on the real model: the multiplication tool's transcripts through the built-in ChatML tool template
# (SmolLM2's own drops tools); LoRA, as the times tables train it. A prompt is about 250 tokens, the rest about 70.
WARM_START_DEFAULTS = dict(
    lora_rank=16,
    lora_alpha=32,
    lr=5e-4,
    train_batch_size=16,
    mini_batch_size=16,
    micro_batch_size=16,
    total_steps=20,
    max_prompt_length=320,
    max_response_length=96,
    test_freq=10,
    val_batch_size=100,
    chat_template="chatml_tools",
)


def apply_warm_start(args_cls, args):
    """sft_hybrid.py's arguments, with its built-in demo where asked for: with a packaged real model (`--model-path
    smollm2`) and no --train-files, the multiplication tool's transcripts (build_multiply_tool) and
    WARM_START_DEFAULTS; flags the user wrote still win. Any other run needs --model-path and --train-files."""
    import tyro

    from common.pretrained import MODELS

    if args.model_path is None or (args.model_path not in MODELS and not args.train_files):
        raise ValueError(
            "the warm start needs --model-path and --train-files (chat transcripts, docs/warm-start.md); its built-in "
            "demo is a real model's: --model-path smollm2 without --train-files"
        )
    if args.train_files:
        return args
    folder = Path(prepare("multiply_tool")[1]).parent
    files = dict(train_files=[str(folder / "sft_train.jsonl")], val_files=[str(folder / "sft_val.jsonl")])
    print(f"built-in demo: {args.model_path} learns to call multiply(a, b) from {folder}; demo defaults {WARM_START_DEFAULTS}")
    return tyro.cli(args_cls, default=args_cls(model_path=args.model_path, **files, **WARM_START_DEFAULTS))
