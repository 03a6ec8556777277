"""The console a person reads, and all of it in the run's folder.

A run's console shows the run's own lines and its progress bar. The workers' output reaches it too: Ray forwards
every line a worker prints to the driver's sys.stdout and sys.stderr, prefixed with the worker's name and pid, and
the libraries there (vLLM, torch, transformers) warn and hint in every process, often once per tensor or per call.
Each line still goes to console.log in the run's folder; the console shows a worker's line once (the same line
from another worker, or with other numbers in it, is a repeat), and none of the hints that do not apply to a run or
that its user cannot act on (HIDDEN).
"""

from __future__ import annotations

import re
import sys
import threading
from pathlib import Path

# Library lines that say nothing a run's user can act on: vLLM's CPU backend hints at preloading libraries and binding
# NUMA nodes a run does not control, notes the Triton, torch.compile, oneDNN and SSM-cache paths it does not take, and
# warns that its own code calls a deprecated torch name; Ray notes its own start, log deduplication and authentication;
# FSDP2 warns that PEFT's model returns a view (in-place ops on it would skip a hook; the workers make none: the FSDP
# tests compare their gradients). Logged, not shown, and so is the source line Python prints under a hidden warning.
HIDDEN = re.compile(
    "|".join(
        [
            r"is not found in LD_PRELOAD",
            r"NUMA binding",
            r"Triton is installed, but doesn't include CPU backend",
            r"Triton is not installed",
            r"Model Runner V2 requires Triton",
            r"Enforce eager set, disabling torch\.compile",
            r"Inductor compilation was disabled",
            r"doesn't allow to use `torch\.set_num_threads`",
            r"Failed to create oneDNN linear",
            r"Reset SSM cache type to float32",
            r"`torch\.distributed\.reduce_op` is deprecated",
            r"Ray deduplicates logs by default",
            r"Token authentication is enabled for this Ray cluster",
            r"Started a local Ray instance",
            r"FSDP2-wrapped module \(\w+\) returned a view tensor",
        ]
    )
)
ANSI = re.compile(r"\x1b\[[0-9;]*m")
# Ray's prefix of a forwarded line, "(PolicyWorker pid=123)" or "(pid=123, ip=...)", and vLLM's of its own processes
WORKER = re.compile(r"^\((?:[\w.]+ )?pid=\d+(?:, ip=[^)]*)?\)\s?")
PROGRESS = re.compile(r"\d+%[^|]*\|")  # a library's progress bar, as a worker's line: loading or writing weights
# Where a library's line comes from, "[utils.py:333]" or "fsdp_state.py:331:": one warning, whatever tensor it names
SOURCE = re.compile(r"[\w.-]+\.py:\d+")
PYTHON_WARNING = re.compile(r"\.py:\d+: \w*Warning: ")  # warnings' format: "file.py:12: FutureWarning: message", then
SOURCE_LINE = re.compile(r"^  \S")  # the line of source it names, indented by two spaces


class Screen:
    """What the two streams of a run's console share: the progress bar that stands on the last line, and one lock."""

    def __init__(self):
        self.bar = ""  # the bar as last drawn, "" once a newline ends its line
        self.lock = threading.RLock()  # re-entrant: a signal handler's print may come in the middle of a write


class Console:
    """A stream that writes everything to `log` and shows on `shown` what a person reads (see the module's doc). A line
    is judged whole: each thread's unfinished line is kept apart (Ray forwards the workers' lines from a thread of its
    own, which may write between the two writes of a `print` in the main thread). A line shown while the progress bar
    stands on the last line goes above the bar, which is drawn again below it."""

    def __init__(self, shown, log, screen: Screen | None = None):
        self.shown, self.log, self.seen = shown, log, set()
        self.screen = screen or Screen()
        self.pending: dict[int, str] = {}  # by thread
        self.hid_warning: set[str] = set()  # the processes whose last line was a hidden Python warning

    def write(self, text: str) -> int:
        thread = threading.get_ident()
        with self.screen.lock:
            self.log.write(text)
            if text.startswith("\r") and thread not in self.pending:  # the progress bar redrawn in place
                self.shown.write(text)
                self.screen.bar = text.rsplit("\n", 1)[-1]
                return len(text)
            *lines, pending = (self.pending.pop(thread, "") + text).split("\n")
            if pending:
                self.pending[thread] = pending
            for line in lines:
                if self.shows(line):
                    self.show(line)
        return len(text)

    def show(self, line: str) -> None:
        """`line` on the console; above the progress bar where one stands on the last line: the bar's line cleared (on a
        terminal; elsewhere ended), the line written, the bar drawn again. An empty line (the bar's own end) ends it."""
        bar = self.screen.bar
        if not (bar and line):
            self.shown.write(line + "\n")
            self.screen.bar = ""
            return
        self.shown.write(("\r\x1b[2K" if self.shown.isatty() else "\n") + line + "\n" + bar)
        self.shown.flush()

    def shows(self, line: str) -> bool:
        """Whether the console shows `line`: the run's own lines always; a worker's line the first time only."""
        plain = ANSI.sub("", line)
        worker = WORKER.match(plain)  # a worker's prefix; none on the run's own lines
        process, message = (worker.group().strip(), plain[worker.end() :]) if worker else ("", plain)
        if HIDDEN.search(plain):
            if PYTHON_WARNING.search(plain):
                self.hid_warning.add(process)
            return False
        if process in self.hid_warning:  # the source lines under it (two where Ray folded a repeated warning away)
            if SOURCE_LINE.match(message):
                return False
            self.hid_warning.discard(process)
        if worker is None:
            return True
        message = re.sub(r"\[repeated \d+x across cluster\].*", "", WORKER.sub("", message))
        if not message.strip() or PROGRESS.search(message):
            return False
        source = SOURCE.search(message)
        key = source.group() if source else " ".join(word for word in message.split() if not re.search(r"\d", word))
        if key in self.seen:
            return False
        self.seen.add(key)
        return True

    def flush(self) -> None:
        self.log.flush()
        self.shown.flush()

    def isatty(self) -> bool:
        return self.shown.isatty()

    def fileno(self) -> int:
        return self.shown.fileno()

    def __getattr__(self, name):  # encoding, errors and the rest, as the stream shown has them
        return getattr(self.shown, name)


def start_console(run_dir: Path) -> None:
    """From now on, this process's output goes whole to `run_dir`/console.log and, as Console filters it, to the
    console."""
    log, screen = open(run_dir / "console.log", "a", buffering=1), Screen()
    sys.stdout, sys.stderr = Console(sys.stdout, log, screen), Console(sys.stderr, log, screen)
    print(f"the run's whole output, the workers' included: {run_dir / 'console.log'}")
