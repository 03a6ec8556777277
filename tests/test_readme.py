"""The README's step of GRPO is quoted from algos/grpo_hybrid.py: every line of it stands in the script's loop."""

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_the_readmes_step_is_the_scripts():
    readme = (ROOT / "README.md").read_text()
    [quoted] = re.findall(r"## A step of GRPO.*?```python\n(.*?)```", readme, flags=re.S)
    loop = (ROOT / "algos" / "grpo_hybrid.py").read_text().split("    for step in run.steps():", 1)[1]
    script_lines = {line.strip() for line in loop.splitlines()}
    lines = [line.strip() for line in quoted.splitlines()[1:]]  # after its `for step in run.steps():`
    assert len(lines) >= 10
    assert [line for line in lines if line not in script_lines] == []
