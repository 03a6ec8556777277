"""The built-in demo: a tiny model, an addition task, and a short supervised warm start.

A randomly initialised model rewarded with 0/1 collapses onto its most common
answer; a brief supervised warm start on half of the problems gives RL
something to improve. RL then trains on every problem and is judged on the
half the warm start never saw. Everything is cached on disk under
$HYBRIDRL_CACHE (default ~/.cache/hybridrl), so a second run starts at once.
"""

from __future__ import annotations

import os
import random
import shutil
import string
import tempfile
from pathlib import Path

import torch

CACHE_VERSION = "demo-v2"
DEMO_SEED = 0
WARM_START_STEPS = 150
WARM_START_LR = 3e-3


def addition_problems() -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """All single-digit sums, split in half: (warm-start problems, held-out problems)."""
    problems = [(a, b) for a in range(10) for b in range(10)]
    random.Random(DEMO_SEED).shuffle(problems)
    return problems[:50], problems[50:]


def build_tiny_model(path: str) -> None:
    """A character-level tokenizer and a small random Qwen2, saved as an ordinary HF folder."""
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
    torch.manual_seed(DEMO_SEED)
    model = Qwen2ForCausalLM(config)
    model.generation_config.eos_token_id = vocab["<eos>"]
    model.generation_config.pad_token_id = vocab["<pad>"]
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)


def warm_start(path: str, problems: list[tuple[int, int]]) -> None:
    """Supervised fine-tuning on `problems`, full batch, in this process."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(DEMO_SEED)
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path)
    prompts = [tokenizer(f"{a}+{b}=")["input_ids"] for a, b in problems]
    answers = [tokenizer(str(a + b))["input_ids"] + [tokenizer.eos_token_id] for a, b in problems]
    longest = max(len(p) + len(a) for p, a in zip(prompts, answers))
    input_ids = torch.full((len(problems), longest), tokenizer.pad_token_id)
    labels = torch.full((len(problems), longest), -100)
    for i, (prompt, answer) in enumerate(zip(prompts, answers)):
        sequence = prompt + answer
        input_ids[i, : len(sequence)] = torch.tensor(sequence)
        labels[i, len(prompt) : len(sequence)] = torch.tensor(answer)
    optimizer = torch.optim.AdamW(model.parameters(), lr=WARM_START_LR)
    for _ in range(WARM_START_STEPS):
        loss = model(
            input_ids=input_ids, attention_mask=(labels != -100) | (input_ids != tokenizer.pad_token_id), labels=labels
        ).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.save_pretrained(path)


def write_task(path: Path, problems: list[tuple[int, int]]) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [
        {
            "prompt": [{"role": "user", "content": f"{a}+{b}="}],
            "data_source": "addition",
            "reward_model": {"ground_truth": str(a + b)},
            "extra_info": {"a": a, "b": b},
        }
        for a, b in problems
    ]
    pq.write_table(pa.Table.from_pylist(rows), path)


def prepare() -> tuple[str, str, str]:
    """Build (or reuse) the warm-started model and the task files: (model, train file, val file)."""
    root = Path(os.environ.get("HYBRIDRL_CACHE", Path.home() / ".cache" / "hybridrl"))
    ready = root / CACHE_VERSION
    if not (ready / "model" / "config.json").exists():
        root.mkdir(parents=True, exist_ok=True)
        # Built in a scratch folder and renamed when whole, so a crash never leaves a half cache.
        scratch = Path(tempfile.mkdtemp(dir=root))
        warm, held_out = addition_problems()
        build_tiny_model(str(scratch / "model"))
        warm_start(str(scratch / "model"), warm)
        write_task(scratch / "train.parquet", warm + held_out)
        write_task(scratch / "val.parquet", held_out)
        try:
            os.rename(scratch, ready)
        except OSError:  # another process finished first
            shutil.rmtree(scratch, ignore_errors=True)
    return str(ready / "model"), str(ready / "train.parquet"), str(ready / "val.parquet")


def apply(args_cls, **settings):
    """Parse the command line again, with the demo's model and data, the task's lengths and `settings` as defaults.

    Flags the user wrote still win; only the defaults change.
    """
    import tyro

    from common.rollout import check_torchvision

    check_torchvision()  # building the model imports transformers' models
    model_path, train_file, val_file = prepare()
    print(f"built-in demo: tiny model at {model_path}, addition task; demo defaults {settings}")
    # Prompts like "7+8=" and answers like "15" plus EOS: every micro-batch fits in one forward. At the demo's
    # learning rates a tiny model's held-out accuracy swings by several points from one validation to the next
    # near the end; a learning rate that decays to 0 lets it settle.
    task = dict(max_prompt_length=8, max_response_length=4, micro_batch_size=256, lr_schedule="cosine")
    demo_defaults = args_cls(model_path=model_path, train_files=[train_file], val_files=[val_file], **(task | settings))
    return tyro.cli(args_cls, default=demo_defaults)
