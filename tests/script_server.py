"""A Python that has made the scripts' imports once, for the tests: a run of algos/<script> forks from it instead of
starting an interpreter that imports torch, transformers and Ray again (about 5 s a run on a 2-core machine).

`python tests/script_server.py SOCKET` serves the environment it was started with (helpers.py starts one per
environment). A run sends its argv, folder and environment with its stdout and stderr; the server answers with the
run's pid, then its exit code. The run then goes on as `python algos/<script> FLAGS` does: a session of its own, the
script as `__main__`, its exit code, signals and uncaught errors handled by Python itself (a traceback shows this
file's and runpy's frames above the script's)."""

import gc
import importlib
import json
import os
import pkgutil
import runpy
import select
import socket
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[0] = str(ROOT / "algos")  # where `python algos/<script>` finds its imports

from transformers import AutoTokenizer  # noqa: E402, F401  (every driver loads a tokenizer)

import common  # noqa: E402

for module in pkgutil.iter_modules(common.__path__):
    importlib.import_module(f"common.{module.name}")
# Out of the collector's sight: a run's collections skip the imports' objects, and so does its exit (about 0.8 s less)
gc.freeze()


def serve(listener: socket.socket, new_session: bool = True) -> dict:
    """Fork a run for each request, and send each run's exit code when it ends. Returns only in a run's process: its
    request, with its stdout and stderr in place."""
    running = {}  # pid -> the connection of the test that waits for it
    while True:
        if select.select([listener], [], [], 0.05)[0]:
            connection, _ = listener.accept()
            message, fds, _, _ = socket.recv_fds(connection, 1 << 20, 2)
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                listener.close()
                connection.close()
                if new_session:
                    os.setsid()
                stdin = os.open(os.devnull, os.O_RDONLY)
                for target, fd in zip((0, 1, 2), (stdin, *fds)):
                    os.dup2(fd, target)
                    os.close(fd)
                return json.loads(message)
            for fd in fds:
                os.close(fd)
            connection.send(str(pid).encode())
            running[pid] = connection
        while running:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            connection = running.pop(pid)
            connection.send(str(os.waitstatus_to_exitcode(status)).encode())
            connection.close()


def listen(path: str) -> socket.socket:
    """A socket that takes requests at `path`, a name it gets once it listens (the name the tests wait for)."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path + ".binding")
    listener.listen(64)
    os.rename(path + ".binding", path)
    return listener


def take_over(run: dict) -> None:
    """This process as the run's: its folder, its environment, its argv."""
    os.chdir(run["cwd"])
    os.environ.clear()
    os.environ.update(run["env"])
    sys.orig_argv, sys.argv = run["argv"], run["argv"][1:]


if __name__ == "__main__":
    take_over(serve(listen(sys.argv[1])))
    # Uncaught, an error or exit reaches Python as from the script itself: its excepthook, its exit code.
    runpy.run_path(sys.argv[0], run_name="__main__")
