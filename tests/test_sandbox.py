"""The sandbox for code rewards (common/sandbox.py), run for real: correct, wrong and hostile programs."""

import json
import os
import shutil
import socket
import threading
import time
from pathlib import Path

import pytest

from common.dataproto import DataProto
from common.isolation import CallProcesses
from common.rewards import REWARD_CALLS, load_reward_fn, score_texts
from common.sandbox import LIMITS, code_reward, program_of, run_program

QUICK = LIMITS | dict(cpu_seconds=1, wall_seconds=2)
ADD = {"inputs": ["1 2\n", "10 -4\n", "0 0"], "outputs": ["3\n", "6", "0\n"]}


def test_the_program_is_the_last_python_block_or_the_whole_response():
    assert program_of("try this:\n```python\nprint(1)\n```\nor\n```python\nprint(2)\n```") == "print(2)\n"
    assert program_of("print(3)") == "print(3)"


def test_stdin_stdout_tests_score_the_share_passed():
    right = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
    assert code_reward(right, json.dumps(ADD)) == {"score": 1.0, "tests_passed": 3, "tests": 3}
    assert code_reward("print(3)", ADD) == {"score": pytest.approx(1 / 3), "tests_passed": 1, "tests": 3}
    assert code_reward("raise SystemExit(1)", ADD)["score"] == 0.0  # a failing exit fails the test
    # the exit code the launcher gives a sandbox it could not set up, from the program itself: a failed test, no error
    assert run_program("raise SystemExit(125)", None, QUICK) == dict(status="exited", returncode=125, stdout="", stderr="")


def test_assert_tests_run_after_the_program():
    truth = {"asserts": ["assert add(1, 2) == 3", "assert add(-1, 1) == 0", "assert add(2, 2) == 5"]}
    result = code_reward("def add(a, b):\n    return a + b\n", truth)
    assert (result["tests_passed"], result["tests"]) == (2, 3)
    spec = "common/sandbox.py:all_tests_reward"
    [(_, all_or_nothing)] = load_reward_fn(spec)
    assert all_or_nothing("code", "def add(a, b):\n    return a + b\n", truth, {})["score"] == 0.0
    assert (
        all_or_nothing("code", "def add(a, b):\n    return a + b\n", truth | {"asserts": truth["asserts"][:2]}, {})["score"]
        == 1.0
    )


def test_a_ground_truth_without_tests_says_what_it_needs():
    with pytest.raises(ValueError, match=r'\{"inputs": \[...\], "outputs": \[...\]\} of equal length, or \{"asserts"'):
        code_reward("print(1)", {"inputs": ["1"], "outputs": []})


def test_endless_programs_are_stopped_by_the_cpu_and_wall_clock_limits():
    started = time.monotonic()
    assert run_program("while True:\n    pass\n", None, QUICK)["status"] in ("killed", "timeout")
    assert run_program("import time\ntime.sleep(60)\n", None, QUICK)["status"] == "timeout"
    assert time.monotonic() - started < 2 * (QUICK["wall_seconds"] + 1)


def test_a_memory_hog_fails_at_the_memory_limit():
    result = run_program("x = bytearray(8 * 1024**3)\nprint('allocated')\n", None, QUICK)
    assert result["returncode"] != 0 and "MemoryError" in result["stderr"] and "allocated" not in result["stdout"]


def test_output_is_capped(tmp_path):
    started = time.monotonic()
    result = run_program("import sys\nwhile True:\n    sys.stdout.write('x' * 100000)\n", None, QUICK)
    assert result["returncode"] != 0 and len(result["stdout"]) <= QUICK["output_bytes"]
    assert time.monotonic() - started < QUICK["wall_seconds"]  # stopped by the cap, not by the clock


