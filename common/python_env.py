"""A Python interpreter whose variables live for the episode: the built-in environment `--env python`.

    class PythonInterpreter:               # TRL's environment_factory shape
        def reset(self, **row): ...        # a new episode: a fresh interpreter (started at its first call)
        def run_python(self, code) -> str  # the tool: runs code in the episode's interpreter, which keeps its variables
        def close(self): ...               # the episode ended: the interpreter, its children and its files go

Each episode's interpreter is a long-lived `python -I -S` process, contained as common/sandbox.py contains a code
reward's program (its namespaces, read-only files but its own folder, no network, its own process ids, no environment
variables, run as nobody under root; an address-space, CPU-time, file-size, open-file and process bound), started at
the episode's first call and ended by `close()` (or the next `reset`, or the object's collection, or the process's
exit, or the death of the process that started it). Between calls it waits on a pipe, its variables kept.

A call runs the code as a cell of a notebook: the statements in order, then, if the last is an expression, its value's
repr, as a Python shell shows it. The result is what the code printed (stdout and stderr, its children's too) and that
value; an exception adds its traceback (the cell's frames alone), and the variables set before it stay. A call that
runs past LIMITS["wall_seconds"] is interrupted (TimeoutError, the variables kept); one that does not return to Python
within a few seconds more (a long computation in C) is killed with its interpreter, and the result says the variables
are gone; the next call starts a new one. The interpreter's CPU time over the episode is bounded by
LIMITS["cpu_seconds"] the same way. The result never raises: a failing cell is the model's to read.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import weakref

if __name__ == "__main__":  # the launcher, run with -I: the project's folder is not on the path
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import sandbox  # noqa: E402

# The interpreter's bounds: memory and output as a code reward's program; per call, the wall-clock time; over the
# episode, CPU time (a cell that loops in C past the call's limit ends its interpreter).
LIMITS = sandbox.LIMITS | dict(cpu_seconds=60, wall_seconds=5)
KILL_GRACE_SECONDS = 3  # past the call's wall limit, how long an interpreter has to answer before it is killed
START_SECONDS = 10  # added to the first call's wait: the interpreter starts
RESULT_CHARS = 4000  # the start of a result the model reads, and its end


class PythonInterpreter:
    """A Python interpreter for one episode: its variables, functions and imports stay from one call to the next."""

    limits = LIMITS

    def __init__(self):
        self._interpreter = None

    def reset(self, **row) -> None:
        """A new episode: the last one's interpreter, if any, goes; the next call starts a fresh one."""
        self._stop()

    def run_python(self, code: str) -> str:
        """Run Python code in an interpreter that keeps its variables between calls, and show what it printed and the
        value of its last line if that is an expression, as a Python shell does.

        Args:
            code: Python statements, run in the order written; the standard library only.
        """
        if self._interpreter is None:
            self._interpreter = Interpreter(self.limits)
        reply = self._interpreter.run(code)
        if reply is None:  # it died or hung past the grace: killed, its variables gone
            self._stop()
            return (
                f"Error: the interpreter stopped (it ran past {self.limits['wall_seconds']} s, or past its memory or "
                "CPU bound) and was restarted: every variable is gone."
            )
        return result_text(reply)

    def close(self) -> None:
        """The episode ended: the interpreter, its children and its files go."""
        self._stop()

    def _stop(self) -> None:
        if self._interpreter is not None:
            self._interpreter.stop()
            self._interpreter = None


def result_text(reply: dict) -> str:
    """What the model reads of a call: its output, then the last expression's value or the error."""
    parts = [reply["output"]] if reply["output"] else []
    if reply.get("error"):
        parts.append(reply["error"])
    elif reply.get("value") is not None:
        parts.append(reply["value"])
    text = "\n".join(part.rstrip("\n") for part in parts)
    if len(text) > 2 * RESULT_CHARS:
        text = f"{text[:RESULT_CHARS]}\n... ({len(text) - 2 * RESULT_CHARS} characters left out) ...\n{text[-RESULT_CHARS:]}"
    return text


class Interpreter:
    """The contained process (the launcher below, with the interpreter forked from it) and the pipes to it."""

    def __init__(self, limits: dict):
        self.limits, self.started = limits, False
        self.folder = tempfile.mkdtemp(prefix="hybridrl_python_")
        shutil.copy(SERVER_SOURCE, os.path.join(self.folder, "main.py"))
        if os.geteuid() == 0:
            os.chown(self.folder, sandbox.NOBODY, sandbox.NOBODY)
        # As sandbox.run_program: a launcher that sets the limits and execs, so that nothing runs Python between fork
        # and exec in this (maybe threaded) process; its own session, an empty environment.
        command = [sys.executable, "-I", "-S", os.path.abspath(__file__), self.folder, json.dumps(limits), str(os.getpid())]
        self.process = subprocess.Popen(
            command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, start_new_session=True, env={}
        )
        self.buffer = b""
        # the process and the folder go when the object is collected or this process exits, if stop() was not called
        self.finalizer = weakref.finalize(self, stop_process, self.process, self.folder)

    def run(self, code: str) -> dict | None:
        """The interpreter's reply to `code` ({"output", "value", "error"}), or None once it has died or hung."""
        wait = self.limits["wall_seconds"] + KILL_GRACE_SECONDS + (0 if self.started else START_SECONDS)
        self.started = True
        try:
            self.process.stdin.write(json.dumps({"code": code}).encode() + b"\n")
            self.process.stdin.flush()
            line = self.read_line(wait)
            return json.loads(line) if line else None
        except (OSError, ValueError):  # it ended, or was stopped meanwhile (close() on another thread), or the cell wrote
            return None  # to the interpreter's own pipe

    def read_line(self, seconds: float) -> bytes | None:
        deadline = time.monotonic() + seconds
        out = self.process.stdout.fileno()
        while b"\n" not in self.buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([out], [], [], left)[0]:
                return None
            chunk = os.read(out, 1 << 16)
            if not chunk:
                return None
            self.buffer += chunk
        line, _, self.buffer = self.buffer.partition(b"\n")
        return line

    def stop(self) -> None:
        self.finalizer()


