"""The built-in `multiply` (common/tools.py) under the same name, arguments and docstring, answering after 0 to 2 s drawn
anew at each call from the machine's entropy, as a remote service's answer varies: two plays of the same episodes wait
differently (benchmarks/bench_episodes.py's repeat check: `--tools benchmarks/episode_tools_at_random.py:multiply`)."""

import random
import time

from common.tools import multiply as instant_multiply

MAX_DELAY = 2.0  # seconds


def multiply(a: int, b: int) -> int:
    time.sleep(random.SystemRandom().uniform(0.0, MAX_DELAY))
    return instant_multiply(a, b)


multiply.__doc__ = instant_multiply.__doc__  # the same schema as the built-in's, which the prompts render
