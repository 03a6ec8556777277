"""RLHF end to end on this machine: a reward model trained here on preference pairs, then RL against its score alone.

1. Preference pairs from the demo's addition task, whose answers are checkable: for every prompt "a+b=", the right
   sum preferred to each wrong one of 0..18 (18 pairs a prompt, 1,800 in all), a fifth of them held out.
2. A reward model, trained here with the Bradley-Terry loss -log sigmoid(r(chosen) - r(rejected)): the demo's
   warm-started model with a one-label head (Qwen2ForSequenceClassification), reading each conversation as
   `--reward-model` does (common/reward_model.py). Its accuracy on the held-out pairs is printed.
3. `python algos/<algo>_hybrid.py --reward-model <it>` on the demo's prompts relabelled to a data source with no rule
   (`preference`), so that the model's score alone is the reward, with `--reward-model-coef 0`, so that validation
   scores the held-out problems by the rule alone (`val/reward/rule`), which the reward model never saw. Each
   validation also logs the reward model's mean score of the same answers (`val/reward/model`): the score rising
   while the rule's accuracy falls is reward hacking.

    python benchmarks/rlhf_demo.py                       # PPO and GRPO, seeds 1-3
    python benchmarks/rlhf_demo.py --algos grpo --seeds 1
"""

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

import torch
from demo_table import ALGOS, ROOT, fresh_cache, machine, run_demo, table_cells
from plot_runs import plot, require_matplotlib

sys.path.insert(0, str(ROOT))
from common.reward_model import render_conversations, reward_model_batch  # noqa: E402


def preference_pairs(problems, seed: int) -> tuple[list, list]:
    """(prompt, chosen, rejected) for every problem and every wrong answer of 0..18, shuffled: (train, held out)."""
    pairs = [(f"{a}+{b}=", str(a + b), str(wrong)) for a, b in problems for wrong in range(19) if wrong != a + b]
    random.Random(seed).shuffle(pairs)
    return pairs[len(pairs) // 5 :], pairs[: len(pairs) // 5]


def reward_scores(model, tokenizer, prompts: list[str], responses: list[str]) -> torch.Tensor:
    """The model's score of each conversation, read as RewardModelWorker reads it: the head at the last token."""
    messages = [[{"role": "user", "content": prompt}] for prompt in prompts]
    batch = reward_model_batch(render_conversations(messages, responses, tokenizer), tokenizer.pad_token_id)
    return model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, 0]


def bradley_terry_loss(chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
    """-log sigmoid(r(chosen) - r(rejected)), averaged over the pairs."""
    return -torch.nn.functional.logsigmoid(chosen - rejected).mean()


def pair_accuracy(model, tokenizer, pairs) -> float:
    prompts, chosen, rejected = zip(*pairs)
    with torch.no_grad():
        return (
            (reward_scores(model, tokenizer, prompts, chosen) > reward_scores(model, tokenizer, prompts, rejected))
            .float()
            .mean()
            .item()
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--algos", nargs="+", default=["ppo", "grpo"], choices=ALGOS, help="algorithms to run")
    parser.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3], help="seeds to run each algorithm with")
    parser.add_argument("--rm-epochs", type=int, default=30, help="passes of the reward model over its pairs")
    parser.add_argument("--plot", type=Path, default=Path("rlhf_demo.png"), help="the picture of the runs to write")
    args = parser.parse_args()
    require_matplotlib()

    print(machine(), flush=True)
    env = fresh_cache()
    cache = Path(env["HYBRIDRL_CACHE"])
    os.environ["HYBRIDRL_CACHE"] = str(cache)  # demo.prepare below finds what fresh_cache built
    import pyarrow.parquet as pq
    from transformers import AutoTokenizer, Qwen2ForSequenceClassification

    from common import demo

    policy_path, train_file, val_file = demo.prepare()

    # 1-2. The reward model, from the warm-started policy with a new head, trained on the pairs.
    started = time.perf_counter()
    warm, held_out_problems = demo.addition_problems()
    train_pairs, held_out_pairs = preference_pairs(warm + held_out_problems, seed=0)
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(policy_path)
    reward_model = Qwen2ForSequenceClassification.from_pretrained(policy_path, num_labels=1)
    reward_model.config.pad_token_id = tokenizer.pad_token_id
    optimizer = torch.optim.AdamW(reward_model.parameters(), lr=1e-3)
    for epoch in range(args.rm_epochs):
        random.Random(epoch).shuffle(train_pairs)
        for start in range(0, len(train_pairs), 128):
            prompts, chosen, rejected = zip(*train_pairs[start : start + 128])
            scores = reward_scores(reward_model, tokenizer, prompts * 2, chosen + rejected)
            loss = bradley_terry_loss(scores[: len(prompts)], scores[len(prompts) :])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    reward_model.eval()
    train_accuracy = pair_accuracy(reward_model, tokenizer, train_pairs)
    held_out_accuracy = pair_accuracy(reward_model, tokenizer, held_out_pairs)
    rm_path = cache / "reward_model"
    reward_model.save_pretrained(rm_path)
    tokenizer.save_pretrained(rm_path)
    print(
        f"reward model: {len(train_pairs)} pairs, {args.rm_epochs} epochs, {time.perf_counter() - started:.0f} s; "
        f"pair accuracy {train_accuracy:.1%} on its pairs, {held_out_accuracy:.1%} on {len(held_out_pairs)} held out",
        flush=True,
    )

    # 3. RL against the model's score alone; the rule only at validation.
    preference_file = cache / "preference_train.jsonl"
    rows = pq.read_table(train_file).to_pylist()
    preference_file.write_text("".join(json.dumps(row | {"data_source": "preference"}) + "\n" for row in rows))
    flags = ["--train-files", str(preference_file), "--val-files", val_file]
    flags += ["--reward-model", str(rm_path), "--reward-model-coef", "0"]
    print("| algorithm | seed | held-out accuracy before | after | wall time | best (step) | RM score at first, best, last |")
    print("|---|---|---|---|---|---|---|")
    run_dirs = []
    for algo in args.algos:
        for seed in args.seeds:
            result = run_demo(algo, seed, flags, env)
            run_dirs.append(result["run_dir"])
            metrics = [json.loads(line) for line in (result["run_dir"] / "metrics.jsonl").read_text().splitlines()]
            validations = [row for row in metrics if "val/reward/rule" in row]
            best = max(validations, key=lambda row: row["val/reward/rule"])
            model_scores = [f"{row['val/reward/model']:.2f}" for row in (validations[0], best, validations[-1])]
            print(
                f"| {algo} | {seed} | {table_cells(result)} | {best['val/reward/rule']:.0%} ({best['step']}) | "
                f"{' / '.join(model_scores)} |",
                flush=True,
            )
    plot(run_dirs, args.plot, f"against the reward model's score alone (training reward: its score); {machine()}")
