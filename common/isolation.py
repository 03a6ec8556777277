"""Running a user's code (a reward function) so that nothing it does reaches the run.

A pool of processes (CallProcesses) that each load the user's code once and make its calls one at a time, with a
deadline per call, a new process in place of one that dies, and a fresh one after many calls; or, to debug with
breakpoint(), the same calls made in this process (InProcessCalls). A CallKind says how to load the code from its
flag's value and how to make one call of it, by module and function name: this module imports neither. The processes
that keep environments alive for their episodes (common/env_processes.py) start and end theirs alike (start_process,
kill_session).
"""

from __future__ import annotations

import atexit
import hashlib
import importlib
import importlib.util
import itertools
import math
import mmap
import os
import pickle
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
import traceback
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait

PROJECT_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPORTED_FAILURES: set[str] = set()  # the kinds of failure of a user's code printed so far in this process


def report_once(kind: str, message: str) -> None:
    """Print `message` to stderr the first time this process meets a failure of `kind` (REPORTED_FAILURES)."""
    if kind not in REPORTED_FAILURES:
        REPORTED_FAILURES.add(kind)
        print(message, file=sys.stderr)


@dataclass(frozen=True)
class CallKind:
    """What a pool calls. `name` ("reward", "env") and `flag` ("--reward-fn", "--env") are for messages; `load` and
    `call` are "module:function": load(the flag's value or None) -> the user's code, and call(code, *sample) -> ("ok",
    ...) or ("error", kind, traceback), which never raises; `builtin` names what the flag's absence loads."""

    name: str
    flag: str
    load: str
    call: str
    builtin: str = ""

    def describe(self, spec: str | None) -> str:
        """The flag and its value, as a message names the code (an empty `flag`: `spec` holds its flags)."""
        return " ".join(filter(None, (self.flag, spec)))

    def function(self, which: str):
        return import_function(getattr(self, which))


def import_function(name: str):
    """The function `module:function` names."""
    module, _, function = name.partition(":")
    return getattr(importlib.import_module(module), function)


def load_user_file(path: str):
    """The module of the user's file `path`, loaded once per process under a name every process derives alike, so that
    an object pickled in one process unpickles in another from the same class."""
    module_name = "user_code_" + hashlib.sha1(os.path.abspath(path).encode()).hexdigest()[:16]
    if module_name not in sys.modules:
        module_spec = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[module_name] = module
        try:
            module_spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[module_name]
            raise
    return sys.modules[module_name]


def start_process(module: str, arguments: list[str], pass_fds=(), env: dict | None = None):
    """`python -m module SOCKET *arguments` in a session of its own, and our end of the socket SOCKET names (a file
    descriptor) as a Connection. Its own session: Ctrl-C in the terminal stops the run between steps, not the user's
    code mid-call, and a kill takes whatever that code started with it. `env`: variables set for it."""
    ours, theirs = socket.socketpair()
    process = subprocess.Popen(
        [sys.executable, "-m", module, str(theirs.fileno()), *arguments],
        pass_fds=[theirs.fileno(), *pass_fds],
        stdin=subprocess.DEVNULL,
        env=os.environ | {"PYTHONPATH": os.pathsep.join([PROJECT_ROOT, os.environ.get("PYTHONPATH", "")])} | (env or {}),
        start_new_session=True,
    )
    theirs.close()
    return process, Connection(ours.detach())


def kill_session(process) -> None:
    """Kill `process` and whatever it started in its session, and reap it."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()


class CallTimeout(BaseException):  # not an Exception, so that the user's own `except Exception` cannot swallow it
    pass


@contextmanager
def time_limit(seconds: float | None):
    """Raise CallTimeout in this (main) thread after `seconds`.

    A call stuck in Python code, or sleeping, is interrupted; one stuck inside
    a C call is interrupted only when that call returns to Python.
    """
    if not seconds:
        yield
        return

    def expire(signum, frame):
        raise CallTimeout

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


class UserCodeError(RuntimeError):
    """The user's code cannot be called: it failed to load, or failed too often to go on."""


class InProcessCalls:
    """The calls of `kind` to `code` (loaded from the flag's value `spec`), one after another in this process, so that
    breakpoint() in the user's code stops in the terminal; a call past `timeout` seconds is interrupted (see
    time_limit)."""

    def __init__(self, code, spec: str | None, kind: CallKind, timeout: float | None = None):
        self.code, self.timeout, self.call = code, timeout, kind.function("call")
        self.name = spec or kind.builtin
        self.finished, self.tickets = {}, itertools.count()  # the outcomes of submitted calls, by ticket

    def __call__(self, samples: list[tuple]) -> list[tuple]:
        return [self._call(sample) for sample in samples]

    def submit(self, sample: tuple) -> int:
        """Make the call now (see CallProcesses.submit); its outcome waits for `collect`."""
        ticket = next(self.tickets)
        self.finished[ticket] = self._call(sample)
        return ticket

    def collect(self, timeout: float | None = None) -> dict[int, tuple]:
        """The outcomes of the calls submitted since the last collect, by ticket."""
        finished, self.finished = self.finished, {}
        return finished

    def _call(self, sample: tuple) -> tuple:
        try:
            with time_limit(self.timeout):
                return self.call(self.code, *sample)
        except CallTimeout:
            return ("timeout",)

    def close(self) -> None:
        pass