def stop_process(process: subprocess.Popen, folder: str) -> None:
    """Tell the launcher to end the interpreter (the first of its own process ids: every process it started ends with
    it) and remove its folder; past a few seconds, kill them all and remove the folder here."""
    try:
        process.terminate()
        process.wait(timeout=KILL_GRACE_SECONDS)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    except ProcessLookupError:
        pass
    for pipe in (process.stdin, process.stdout):
        pipe.close()
    shutil.rmtree(folder, ignore_errors=True)


SERVER_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "python_env_server.py")


def launch(folder: str, limits: dict, parent: int) -> int:
    """The launcher (this file run as a script): as sandbox.launch, but the interpreter keeps the pipes to the
    environment as its stdin and stdout and has no wall-clock limit of its own (each call has one)."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    root = os.geteuid() == 0
    if os.getppid() != parent:
        return 137
    pid = sandbox.fork_confined(libc, folder, limits, root, start_interpreter)
    signal.signal(signal.SIGTERM, stop)
    os.close(0)
    os.close(1)
    return watch_parent(parent, pid, folder)


class Stop(Exception):
    pass


def stop(signum, frame):
    raise Stop


def watch_parent(parent: int, pid: int, folder: str) -> int:
    """Wait for the interpreter `pid` to end; end it when told to (SIGTERM, from stop_process) or when the
    environment's process `parent` ends first; then remove its folder. Not PR_SET_PDEATHSIG, which follows the thread
    that started the launcher: an environment made in a thread that ends (a pool's) keeps its interpreter. Returns the
    interpreter's exit code."""
    try:
        parent_ended, ended = os.pidfd_open(parent), os.pidfd_open(pid)
    except (AttributeError, OSError):  # no pidfd (before Linux 5.3, or elsewhere): look twice a second
        parent_ended = ended = None
    status = None
    try:
        while os.getppid() == parent:
            if parent_ended is not None:
                select.select([parent_ended, ended], [], [])
            else:
                time.sleep(0.5)
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            status = None
    except Stop:
        pass
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if status is None:
        os.kill(pid, signal.SIGKILL)  # the first process of its namespace: every process it started ends with it
        status = os.waitpid(pid, 0)[1]
    shutil.rmtree(folder, ignore_errors=True)
    return os.waitstatus_to_exitcode(status)


def start_interpreter(libc, folder: str, limits: dict, processes: int, root: bool, namespaced: bool) -> None:
    """In the forked child: sandbox.start_program's view of the machine, limits and user, with stdin and stdout left
    as the pipes; then exec the interpreter's loop (python_env_server.py, copied into the folder as main.py)."""
    import ctypes
    import math
    import resource

    python = os.path.realpath(sys.executable)
    if namespaced:
        # mounts of its own, which end with it: the launcher's view keeps the folder, to remove it
        if libc.unshare(sandbox.CLONE_NEWNS) != 0:
            raise OSError(ctypes.get_errno(), "unshare of the mount namespace")
        sandbox.confine_files(libc, folder, root)
    else:
        os.chdir(folder)
    stderr = os.open("stderr", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(stderr, 2)
    memory = limits["memory_mb"] << 20
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    cpu = math.ceil(limits["cpu_seconds"])
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    resource.setrlimit(resource.RLIMIT_FSIZE, (limits["output_bytes"], limits["output_bytes"]))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
    if root and namespaced:
        os.fchown(stderr, sandbox.NOBODY, sandbox.NOBODY)
        os.setgroups([])
        os.setgid(sandbox.NOBODY)
        os.setuid(sandbox.NOBODY)
    resource.setrlimit(resource.RLIMIT_NPROC, (processes, processes))
    if hasattr(libc, "prctl"):
        libc.prctl(sandbox.PR_SET_PDEATHSIG, signal.SIGKILL)
    settings = json.dumps({"wall_seconds": limits["wall_seconds"], "output_bytes": limits["output_bytes"]})
    os.execve(python, [python, "-I", "-S", "main.py", settings], {})


if __name__ == "__main__":
    sys.exit(launch(sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])))
