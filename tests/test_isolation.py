"""The processes that run a user's code (common/isolation.py), and the import graph they untangled."""

import ast
import mmap
import subprocess
import sys
from pathlib import Path

from common.isolation import CURRENT_CALL

COMMON = Path(__file__).resolve().parents[1] / "common"


def imports_of(path: Path) -> set[str]:
    """The common/ modules a module imports, at its top or inside a function."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module == "common":
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("common."):
            names.add(node.module.removeprefix("common."))
        elif isinstance(node, ast.Import):
            names |= {alias.name.removeprefix("common.") for alias in node.names if alias.name.startswith("common.")}
    return names


def module_name(path: Path) -> str:
    """common/envs.py: 'envs'; a package's common/x/__init__.py: 'x'."""
    parts = path.relative_to(COMMON).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_no_module_of_common_imports_itself_back():
    graph = {module_name(path): imports_of(path) for path in COMMON.rglob("*.py")}
    assert graph["isolation"] == set()  # rewards and environments build on it, not it on them
    assert "envs" not in graph["rewards"] and "rewards" not in graph["envs"]

    def reaches(start: str, goal: str, seen: set) -> bool:
        return any(step == goal or (step not in seen and reaches(step, goal, seen | {step})) for step in graph[start])

    circles = sorted(name for name in graph if reaches(name, name, {name}))
    assert circles == []


def test_the_driver_never_reads_a_call_half_written(tmp_path):
    """A call process rewrites its current call while the driver reads it. A read between two field writes once
    gave a start time of 0 and a timeout for a call that had just started (struct's pack_into zeroes first)."""
    shared_file = tmp_path / "current_call"
    shared_file.write_bytes(CURRENT_CALL.pack(1, 1.0))
    writer = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import mmap, sys, time\n"
            "from common.isolation import CURRENT_CALL, write_current_call\n"
            "with open(sys.argv[1], 'r+b') as file:\n"
            "    shared = mmap.mmap(file.fileno(), CURRENT_CALL.size)\n"
            "end = time.monotonic() + 1\n"
            "while time.monotonic() < end:\n"
            "    write_current_call(shared, 1, 1.0)\n",
            str(shared_file),
        ]
    )
    with open(shared_file, "r+b") as file:
        shared = mmap.mmap(file.fileno(), CURRENT_CALL.size)
    reads = set()
    while writer.poll() is None:
        reads.add(CURRENT_CALL.unpack_from(shared))
    assert writer.returncode == 0
    assert reads == {(1, 1.0)}
