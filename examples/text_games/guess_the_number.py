"""Prompts for TextArena's GuessTheNumber-v0 (`--env textarena:GuessTheNumber-v0`): one row a game, its `seed`
column seeding the game's number, so that a prompt's samples play the same game. The game's rules and its first
observation join the prompt's user message when the episode starts; nothing is downloaded.

    python examples/text_games/guess_the_number.py --out data/guess       # train.parquet (256 games), val.parquet (32)
    python algos/grpo_hybrid.py --model-path smollm2 --env textarena:GuessTheNumber-v0 \
        --train-files data/guess/train.parquet --val-files data/guess/val.parquet --max-turns 6 \
        --max-prompt-length 512 --max-response-length 256
"""

import argparse
from pathlib import Path

INSTRUCTION = "Play the game below. Answer each turn with one guess, a number in square brackets, and nothing else.\n\n"


def rows(seeds: range) -> dict:
    return {"prompt": [[{"role": "user", "content": INSTRUCTION}] for _ in seeds], "seed": list(seeds)}


if __name__ == "__main__":
    import pyarrow as pa
    import pyarrow.parquet as pq

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="data/guess", help="the folder for train.parquet and val.parquet")
    out = Path(parser.parse_args().out)
    out.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(rows(range(256))), out / "train.parquet")
    pq.write_table(pa.table(rows(range(10_000, 10_032))), out / "val.parquet")  # games no training prompt plays
    print(f"wrote {out / 'train.parquet'} and {out / 'val.parquet'}")
