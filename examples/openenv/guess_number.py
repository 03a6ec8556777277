"""An OpenEnv environment written on openenv-core's base classes, and its prompts: guess a number from 1 to 10 (the
turn's last number is its guess), told "higher" or "lower" after each wrong guess; 1 for finding it within 4 guesses, 0
for a turn without a number or for running out. The run serves the app of its create_app (`openenv:...:app`),
or makes the class in-process (`openenv:...:GuessNumber`); a row's `seed` column picks the number.

    python examples/openenv/guess_number.py --out data/openenv_guess        # train.parquet (256 games), val.parquet (32)
    python algos/grpo_hybrid.py --model-path smollm2 --env openenv:examples/openenv/guess_number.py:app \
        --train-files data/openenv_guess/train.parquet --val-files data/openenv_guess/val.parquet --max-turns 4 \
        --max-prompt-length 256 --max-response-length 128
"""

import argparse
import random
import re
from pathlib import Path

from openenv.core import Action, Environment, Observation, State, create_app

INSTRUCTION = "Guess my number from 1 to 10. Answer each turn with one guess in square brackets, like [5], and nothing else."
GUESSES = 4


class Guess(Action):
    guess: str


class Hint(Observation):
    hint: str


class GuessNumber(Environment[Guess, Hint, State]):
    SUPPORTS_CONCURRENT_SESSIONS = True  # each session its own instance

    def reset(self, seed=None, episode_id=None, **kwargs) -> Hint:
        self.number, self.guesses = random.Random(seed).randint(1, 10), 0
        return Hint(hint=" Your first guess?")

    def step(self, action: Guess, timeout_s=None, **kwargs) -> Hint:
        self.guesses += 1
        numbers = re.findall(r"\d+", action.guess)
        if not numbers:
            return Hint(hint="No number: the game ends.", reward=0.0, done=True)
        guess = int(numbers[-1])
        if guess == self.number:
            return Hint(hint="Right!", reward=1.0, done=True)
        hint = "Higher." if guess < self.number else "Lower."
        return Hint(hint=hint, reward=0.0, done=self.guesses >= GUESSES)

    @property
    def state(self) -> State:
        return State(step_count=self.guesses)


app = create_app(GuessNumber, Guess, Hint, max_concurrent_envs=256)


def rows(seeds: range) -> dict:
    return {"prompt": [[{"role": "user", "content": INSTRUCTION}] for _ in seeds], "seed": list(seeds)}


if __name__ == "__main__":
    import pyarrow as pa
    import pyarrow.parquet as pq

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="data/openenv_guess", help="the folder for train.parquet and val.parquet")
    out = Path(parser.parse_args().out)
    out.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(rows(range(256))), out / "train.parquet")
    pq.write_table(pa.table(rows(range(10_000, 10_032))), out / "val.parquet")  # games no training prompt plays
    print(f"wrote {out / 'train.parquet'} and {out / 'val.parquet'}")