CURRENT_CALL = struct.Struct("qd")  # what a call process is working on: the sample's index and when the call started


def write_current_call(current_call: mmap.mmap, index: int, start: float) -> None:
    """Write both fields with one copy. Not struct's pack_into: it zeroes the fields before it fills them, and a
    driver that read the start time in between saw a call that started at time 0, long past its deadline."""
    current_call[: CURRENT_CALL.size] = CURRENT_CALL.pack(index, start)


@dataclass
class CallProcess:
    process: subprocess.Popen
    connection: Connection
    current_call: mmap.mmap  # CURRENT_CALL, written by the process before each call, read by the driver
    ready: bool = False
    calls_made: int = 0
    sent: list = field(default_factory=list)  # the samples sent to it that it has not answered yet


class CallProcesses:
    """`size` processes that each load the user's code `spec` (the value of `kind`'s flag) and make its calls one at a
    time, all at once: score responses with a reward, play an environment's turns. Nothing the code does reaches the
    run: a call past `timeout` seconds is killed, even inside a C call, and a process that dies (a segfault, os._exit)
    is replaced; either way only that call's sample fails. A process is also replaced, between batches, after
    RECYCLE_AFTER samples, so that code that leaks memory stays bounded.

    A process is sent a share of the batch at once and answers with all its outcomes: a message each way per sample
    would cost more than a rule-based reward takes. It writes which sample it is working on, and since when, to
    memory the driver shares, so each call still has its own deadline, and a kill or a crash fails that sample alone
    (the others of its share are called again by the next process).
    """

    RECYCLE_AFTER = 10_000
    SHARES_PER_PROCESS = 4  # per batch: small enough that the processes finish together

    def __init__(self, spec: str | None, size: int, kind: CallKind, timeout: float | None = None):
        self.spec, self.timeout, self.kind = spec, timeout or math.inf, kind
        self.name = spec or kind.builtin
        # the calls submitted and not yet answered by ticket, those not yet sent to a process, and the next ticket
        self.samples, self.todo, self.tickets = {}, deque(), itertools.count()
        self.processes = [self._start() for _ in range(size)]
        atexit.register(self.close)

    def _start(self) -> CallProcess:
        with tempfile.TemporaryFile() as file:
            file.truncate(CURRENT_CALL.size)
            current_call = mmap.mmap(file.fileno(), CURRENT_CALL.size)
            arguments = [str(file.fileno()), self.spec or "", self.kind.load, self.kind.call]
            process, connection = start_process("common.isolation", arguments, pass_fds=[file.fileno()])
        return CallProcess(process, connection, current_call)

    def _replace(self, slot: int, todo: deque) -> int:
        """Kill the process in `slot` and start another; the samples it was sent go back to the front of `todo`,
        except the one it was scoring, whose index is returned."""
        worker = self.processes[slot]
        self._kill(worker)
        current, _ = CURRENT_CALL.unpack_from(worker.current_call)
        todo.extendleft(reversed([i for i in worker.sent if i != current]))
        self.processes[slot] = self._start()
        return current

    @staticmethod
    def _kill(worker: CallProcess) -> None:
        kill_session(worker.process)
        worker.connection.close()

    def __call__(self, samples: list[tuple]) -> list[tuple]:
        """For each sample (the arguments of a call after the code) what its call came to: ("ok", ...), ("error", kind,
        traceback) or ("timeout",)."""
        tickets = [self.submit(sample) for sample in samples]
        share = max(1, len(samples) // (self.SHARES_PER_PROCESS * len(self.processes)))
        outcomes = {}
        while len(outcomes) < len(tickets):
            outcomes |= self._pump(share, None)
        for slot, worker in enumerate(self.processes):
            if worker.calls_made >= self.RECYCLE_AFTER:
                self._replace(slot, self.todo)
        return [outcomes.pop(ticket) for ticket in tickets]

    def submit(self, sample: tuple) -> int:
        """Queue one call, which the next free process makes; returns its ticket, under which `collect` gives its
        outcome. Calls submitted one by one are sent one by one: each starts as soon as a process is free."""
        ticket = next(self.tickets)
        self.samples[ticket] = sample
        self.todo.append(ticket)
        return ticket

    def collect(self, timeout: float | None = None) -> dict[int, tuple]:
        """The outcomes of submitted calls, by ticket, once at least one has come (or `timeout` seconds passed: maybe
        none); each is given once."""
        for slot, worker in enumerate(self.processes):  # between calls, as __call__ does between batches
            if worker.ready and not worker.sent and worker.calls_made >= self.RECYCLE_AFTER:
                self._replace(slot, self.todo)
        deadline = math.inf if timeout is None else time.monotonic() + timeout
        outcomes = {}
        while not outcomes and self.samples and time.monotonic() <= deadline:
            outcomes = self._pump(1, None if timeout is None else max(0.0, deadline - time.monotonic()))
        return outcomes

    def _pump(self, share: int, timeout: float | None) -> dict[int, tuple]:
        """Send queued calls, `share` at a time, to the processes that are free, then wait for answers (at most
        `timeout` seconds, and never past a call's deadline); returns the outcomes that came, by ticket."""
        outcomes = {}
        for slot, worker in enumerate(self.processes):
            if worker.ready and not worker.sent and self.todo:
                worker.sent = [self.todo.popleft() for _ in range(min(share, len(self.todo)))]
                write_current_call(worker.current_call, worker.sent[0], time.monotonic())
                try:
                    worker.connection.send([(i, self.samples[i]) for i in worker.sent])
                except OSError:  # it died between batches
                    self.todo.extendleft(reversed(worker.sent))
                    worker.sent = []
                    self._replace(slot, self.todo)
        deadline = min(self._deadline(worker) for worker in self.processes)
        if timeout is not None:
            deadline = min(deadline, time.monotonic() + timeout)
        waiting = [worker.connection for worker in self.processes if worker.sent or not worker.ready]
        ready = wait(waiting, timeout=None if deadline == math.inf else max(0.0, deadline - time.monotonic()))
        for slot, worker in enumerate(self.processes):
            if worker.connection in ready:
                self._receive(slot, worker, outcomes, self.todo)
        for slot, worker in enumerate(self.processes):
            if time.monotonic() >= self._deadline(worker):
                outcomes[self._replace(slot, self.todo)] = ("timeout",)
        for ticket in outcomes:
            del self.samples[ticket]
        return outcomes

    def _deadline(self, worker: CallProcess) -> float:
        return CURRENT_CALL.unpack_from(worker.current_call)[1] + self.timeout if worker.sent else math.inf

    def _receive(self, slot: int, worker: CallProcess, outcomes: dict, todo: deque) -> None:
        try:
            message = worker.connection.recv()
        except (EOFError, OSError):
            code = worker.process.wait()
            if not worker.sent:
                kind = self.kind
                raise UserCodeError(f"a {kind.name} process exited with code {code} while loading {kind.describe(self.spec)}")
            death = (
                f"the {self.kind.name} process died with exit code {code} during this call (a crash in C code, a "
                "signal, os._exit or the out-of-memory killer); a new process took its place\n"
            )
            outcomes[self._replace(slot, todo)] = ("error", "ProcessDied", death)
            return
        if message == "ready":
            worker.ready = True
        elif isinstance(message, str):
            code = self.kind.describe(self.spec)
            raise UserCodeError(f"{code}: loading it in a {self.kind.name} process failed:\n{message}")
        else:
            for i, outcome in zip(worker.sent, message):
                outcomes[i] = outcome
            worker.calls_made += len(worker.sent)
            worker.sent = []

    def close(self) -> None:
        for worker in self.processes:
            self._kill(worker)
        self.processes = []


def serve(fd: int, current_call_fd: int, spec: str, load: str, call: str) -> None:
    """A call process: load the user's code `spec` with `load`, then make the calls of each share of samples that
    arrives on the socket `fd` with `call`, and answer with their outcomes, until the socket closes."""
    connection, current_call = Connection(fd), mmap.mmap(current_call_fd, CURRENT_CALL.size)
    try:
        code, call_code = import_function(load)(spec or None), import_function(call)
    except BaseException:
        connection.send(traceback.format_exc())
        return
    connection.send("ready")
    while True:
        try:
            share = connection.recv()
        except EOFError:
            return
        outcomes = []
        for index, sample in share:
            write_current_call(current_call, index, time.monotonic())
            outcomes.append(call_code(code, *sample))
        try:
            connection.send(outcomes)
        except Exception:  # an outcome that cannot be pickled (a reward's keys beside its score): that sample fails
            connection.send([sendable(outcome) for outcome in outcomes])


def sendable(outcome: tuple) -> tuple:
    try:
        pickle.dumps(outcome)
        return outcome
    except Exception:
        return "error", "PicklingError", traceback.format_exc()


if __name__ == "__main__":
    serve(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], sys.argv[5])
