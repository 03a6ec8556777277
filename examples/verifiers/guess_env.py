"""A verifiers environment written on its MultiTurnEnv API, and its prompts: guess a number from 1 to 10 (the turn's
last number is its guess), told "higher" or "lower" after each wrong guess, 4 turns at most; its rubric pays 1 for the
number found and 0.2 for a last turn that holds a number at all. The rows carry the number as `ground_truth`.

    python examples/verifiers/guess_env.py --out data/verifiers_guess       # train.parquet (256 games), val.parquet (32)
    python algos/grpo_hybrid.py --model-path smollm2 --env verifiers:examples/verifiers/guess_env.py \
        --train-files data/verifiers_guess/train.parquet --val-files data/verifiers_guess/val.parquet --max-turns 4 \
        --max-prompt-length 256 --max-response-length 128
"""

import argparse
import random
import re
from pathlib import Path

import verifiers as vf
from datasets import Dataset
from verifiers.types import UserMessage

INSTRUCTION = "Guess my number from 1 to 10. Answer each turn with one guess in square brackets, like [5], and nothing else."


def last_number(text) -> int | None:
    numbers = re.findall(r"\d+", text or "")
    return int(numbers[-1]) if numbers else None


class GuessNumber(vf.MultiTurnEnv):
    async def env_response(self, messages, state, **kwargs):
        guess, number = last_number(messages[-1].content), int(state["answer"])
        if guess is None or guess == number:
            state["final_env_response"] = [UserMessage(content="Right!" if guess == number else "No number: the end.")]
            return state["final_env_response"]
        return [UserMessage(content="Higher." if guess < number else "Lower.")]


def found(completion, answer) -> float:
    return float(any(m.role == "assistant" and last_number(m.content) == int(answer) for m in completion))


def guessed(completion) -> float:
    turns = [m for m in completion if m.role == "assistant"]
    return float(bool(turns) and last_number(turns[-1].content) is not None)


def rows(seeds: range) -> dict:
    numbers = [random.Random(seed).randint(1, 10) for seed in seeds]
    return {"prompt": [[{"role": "user", "content": INSTRUCTION}] for _ in seeds], "ground_truth": [str(n) for n in numbers]}


def load_environment() -> vf.MultiTurnEnv:
    dataset = Dataset.from_dict({"question": [INSTRUCTION] * 4, "answer": rows(range(4))["ground_truth"]})
    return GuessNumber(dataset=dataset, rubric=vf.Rubric(funcs=[found, guessed], weights=[1.0, 0.2]), max_turns=4)


if __name__ == "__main__":
    import pyarrow as pa
    import pyarrow.parquet as pq

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="data/verifiers_guess", help="the folder for train.parquet and val.parquet")
    out = Path(parser.parse_args().out)
    out.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(rows(range(256))), out / "train.parquet")
    pq.write_table(pa.table(rows(range(10_000, 10_032))), out / "val.parquet")  # games no training prompt plays
    print(f"wrote {out / 'train.parquet'} and {out / 'val.parquet'}")
