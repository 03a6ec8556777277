"""MATH as verl-style parquet: `python examples/data/hendrycks_math.py --out-dir data/math`.

Downloads the MATH competition problems (DigitalLearningGmbH/MATH-lighteval) with
the `datasets` library and writes train.parquet and test.parquet, scored by the
built-in `math` reward (pip install -e ".[math]").
"""

import argparse
import os

INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."


def last_boxed(text: str) -> str | None:
    """The contents of the last \\boxed{...} in `text`, nested braces included."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, position = 0, start + len("\\boxed{")
    for end in range(position, len(text)):
        if text[end] == "{":
            depth += 1
        elif text[end] == "}":
            if depth == 0:
                return text[position:end]
            depth -= 1
    return None


def convert(row: dict, split: str, index: int) -> dict:
    """One MATH row (problem, solution with a boxed answer) as a prompt row."""
    ground_truth = last_boxed(row["solution"])
    if ground_truth is None:
        raise ValueError(f"MATH {split} row {index}: the solution has no \\boxed{{}} answer")
    return {
        "prompt": [{"role": "user", "content": f"{row['problem']} {INSTRUCTION}"}],
        "data_source": "math",
        "reward_model": {"ground_truth": ground_truth},
        "extra_info": {"split": split, "index": index, "level": row.get("level"), "type": row.get("type")},
    }


if __name__ == "__main__":
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out-dir", default="data/math")
    options = parser.parse_args()
    os.makedirs(options.out_dir, exist_ok=True)
    for split in ("train", "test"):
        source = datasets.load_dataset("DigitalLearningGmbH/MATH-lighteval", split=split)
        rows = [convert(row, split, i) for i, row in enumerate(source)]
        pq.write_table(pa.Table.from_pylist(rows), os.path.join(options.out_dir, f"{split}.parquet"))
        print(f"{len(rows)} rows -> {options.out_dir}/{split}.parquet")
