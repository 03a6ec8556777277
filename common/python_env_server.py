"""The loop of an episode's Python interpreter (common/python_env.py), run contained as `python -I -S main.py settings`.

It reads one request a line on its stdin ({"code": ...}), runs the code in one namespace kept for its whole life, and
writes one reply a line ({"output", "value", "error"}) on its stdout. The code's own stdout and stderr (its children's
too) go to a file, read back and emptied after each call, so that nothing the code prints reaches the pipe. Standard
library only: it runs with -I -S.
"""

import ast
import json
import os
import signal
import sys
import traceback

settings, namespace, running = {}, {"__name__": "__main__", "__builtins__": __builtins__}, False


def interrupt(signum, frame):
    if running:
        raise TimeoutError(f"the code ran past {settings['wall_seconds']} s and was interrupted")


def cell_error(error: BaseException) -> str:
    """The error as a Python shell shows it: the traceback from the cell's first frame on (the loop's and the
    parser's left out), its last lines."""
    frames = traceback.extract_tb(error.__traceback__)
    first = next((i for i, frame in enumerate(frames) if frame.filename == "<cell>"), len(frames))
    kept = [] if isinstance(error, SyntaxError) else frames[first:]
    lines = ["Traceback (most recent call last):\n", *traceback.format_list(kept)] if kept else []
    text = "".join(lines + traceback.format_exception_only(type(error), error))
    return "\n".join(text.splitlines()[-12:])


def run(code: str) -> dict:
    global running
    value, error = None, None
    try:
        tree = ast.parse(code, "<cell>")
        last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
        running = True
        signal.setitimer(signal.ITIMER_REAL, settings["wall_seconds"])
        exec(compile(tree, "<cell>", "exec"), namespace)
        if last is not None:
            result = eval(compile(ast.Expression(last.value), "<cell>", "eval"), namespace)
            value = None if result is None else repr(result)
    except BaseException as caught:  # SystemExit and KeyboardInterrupt included: the interpreter goes on
        error = cell_error(caught)
    finally:
        running = False
        signal.setitimer(signal.ITIMER_REAL, 0)
    try:
        sys.stdout.flush()
    except OSError:  # past the output bound
        pass
    size = os.lseek(1, 0, os.SEEK_END)
    printed = os.pread(1, min(size, settings["output_bytes"]), 0).decode(errors="replace")
    os.ftruncate(1, 0)  # opened to append: the next writes start at 0
    return {"output": printed, "value": value, "error": error}


def serve() -> None:
    """Take the standard streams over (requests and replies on duplicates; the code's output to a file), then answer
    each request line with the reply of its code."""
    requests = os.fdopen(os.dup(0), "rb")
    replies = os.fdopen(os.dup(1), "wb")
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    output = os.open("output", os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC, 0o600)
    os.dup2(output, 1)
    os.dup2(output, 2)
    sys.stdin = open(0, closefd=False)
    sys.stdout = sys.stderr = open(1, "w", closefd=False)
    os.close(output)  # fd 1 and 2 keep the file open
    signal.signal(signal.SIGALRM, interrupt)
    for line in requests:
        reply = run(json.loads(line)["code"])
        replies.write(json.dumps(reply).encode() + b"\n")
        replies.flush()


if __name__ == "__main__":  # a module of common/ that only runs as the interpreter's loop
    settings.update(json.loads(sys.argv[1]))
    serve()
