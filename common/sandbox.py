"""A response's program run against test cases, contained: the built-in reward of code tasks (data_source "code").

A row's ground truth holds its tests, as JSON (a string) or a dict, in one of two forms:

    {"inputs": ["1 2\\n", ...], "outputs": ["3\\n", ...]}   stdin/stdout pairs: the output must match, up to
                                                            whitespace at the ends of lines and of the text
    {"asserts": ["assert add(1, 2) == 3", ...]}             statements run after the program

The program is the last ```python fenced block of the response (or the whole response when it has none). Each test
runs it once, with the standard library only, in a child process with the LIMITS below (a row can lower or raise
them under "limits" in its ground truth), in a fresh temporary folder as its working directory, with an empty
environment. On Linux it also runs in namespaces of its own (as root, or as a user where user namespaces are
allowed): no network, a read-only view of the files but its folder, a private /tmp and /dev/shm, a /proc of its own
processes, and its own process ids, so that every process it started ends with it; root's programs run as the user
nobody. What is not isolated: it can read any file its user may read. Elsewhere (macOS) only the CPU and wall-clock
limits, the output cap, the bound on processes and the working folder hold.

The built-in reward (`code_reward`) scores the share of tests passed; `all_tests_reward` scores 1 only when every
test passes (`--reward-fn common/sandbox.py:all_tests_reward`). Both also return the counts, logged as
reward/tests_passed and reward/tests. Programs run one at a time in each reward process, so --reward-workers bounds
how many run at once; a program's time counts in --reward-timeout, which code tasks may need to raise.
"""

from __future__ import annotations

import ctypes
import json
import math
import os
import re
import resource
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
import traceback

LIMITS = dict(
    memory_mb=512,  # address space: a Python program starts in under 100 MB
    cpu_seconds=2,
    wall_seconds=5,
    output_bytes=1 << 20,  # any file the program writes, stdout included
    processes=32,
)
NOBODY = 65534
CLONE_NEWNS, CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x00020000, 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 1, 2, 4, 8, 32, 4096, 0x4000, 0x40000
MOUNT_FLAGS = {"nosuid": MS_NOSUID, "nodev": MS_NODEV, "noexec": MS_NOEXEC}  # kept when remounting read-only
MNT_DETACH = 2
PR_SET_PDEATHSIG = 1
SETUP_FAILED = 125  # the launcher's exit code when the sandbox could not be set up


class SandboxError(RuntimeError):
    pass


def program_of(response: str) -> str:
    """The last ```python (or bare ```) fenced block of a response, or the whole response."""
    blocks = re.findall(r"```(?:python|py)?[ \t]*\n(.*?)```", response, flags=re.DOTALL)
    return blocks[-1] if blocks else response


def tests_of(ground_truth) -> tuple[list[tuple[str, str | None, str]], dict]:
    """The tests of a ground truth, each (program suffix, stdin or None, expected stdout or None), and its limits."""
    truth = json.loads(ground_truth) if isinstance(ground_truth, str) else dict(ground_truth)
    limits = LIMITS | truth.get("limits", {})
    if "asserts" in truth:
        return [("\n\n" + test + "\n", None, None) for test in truth["asserts"]], limits
    if "inputs" in truth and len(truth["inputs"]) == len(truth.get("outputs", ())):
        return [("", given, wanted) for given, wanted in zip(truth["inputs"], truth["outputs"])], limits
    raise ValueError(
        'a code row\'s ground truth holds {"inputs": [...], "outputs": [...]} of equal length, or {"asserts": [...]}; '
        f"got {str(ground_truth)[:200]!r}"
    )


def same_output(printed: str, wanted: str) -> bool:
    def lines(text):
        return [line.rstrip() for line in text.strip().splitlines()]

    return lines(printed) == lines(wanted)


