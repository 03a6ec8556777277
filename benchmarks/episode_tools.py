"""The slow tool of benchmarks/bench_episodes.py, given as `--tools benchmarks/episode_tools.py:multiply`: the built-in
`multiply` (common/tools.py) under the same name, arguments and docstring, hence the same prompts, answering after a
random 0 to 2 s, as a search, a code run or a remote service would."""

import random
import time

from common.tools import multiply as instant_multiply

MAX_DELAY = 2.0  # seconds


def multiply(a: int, b: int) -> int:
    time.sleep(delay(a, b))
    return instant_multiply(a, b)


multiply.__doc__ = instant_multiply.__doc__  # the same schema as the built-in's, which the prompts render


def delay(a, b) -> float:
    """The seconds multiply(a, b) waits, drawn from its arguments: every loop that makes the same call waits as long."""
    return random.Random(f"multiply({a}, {b})").uniform(0.0, MAX_DELAY)
