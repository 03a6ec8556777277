"""Live environments: the processes that keep the episodes' environment objects alive from their start to their end.

Each of a pool's processes loads the run's environments (--env, --tools) once and holds the objects of the episodes
dealt to it, each on a thread of its own that makes that episode's requests in turn (common/envs.py's LiveEpisode):
nothing is pickled between turns, and the calls of episodes that wait (a tool that sleeps, a remote environment) wait
side by side. Nothing an environment does reaches the run:

- a call past the timeout ends its episode (`timeout`); the episode's close() runs on another thread of its process,
  and if the call has not ended GRACE_SECONDS later, the process is replaced and the other episodes it held end as
  errors (`ProcessReplaced`): their objects lived there;
- a process that dies (a crash in C code, os._exit, the out-of-memory killer) ends the episodes it held as errors
  (`ProcessDied`), and a new one takes its place;
- each process runs in a session of its own with a folder of its own as TMPDIR: what it started and what it wrote
  there go when it is replaced or the pool closes.

Closing the pool (the run's end, or its stop) asks every process to close the objects it holds, then ends it.
EnvsInProcess makes the same requests in this process, one after another, for a debugger.
"""

from __future__ import annotations

import atexit
import itertools
import math
import os
import queue
import shutil
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait

from common.isolation import CallTimeout, UserCodeError, kill_session, start_process, time_limit

GRACE_SECONDS = 5.0  # how long a timed-out call's close() may take to end it, and a closing pool its objects' close()


@dataclass
class EnvProcess:
    process: object  # subprocess.Popen
    connection: Connection
    folder: str  # its TMPDIR
    ready: bool = False
    keys: set = field(default_factory=set)  # the episodes whose objects it holds
    freeing: dict = field(default_factory=dict)  # timed-out episodes' keys: until when their call may take to end