def running(word: str) -> list[str]:
    """The processes of this machine whose command line holds `word`."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if word in open(f"/proc/{pid}/cmdline").read():
                found.append(pid)
        except OSError:
            pass
    return found


def test_a_fork_bomb_and_its_escaped_children_end_with_the_test():
    def nobodys():
        found = set()
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                if os.stat(f"/proc/{pid}").st_uid == 65534:
                    found.add(pid)
            except OSError:  # it ended meanwhile
                pass
        return found

    before = nobodys()
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    assert run_program(bomb, None, QUICK)["status"] in ("killed", "timeout")
    if os.geteuid() == 0:  # the program ran as nobody: none of its processes is left
        assert nobodys() <= before
    # A child that leaves the program's session and would outlive it, as a `sleep` this machine can see.
    escape = (
        "import os\nif os.fork() == 0:\n    os.setsid()\n    os.execv('/bin/sleep', ['sleep', '31.4159'])\nprint('done')\n"
    )
    assert run_program(escape, None, QUICK)["stdout"] == "done\n"
    time.sleep(0.2)
    assert running("31.4159") == []


def test_the_program_writes_nowhere_but_its_folder():
    # A folder anyone may write to, outside /tmp: only a read-only view of the machine keeps the program out.
    open_to_all = Path(__file__).parent / f"sandbox_probe_{os.getpid()}"
    open_to_all.mkdir(mode=0o777)
    open_to_all.chmod(0o777)
    writes = (
        "import os\n"
        f"for path in [{str(open_to_all / 'escape')!r}, '/tmp/hybridrl_sandbox_escape', '/dev/shm/hybridrl_escape']:\n"
        "    try:\n"
        "        open(path, 'w').write('x')\n"
        "    except OSError as error:\n"
        "        print(type(error).__name__)\n"
        "open('here', 'w').write('mine')\n"
        "print(open('here').read())\n"
    )
    try:
        result = run_program(writes, None, QUICK)
        assert result["returncode"] == 0 and result["stdout"].endswith("mine\n")
        assert list(open_to_all.iterdir()) == []
    finally:
        shutil.rmtree(open_to_all)
    assert not os.path.exists("/tmp/hybridrl_sandbox_escape") and not os.path.exists("/dev/shm/hybridrl_escape")


def test_the_program_sees_no_environment_variables(monkeypatch):
    monkeypatch.setenv("HYBRIDRL_TEST_SECRET", "hunter2")
    peek = (
        "import os\n"
        "print(dict(os.environ))\n"
        "for pid in os.listdir('/proc'):\n"
        "    try:\n"
        "        print(open(f'/proc/{pid}/environ').read())\n"
        "    except OSError:\n"
        "        pass\n"
    )
    result = run_program(peek, None, QUICK)
    assert result["returncode"] == 0 and "hunter2" not in result["stdout"]


def test_the_program_reaches_no_network():
    server = socket.create_server(("127.0.0.1", 0))
    accepted = []
    threading.Thread(target=lambda: accepted.append(server.accept()), daemon=True).start()
    port = server.getsockname()[1]
    result = run_program(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)\n", None, QUICK)
    time.sleep(0.2)
    server.close()
    assert result["returncode"] != 0 and accepted == []


def test_code_rows_score_through_the_reward_processes_and_hostile_ones_score_0():
    texts = ["a, b = map(int, input().split())\nprint(a + b)", "while True:\n    pass", "import os\nos.kill(1, 9)"]
    truth = json.dumps(ADD | {"limits": {"cpu_seconds": 1, "wall_seconds": 2}})
    batch = DataProto.from_dict(non_tensors={"data_source": ["code"] * 3, "ground_truth": [truth] * 3, "extra_info": [{}] * 3})
    pool = CallProcesses(None, 2, REWARD_CALLS, timeout=30)
    try:
        scores, metrics, extras = score_texts(texts, batch, pool)
    finally:
        pool.close()
    assert scores == [1.0, 0.0, 0.0] and metrics["reward/errors"] == 0
    assert [extra["tests_passed"] for extra in extras] == [3, 0, 0]
