"""A task where an interpreter that keeps its variables helps: reasoning-gym's `chain_sum` (sums and differences of 5 to 7
three-digit numbers), for the Python interpreter environment (common/python_env.py, `PythonInterpreter`), with
warm-start transcripts that compute it in two calls, the second continuing from the first's variable.

    python examples/reasoning_gym/interpreter_task.py --out-dir data/chain_sum_python

writes, from questions generated on this machine (no download; none in two files):

| file | rows | what |
|---|---|---|
| `sft_train.jsonl`, `sft_val.jsonl` | 2,000, 100 | transcripts (sft_hybrid.py): `messages` with `tool_calls`, and `tools` |
| `train.parquet`, `val.parquet` | 1,000, 200 | RL prompts as examples/reasoning_gym/tasks.py writes them (last-number) |

A transcript: the user asks ("State the final answer to the following arithmetic problem: 361 - 220 - 607 + 879 + 560
= Reply with the number only."); the assistant runs `x = 361 - 220 - 607` and shows `x` (-466), then `x = x + 879 +
560` and shows `x` (973): the running total stays in the interpreter, never copied back by the model; then it answers
`973`. The reward is the task's own verifier on the last number of the episode's last turn:
`--reward-fn examples/reasoning_gym/tasks.py:compute_score`.
"""

import argparse
import json
import math
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tasks import generate  # noqa: E402

TASK = "chain_sum"
CONFIG = dict(min_terms=5, max_terms=7, min_digits=3, max_digits=3)
SIZES = {"sft_train": 2000, "sft_val": 100, "train": 1000}  # drawn from reasoning-gym's training split
VAL_SIZE = 200  # its held-out split


def steps_of(expression: str) -> list[str]:
    """The code of each call: the first half of the terms into `x`, then `x` with the rest; each shows `x`."""
    words = expression.split()  # "361 - 220 - 607 + 879 + 560": numbers with an operator between each two
    half = 2 * math.ceil((len(words) + 1) / 4) - 1  # the first ceil(terms / 2) numbers and the operators between them
    return [f"x = {' '.join(words[:half])}\nx", f"x = x {' '.join(words[half:])}\nx"]


def transcript(row: dict) -> list[dict]:
    """The user's question, two calls of run_python that keep the running total in `x`, and the answer."""
    entry = json.loads(row["extra_info"]["entry"])
    messages, namespace = [row["prompt"][-1]], {}
    for code in steps_of(entry["metadata"]["expression"]):
        exec(code.rsplit("\n", 1)[0], namespace)
        call = {"type": "function", "function": {"name": "run_python", "arguments": {"code": code}}}
        messages += [
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "name": "run_python", "content": repr(namespace["x"])},
        ]
    if str(namespace["x"]) != entry["answer"]:
        raise ValueError(f"the steps of {entry['metadata']['expression']} give {namespace['x']}, not {entry['answer']}")
    return messages + [{"role": "assistant", "content": entry["answer"]}]


def write(out_dir: str, seed: int = 1) -> dict[str, str]:
    """Write the task's four files into `out_dir` (kept when already there); their paths by name."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    from common.python_env import PythonInterpreter
    from common.tools import tool_schema

    paths = {name: os.path.join(out_dir, name + (".jsonl" if name.startswith("sft") else ".parquet")) for name in SIZES}
    paths["val"] = os.path.join(out_dir, "val.parquet")
    if all(os.path.exists(path) for path in paths.values()):
        return paths
    os.makedirs(out_dir, exist_ok=True)
    splits = generate(TASK, CONFIG, "last-number", sum(SIZES.values()), VAL_SIZE, seed)
    tools = [tool_schema(object.__new__(PythonInterpreter).run_python, "PythonInterpreter")]
    start = 0
    for name, size in SIZES.items():
        rows, start = splits["train"][start : start + size], start + size
        if name.startswith("sft"):
            lines = [json.dumps({"messages": transcript(row), "tools": tools}) + "\n" for row in rows]
            with open(paths[name], "w") as file:
                file.writelines(lines)
        else:
            pq.write_table(pa.Table.from_pylist(rows), paths[name])
    pq.write_table(pa.Table.from_pylist(splits["test"]), paths["val"])
    return paths


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out-dir", default="data/chain_sum_python")
    parser.add_argument("--seed", type=int, default=1)
    options = parser.parse_args()
    for name, path in write(options.out_dir, options.seed).items():
        print(f"{name}: {path}")
