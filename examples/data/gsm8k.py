"""GSM8K as verl-style parquet: `python examples/data/gsm8k.py --out-dir data/gsm8k`.

Downloads openai/gsm8k with the `datasets` library (pip install datasets) and
writes train.parquet and test.parquet, scored by the built-in `openai/gsm8k` reward.
"""

import argparse
import os

INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'


def convert(row: dict, split: str, index: int) -> dict:
    """One GSM8K row (question, answer ending in '#### <number>') as a prompt row."""
    ground_truth = row["answer"].split("####")[-1].strip().replace(",", "")
    return {
        "prompt": [{"role": "user", "content": f"{row['question']} {INSTRUCTION}"}],
        "data_source": "openai/gsm8k",
        "reward_model": {"ground_truth": ground_truth},
        "extra_info": {"split": split, "index": index},
    }


if __name__ == "__main__":
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", default="data/gsm8k")
    options = parser.parse_args()
    os.makedirs(options.out_dir, exist_ok=True)
    for split in ("train", "test"):
        rows = [convert(row, split, i) for i, row in enumerate(datasets.load_dataset("openai/gsm8k", "main", split=split))]
        pq.write_table(pa.Table.from_pylist(rows), os.path.join(options.out_dir, f"{split}.parquet"))
        print(f"{len(rows)} rows -> {options.out_dir}/{split}.parquet")
