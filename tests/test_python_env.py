"""The Python interpreter environment (common/python_env.py) on its own, run for real: state kept within an episode and
not across, hostile cells stopped, and nothing left behind."""

import gc
import os
import socket
import threading
import time

from transformers.utils import get_json_schema

from common.python_env import LIMITS, PythonInterpreter

ROW = {"prompt": [{"role": "user", "content": "?"}], "data_source": "x", "reward_model": {"ground_truth": "1"}}


class QuickInterpreter(PythonInterpreter):
    limits = LIMITS | dict(wall_seconds=1, cpu_seconds=20)


def episode(env_cls=PythonInterpreter) -> PythonInterpreter:
    env = env_cls()
    assert env.reset(**ROW) is None  # TRL's reset: every column of the row; nothing added to the prompt
    return env


def folders() -> set[str]:
    import tempfile

    return {name for name in os.listdir(tempfile.gettempdir()) if name.startswith("hybridrl_python_")}


def processes_of_folder(folder: str) -> list[str]:
    """The processes whose command line names `folder` (the launcher's does)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if folder in open(f"/proc/{pid}/cmdline").read():
                found.append(pid)
        except OSError:
            pass
    return found


def running(word: str) -> list[str]:
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if word in open(f"/proc/{pid}/cmdline").read():
                found.append(pid)
        except OSError:
            pass
    return found


def test_its_one_tool_has_a_schema_and_close_reset_are_not_tools():
    schema = get_json_schema(PythonInterpreter.run_python)
    assert schema["function"]["name"] == "run_python"
    assert list(schema["function"]["parameters"]["properties"]) == ["code"]


def test_variables_functions_and_imports_stay_between_calls_of_an_episode():
    env = episode()
    try:
        assert env.run_python("x = 361 - 220 + 607\nx") == "748"
        assert env.run_python("import math\ndef twice(v):\n    return 2 * v\n") == ""
        assert env.run_python("y = twice(x) + math.isqrt(16)\nprint('y is', y)\ny - 1") == "y is 1500\n1499"
        assert env.run_python("[x, y]") == "[748, 1500]"
        assert env.run_python("None") == ""  # as a shell shows it: nothing
    finally:
        env.close()


def test_two_episodes_share_nothing_and_reset_starts_afresh():
    first, second = episode(), episode()
    try:
        first.run_python("secret = 42")
        assert "NameError" in second.run_python("secret")
        assert first.run_python("secret") == "42"
        first.reset(**ROW)
        assert "NameError: name 'secret' is not defined" in first.run_python("secret")
    finally:
        first.close()
        second.close()


def test_an_exception_is_the_result_as_text_and_the_variables_stay():
    env = episode()
    try:
        env.run_python("total = 10")
        result = env.run_python("print('before')\ntotal += 5\n1 / 0")
        assert result.startswith("before\nTraceback (most recent call last):")
        assert result.endswith("ZeroDivisionError: division by zero") and "main.py" not in result
        assert env.run_python("total") == "15"
        assert env.run_python("def f(:").endswith("SyntaxError: invalid syntax")
        assert "SystemExit" in env.run_python("raise SystemExit(3)") and env.run_python("total") == "15"
    finally:
        env.close()


def test_an_endless_loop_is_interrupted_and_one_in_c_ends_the_interpreter():
    env = episode(QuickInterpreter)
    try:
        env.run_python("kept = 7")
        started = time.monotonic()
        assert env.run_python("while True:\n    pass").endswith("TimeoutError: the code ran past 1 s and was interrupted")
        assert env.run_python("kept") == "7"  # interrupted in Python: the variables stay
        assert env.run_python("import time\ntime.sleep(60)").endswith("interrupted")
        # a loop in C never returns to Python: past the grace the interpreter is killed, its variables gone
        assert "every variable is gone" in env.run_python("sum(range(10**13))")
        assert time.monotonic() - started < 3 * 1 + 3 + 5
        assert "NameError" in env.run_python("kept")
    finally:
        env.close()


def test_memory_and_output_are_bounded():
    env = episode(QuickInterpreter)
    try:
        assert "MemoryError" in env.run_python("x = bytearray(8 * 1024**3)")
        result = env.run_python("import sys\nfor _ in range(10**4):\n    sys.stdout.write('x' * 100000)\n")
        assert len(result) < 3 * 4000 and "OSError" in result or "File too large" in result
        assert env.run_python("1 + 1") == "2"
    finally:
        env.close()


def test_the_cell_reaches_no_network_and_no_environment_variable(monkeypatch):
    monkeypatch.setenv("HYBRIDRL_TEST_SECRET", "hunter2")
    server = socket.create_server(("127.0.0.1", 0))
    accepted = []
    threading.Thread(target=lambda: accepted.append(server.accept()), daemon=True).start()
    port = server.getsockname()[1]
    env = episode()
    try:
        result = env.run_python(f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=1)")
        assert "Error" in result and accepted == []
        assert "hunter2" not in env.run_python("import os\nprint(dict(os.environ))")
    finally:
        env.close()
        server.close()


def test_close_leaves_no_process_and_no_file():
    before = folders()
    env = episode()
    env.run_python("open('scratch.txt', 'w').write('x' * 100)")
    # a child that leaves the interpreter's session, as a `sleep` this machine can see
    escape = "import os\nif os.fork() == 0:\n    os.setsid()\n    os.execv('/bin/sleep', ['sleep', '27.1828'])\n'forked'"
    assert env.run_python(escape) == "'forked'"
    [folder] = folders() - before
    for _ in range(100):  # the child execs `sleep` on its own time
        if running("27.1828"):
            break
        time.sleep(0.02)
    assert processes_of_folder(folder) and running("27.1828")
    env.close()
    time.sleep(0.2)
    assert folders() == before and processes_of_folder(folder) == [] and running("27.1828") == []
    env.close()  # twice is harmless


def test_an_episode_left_unclosed_goes_with_its_object():
    before = folders()
    env = episode()
    env.run_python("x = 1")
    [folder] = folders() - before
    del env
    gc.collect()
    time.sleep(0.2)
    assert folders() == before and processes_of_folder(folder) == []


def test_writes_stay_in_its_own_folder():
    env = episode()
    try:
        result = env.run_python(
            "import os\nfor path in ['/tmp/hybridrl_python_escape', '/dev/shm/hybridrl_python_escape']:\n"
            "    open(path, 'w').write('x')\nos.getcwd()"
        )
        assert result == "'/tmp/work'" or "Error" in result
    finally:
        env.close()
    assert not os.path.exists("/tmp/hybridrl_python_escape") and not os.path.exists("/dev/shm/hybridrl_python_escape")


def test_an_episode_made_in_a_thread_that_ends_keeps_its_interpreter():
    env = episode()
    worker = threading.Thread(target=env.run_python, args=("kept = 'alive'",))
    worker.start()
    worker.join()
    time.sleep(0.3)
    try:
        assert env.run_python("kept") == "'alive'"
    finally:
        env.close()


def test_the_interpreter_and_its_folder_go_with_the_process_that_held_it():
    import subprocess
    import sys

    before = folders()
    holder = (
        "import os, signal, time\nfrom common.python_env import PythonInterpreter\nenv = PythonInterpreter()\n"
        "env.reset()\nenv.run_python('x = 1')\nprint('ready', flush=True)\nos.kill(os.getpid(), signal.SIGKILL)\n"
    )
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    result = subprocess.run([sys.executable, "-c", holder], env={**os.environ, "PYTHONPATH": root}, capture_output=True)
    assert result.stdout == b"ready\n"
    for _ in range(100):
        if folders() == before:
            break
        time.sleep(0.05)
    assert folders() == before


def test_close_from_another_thread_ends_a_call_under_way():
    """As an episode past its timeout is closed while its tool still runs."""
    before = folders()
    env = episode()
    env.run_python("x = 1")
    answers = []
    worker = threading.Thread(target=lambda: answers.append(env.run_python("import time\ntime.sleep(4)")))
    worker.start()
    time.sleep(0.5)
    started = time.monotonic()
    env.close()
    worker.join(10)
    assert time.monotonic() - started < 2 and not worker.is_alive()
    assert "every variable is gone" in answers[0]
    assert folders() == before


def test_the_warm_start_transcripts_steps_give_what_the_interpreter_answers():
    """examples/reasoning_gym/interpreter_task.py writes each call's result as the interpreter answers it."""
    import importlib.util
    import sys

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples/reasoning_gym")
    sys.path.insert(0, path)
    try:
        spec = importlib.util.spec_from_file_location("interpreter_task", os.path.join(path, "interpreter_task.py"))
        task = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(task)
    finally:
        sys.path.remove(path)
    expression = "361 - 220 - 607 + 879 + 560"
    steps = task.steps_of(expression)
    assert steps == ["x = 361 - 220 - 607\nx", "x = x + 879 + 560\nx"]
    assert task.steps_of("1 + 2 + 3 - 4 + 5 - 6") == ["x = 1 + 2 + 3\nx", "x = x - 4 + 5 - 6\nx"]
    env = episode()
    try:
        assert [env.run_python(code) for code in steps] == ["-466", str(eval(expression))]
    finally:
        env.close()