class EnvProcesses:
    """`size` processes holding the episodes' live environments of `spec` (episode_spec's flags), each request under
    `timeout` seconds. `submit(key, request)` sends one request of episode `key` (LiveEpisode.handle's, but "open"
    carries the environment's name before the row's columns) to the process that holds it (the least busy, at its
    "open") and returns a ticket; `collect` gives the outcomes that came, by ticket."""

    def __init__(self, spec: str, size: int, timeout: float | None = None):
        self.spec, self.timeout = spec, timeout or math.inf
        self.processes = [self._start() for _ in range(size)]
        self.home = {}  # episode key -> its process's slot
        self.under_way = {}  # episode key -> (ticket, deadline, the request's kind)
        self.outcomes, self.tickets = {}, itertools.count()  # outcomes not yet collected, by ticket
        self.lost = {}  # episode key -> the outcome of its next request: its process ended while it held its object
        atexit.register(self.close)

    def _start(self) -> EnvProcess:
        folder = tempfile.mkdtemp(prefix="hybridrl_env_")
        process, connection = start_process("common.env_processes", [self.spec], env={"TMPDIR": folder})
        return EnvProcess(process, connection, folder)

    def submit(self, key: str, request: tuple) -> int:
        ticket = next(self.tickets)
        if key in self.lost:
            self.outcomes[ticket] = self.lost.pop(key)
            return ticket
        if request[0] == "open":
            slot = min(range(len(self.processes)), key=lambda s: len(self.processes[s].keys))
            self.home[key] = slot
            self.processes[slot].keys.add(key)
        slot = self.home[key]
        # a process still loading makes the call once it is ready: its deadline runs from then
        due = time.monotonic() + self.timeout if self.processes[slot].ready else math.inf
        self.under_way[key] = (ticket, due, request[0])
        try:
            self.processes[slot].connection.send((key, request))
        except OSError:  # it died since its last answer
            self._replace(slot, "ProcessDied", self._death(slot))
        return ticket

    def collect(self, timeout: float | None = None) -> dict[int, tuple]:
        """The outcomes of submitted requests, by ticket, once at least one has come (or `timeout` seconds passed: maybe
        none); each is given once. An outcome: ("ok", ...), ("error", kind, traceback) or ("timeout",)."""
        deadline = math.inf if timeout is None else time.monotonic() + timeout
        while not self.outcomes and self.under_way and time.monotonic() <= deadline:
            self._pump(deadline)
        outcomes, self.outcomes = self.outcomes, {}
        return outcomes

    def _pump(self, deadline: float) -> None:
        """Wait for answers until `deadline` or the first request's or freeing's deadline, then take what came."""
        due = [due for _, due, _ in self.under_way.values()] + [d for p in self.processes for d in p.freeing.values()]
        wake = min([deadline, *due])
        wait_for = None if wake == math.inf else max(0.0, wake - time.monotonic())
        ready = wait([p.connection for p in self.processes], timeout=wait_for)
        for slot, process in enumerate(self.processes):
            if process.connection in ready:
                self._receive(slot)
        now = time.monotonic()
        for key, (_, due, _) in list(self.under_way.items()):
            if now >= due:
                self._abandon(key)
        for slot, process in enumerate(self.processes):
            if any(now >= due for due in process.freeing.values()):
                self._replace(slot, "ProcessReplaced", REPLACED)

    def _receive(self, slot: int) -> None:
        process = self.processes[slot]
        try:
            message = process.connection.recv()
        except (EOFError, OSError):
            if not process.ready:
                code = process.process.wait()
                raise UserCodeError(f"an environment process exited with code {code} while loading {self.spec}") from None
            self._replace(slot, "ProcessDied", self._death(slot))
            return
        if message == "ready":
            process.ready, due = True, time.monotonic() + self.timeout
            for key in process.keys & self.under_way.keys():
                ticket, _, kind = self.under_way[key]
                self.under_way[key] = (ticket, due, kind)
        elif isinstance(message, str):
            raise UserCodeError(f"{self.spec}: loading it in an environment process failed:\n{message}")
        elif message[0] == "freed":  # a timed-out episode's close() and call: whether the call ended in time
            process.freeing.pop(message[1], None)
            if not message[2]:
                self._replace(slot, "ProcessReplaced", REPLACED)
        elif message[0] in self.under_way:  # else the late answer of a call that timed out
            key, outcome = message
            ticket, _, kind = self.under_way.pop(key)
            self.outcomes[ticket] = outcome
            if kind == "finish" or outcome[0] != "ok":  # its object is closed
                self._forget(key)

    def _abandon(self, key: str) -> None:
        """End episode `key`, whose call is past its deadline: its process closes its object and says whether the call
        ended within GRACE_SECONDS."""
        ticket, _, _ = self.under_way.pop(key)
        self.outcomes[ticket] = ("timeout",)
        slot = self._forget(key)
        process = self.processes[slot]
        process.freeing[key] = time.monotonic() + GRACE_SECONDS + 1.0
        try:
            process.connection.send((key, ("abandon", GRACE_SECONDS)))
        except OSError:
            self._replace(slot, "ProcessDied", self._death(slot))

    def _forget(self, key: str) -> int:
        slot = self.home.pop(key)
        self.processes[slot].keys.discard(key)
        return slot

    def _death(self, slot: int) -> str:
        code = self.processes[slot].process.wait()
        return (
            f"the environment process died with exit code {code} while it held this episode's environment (a crash in C "
            "code, a signal, os._exit or the out-of-memory killer, in this episode's call or another's); a new process "
            "took its place\n"
        )

    def _replace(self, slot: int, kind: str, message: str) -> None:
        """End the process in `slot` with what it started and wrote, and the episodes it held: `kind` their error."""
        process = self.processes[slot]
        kill_session(process.process)
        process.connection.close()
        shutil.rmtree(process.folder, ignore_errors=True)
        for key in process.keys:
            outcome = ("error", kind, message)
            if key in self.under_way:
                self.outcomes[self.under_way.pop(key)[0]] = outcome
            else:
                self.lost[key] = outcome
            del self.home[key]
        self.processes[slot] = self._start()

    def close(self) -> None:
        """Close every object the processes hold (GRACE_SECONDS at most), then end them, their sessions and folders."""
        for process in self.processes:
            try:
                process.connection.send(("", ("shutdown", GRACE_SECONDS)))
            except OSError:
                pass
        deadline = time.monotonic() + GRACE_SECONDS + 1.0
        for process in self.processes:
            try:
                process.process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except Exception:  # subprocess.TimeoutExpired: its objects' close() did not end in time
                pass
            kill_session(process.process)
            process.connection.close()
            shutil.rmtree(process.folder, ignore_errors=True)
        self.processes = []


REPLACED = (
    "another episode's call in the environment process that held this episode's environment ran past "
    "--reward-timeout and did not end when its close() was called, so the process was replaced with every "
    "environment it held\n"
)