def run_program(source: str, stdin: str | None, limits: dict) -> dict:
    """Run `source` once, contained (see the module's docstring). Returns its "status" ("exited", "killed",
    "timeout"), "returncode", and the start of its "stdout" and "stderr"."""
    folder = tempfile.mkdtemp(prefix="hybridrl_sandbox_")
    try:
        with open(os.path.join(folder, "main.py"), "w") as file:
            file.write(source)
        with open(os.path.join(folder, "stdin"), "w") as file:
            file.write(stdin or "")
        if os.geteuid() == 0:
            os.chown(folder, NOBODY, NOBODY)
        # The limits are set by a launcher that then execs the program: a child of a threaded process (the run's
        # driver) must not run Python between fork and exec.
        command = [sys.executable, "-I", "-S", os.path.abspath(__file__), folder, json.dumps(limits), str(os.getpid())]
        launcher = subprocess.Popen(command, stdin=subprocess.DEVNULL, start_new_session=True, env={})
        try:
            launcher.wait(timeout=limits["wall_seconds"] + 5)  # the launcher keeps the wall limit; this is its backstop
        except subprocess.TimeoutExpired:
            os.killpg(launcher.pid, signal.SIGKILL)
            launcher.wait()
        code = launcher.returncode
        setup_error = read_start(os.path.join(folder, "setup_error"), 8192) if code == SETUP_FAILED else ""
        if setup_error:  # not a program that exits with the launcher's code itself
            raise SandboxError(f"the sandbox could not start the program:\n{setup_error}")
        return dict(
            status="timeout" if code == 124 or code < 0 else "killed" if code >= 128 else "exited",
            returncode=code,
            stdout=read_start(os.path.join(folder, "stdout"), limits["output_bytes"]),
            stderr=read_start(os.path.join(folder, "stderr"), 4096),
        )
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def read_start(path: str, size: int) -> str:
    try:
        with open(path, "rb") as file:
            return file.read(size).decode(errors="replace")
    except OSError:
        return ""


def run_tests(solution_str: str, ground_truth) -> tuple[int, int]:
    """How many of a row's tests the response's program passes, and how many there are."""
    tests, limits = tests_of(ground_truth)
    program = program_of(solution_str)
    passed = 0
    for suffix, given, wanted in tests:
        result = run_program(program + suffix, given, limits)
        ok = result["status"] == "exited" and result["returncode"] == 0
        passed += ok and (wanted is None or same_output(result["stdout"], wanted))
    return passed, len(tests)


def code_reward(solution_str: str, ground_truth) -> dict:
    """The share of tests passed."""
    passed, total = run_tests(solution_str, ground_truth)
    return {"score": passed / total if total else 0.0, "tests_passed": passed, "tests": total}


def all_tests_reward(data_source, solution_str, ground_truth, extra_info) -> dict:
    """For --reward-fn: 1 only when every test passes; the counts as code_reward gives them."""
    result = code_reward(solution_str, ground_truth)
    return result | {"score": float(result["tests"] > 0 and result["tests_passed"] == result["tests"])}


def launch(folder: str, limits: dict, parent: int) -> int:
    """The launcher (this file run as a script, in a process of its own session): enter the namespaces, fork the
    program with its limits, and keep the wall-clock limit. Exits 124 on a timeout, 128 + the signal that ended the
    program, or the program's exit code."""
    libc = ctypes.CDLL(None, use_errno=True)
    root = os.geteuid() == 0
    if hasattr(libc, "prctl"):
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # a killed reward process takes its program with it
        if os.getppid() != parent:
            return 137
    pid = fork_confined(libc, folder, limits, root, start_program)
    deadline = time.monotonic() + limits["wall_seconds"]
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else 128 + os.WTERMSIG(status)
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return 124
        time.sleep(0.005)


def fork_confined(libc, folder: str, limits: dict, root: bool, start) -> int:
    """Enter new namespaces where the kernel allows them and fork the child in which `start(libc, folder, limits,
    processes, root, namespaced)` confines and execs the program: the child's process id. An error before the exec
    is written to the folder's setup_error, and the child exits SETUP_FAILED."""
    # The bound on processes counts every process of the user: nobody's for root, the user's own otherwise (counted
    # here, before the program's /proc shows its own processes alone).
    processes = limits["processes"] + (0 if root else processes_of(os.getuid()))
    # Opened before the namespaces: a file open for writing on a mount keeps it from turning read-only
    setup_error = os.open(os.path.join(folder, "setup_error"), os.O_WRONLY | os.O_CREAT, 0o600)
    namespaced = (
        hasattr(libc, "unshare")
        and libc.unshare(CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWNET | (0 if root else CLONE_NEWUSER)) == 0
    )
    pid = os.fork()  # in its own pid namespace: when it ends, every process it started ends too
    if pid == 0:
        try:
            start(libc, folder, limits, processes, root, namespaced)
        except BaseException:
            os.write(setup_error, traceback.format_exc().encode())
        finally:
            os._exit(SETUP_FAILED)
    os.close(setup_error)
    return pid