class EnvsInProcess:
    """EnvProcesses' requests made in this process, each at its submit, under `timeout` seconds (see time_limit), so
    that breakpoint() in an environment stops in the terminal."""

    def __init__(self, environments, timeout: float | None = None):
        self.environments, self.timeout = environments, timeout
        self.episodes, self.outcomes, self.tickets = {}, {}, itertools.count()

    def submit(self, key: str, request: tuple) -> int:
        from common.envs import LiveEpisode

        if request[0] == "open":
            self.episodes[key] = LiveEpisode(self.environments, request[1])
            request = ("open", request[2])
        episode = self.episodes[key]
        try:
            with time_limit(self.timeout):
                outcome = episode.handle(request)
        except CallTimeout:
            outcome = ("timeout",)
            episode.ended = True
            episode.close_quietly()
        if episode.ended:
            del self.episodes[key]
        ticket = next(self.tickets)
        self.outcomes[ticket] = outcome
        return ticket

    def collect(self, timeout: float | None = None) -> dict[int, tuple]:
        outcomes, self.outcomes = self.outcomes, {}
        return outcomes

    def close(self) -> None:
        for episode in self.episodes.values():
            episode.close_quietly()
        self.episodes = {}


class EpisodeThread(threading.Thread):
    """In an environment process: one episode's requests, made in turn on its live object, each answered on `send`."""

    def __init__(self, key: str, episode, send):
        super().__init__(daemon=True)
        self.key, self.episode, self.send = key, episode, send
        self.requests, self.abandoned = queue.SimpleQueue(), False
        self.start()

    def run(self) -> None:
        while not self.episode.ended:
            request = self.requests.get()
            if request is None:
                return
            outcome = self.episode.handle(request)
            if not self.abandoned:
                self.send((self.key, outcome))


def abandon(thread: EpisodeThread, grace: float, send) -> None:
    """Close a timed-out episode's object while its call still runs, and say whether the call ended within `grace`."""
    thread.abandoned, start = True, time.monotonic()
    thread.requests.put(None)
    closing = threading.Thread(target=thread.episode.close_quietly if not thread.episode.ended else None, daemon=True)
    thread.episode.ended = True
    closing.start()
    thread.join(grace)
    closing.join(max(0.0, grace - (time.monotonic() - start)))
    send(("freed", thread.key, not thread.is_alive()))


def close_all(threads, abandoning, grace: float) -> None:
    """Close the objects of the episodes still under way, each on a thread of its own, and let those being finished or
    abandoned end: `grace` seconds at most."""
    waits = list(abandoning)
    for thread in threads:
        if not thread.episode.ended:
            thread.episode.ended = True
            waits.append(threading.Thread(target=thread.episode.close_quietly, daemon=True))
            waits[-1].start()
        elif thread.is_alive():  # its finish under way
            waits.append(thread)
    deadline = time.monotonic() + grace
    for waiting in waits:
        waiting.join(max(0.0, deadline - time.monotonic()))


def serve(fd: int, spec: str) -> None:
    """An environment process: load the environments of `spec`, then take (episode key, request) messages on the socket
    `fd`, each episode's on its thread, until the pool shuts it down or the socket closes."""
    connection, sending = Connection(fd), threading.Lock()

    def send(message) -> None:
        with sending:
            connection.send(message)

    try:
        from common.envs import LiveEpisode, load_environments

        environments = load_environments(spec)
    except BaseException:
        connection.send(traceback.format_exc())
        return
    send("ready")
    threads, abandoning, grace = {}, [], GRACE_SECONDS
    while True:
        try:
            key, request = connection.recv()
        except (EOFError, OSError):
            break
        if request[0] == "shutdown":
            grace = request[1]
            break
        if request[0] == "abandon":
            abandoning.append(threading.Thread(target=abandon, args=(threads.pop(key), request[1], send), daemon=True))
            abandoning[-1].start()
            continue
        if request[0] == "open":
            threads = {k: thread for k, thread in threads.items() if thread.is_alive()}  # the episodes that ended go
            threads[key] = EpisodeThread(key, LiveEpisode(environments, request[1]), send)
            request = ("open", request[2])
        threads[key].requests.put(request)
    close_all(list(threads.values()), abandoning, grace)
    sys.stdout.flush()
    os._exit(0)  # a call that never ends keeps its thread: the process ends without waiting for it


if __name__ == "__main__":
    serve(int(sys.argv[1]), sys.argv[2])