def start_program(libc, folder: str, limits: dict, processes: int, root: bool, namespaced: bool) -> None:
    """In the forked child (process 1 of its pid namespace, when namespaced): the program's view of the machine, its
    limits and its user, then exec."""
    python = os.path.realpath(sys.executable)  # the base interpreter: run with -I -S, the standard library only
    if namespaced:
        confine_files(libc, folder, root)  # and enters the folder, which its path no longer reaches
    else:
        os.chdir(folder)
    stdin = os.open("stdin", os.O_RDONLY)
    stdout = os.open("stdout", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    stderr = os.open("stderr", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    for fd, target in ((stdin, 0), (stdout, 1), (stderr, 2)):
        os.dup2(fd, target)
    memory = limits["memory_mb"] << 20
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    cpu = math.ceil(limits["cpu_seconds"])
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    resource.setrlimit(resource.RLIMIT_FSIZE, (limits["output_bytes"], limits["output_bytes"]))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
    if root and namespaced:  # without its own view of the files, nobody may not reach the interpreter: stay root
        os.fchown(stdout, NOBODY, NOBODY)
        os.fchown(stderr, NOBODY, NOBODY)
        os.setgroups([])
        os.setgid(NOBODY)
        os.setuid(NOBODY)
    resource.setrlimit(resource.RLIMIT_NPROC, (processes, processes))
    if hasattr(libc, "prctl"):
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)  # cleared by setuid: the launcher's death ends the program
    os.execve(python, [python, "-I", "-S", "main.py"], {})


def confine_files(libc, folder: str, root: bool) -> None:
    """Every file system read-only but the program's folder, which becomes its working directory /tmp/work; a
    private /tmp, /dev/shm and /var/tmp; a /proc of its own processes alone (no other process's environment to read);
    and, for root's program run as nobody, the interpreter's folder made reachable (it often lies under /root, which
    nobody may not enter)."""

    def mount(source, target, kind, flags, data=None):
        arguments = [None if a is None else os.fsencode(a) for a in (source, target, kind, data)]
        if libc.mount(arguments[0], arguments[1], arguments[2], flags, arguments[3]) != 0:
            raise OSError(ctypes.get_errno(), f"mount {source} on {target}: {os.strerror(ctypes.get_errno())}")

    mount(None, "/", None, MS_REC | MS_PRIVATE)
    mount(folder, folder, None, MS_BIND)
    os.chdir(folder)  # into the bind mount, the one place left writable; later mounts hide its path, not it
    with open("/proc/self/mountinfo") as file:
        mounts = [(line.split()[4], line.split()[5]) for line in file]
    for point, options in mounts:
        if point != folder:
            mount(None, point, None, MS_BIND | MS_REMOUNT | MS_RDONLY | sum(MOUNT_FLAGS.get(o, 0) for o in options.split(",")))
    base = os.path.dirname(os.path.dirname(os.path.realpath(sys.executable)))
    hidden = next((p for p in ancestors(base) if not os.stat(p).st_mode & stat.S_IXOTH), None)
    staged = ".python"  # in the folder, reached from the working directory once /tmp is hidden
    if root and hidden:
        os.mkdir(staged)
        mount(base, staged, None, MS_BIND)
    for place in ("/tmp", "/dev/shm", "/var/tmp"):
        if os.path.isdir(place):
            mount("tmpfs", place, "tmpfs", MS_NOSUID | MS_NODEV, "size=16m")
    if root and hidden:
        mount("tmpfs", hidden, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=755")
        os.makedirs(base, mode=0o755)
        mount(staged, base, None, MS_BIND)
        libc.umount2(os.fsencode(staged), MNT_DETACH)
        os.rmdir(staged)
    mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    os.mkdir("/tmp/work")
    mount(".", "/tmp/work", None, MS_BIND)
    os.chdir("/tmp/work")  # a path that resolves: the interpreter makes the program's path absolute


def ancestors(path: str) -> list[str]:
    """/a/b/c -> /a, /a/b, /a/b/c."""
    parts = path.strip("/").split("/")
    return ["/" + "/".join(parts[: i + 1]) for i in range(len(parts))]


def processes_of(uid: int) -> int:
    """How many processes `uid` runs now (0 where there is no /proc to tell)."""
    count = 0
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        try:
            count += entry.isdigit() and os.stat(f"/proc/{entry}").st_uid == uid
        except OSError:  # it ended meanwhile
            pass
    return count


if __name__ == "__main__":
    sys.exit(launch(sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])))
