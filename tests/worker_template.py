"""Ray's workers for the tests' shared Ray instance, forked from a Python that made their imports once (torch, FSDP2,
torch's compiler, transformers' models, PEFT, common, what vLLM imports besides itself; not vLLM, not Ray) instead of
each importing them again (about 5 s a worker on 2 cores).

`python tests/worker_template.py SOCKET LAUNCHER`. Ray starts a worker as `LAUNCHER default_worker.py ARGS`, or through
`LAUNCHER setup_worker.py ... default_worker.py ARGS` (conftest makes LAUNCHER Ray's Python); worker_launcher.py asks
this template for a fork that runs the script as `python SCRIPT ARGS` would: its environment, folder, sys.path and
argv, and torch's thread count the OMP_NUM_THREADS that Ray sets."""

import importlib.util
import os
import runpy
import sys

BASE_PATH = sys.path[1:]  # what a fresh interpreter's sys.path holds after its script's folder

import torch  # noqa: E402
import torch.distributed.fsdp  # noqa: E402, F401
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402, F401
from transformers.models.llama import modeling_llama  # noqa: E402, F401  (SmolLM2)
from transformers.models.qwen2 import modeling_qwen2  # noqa: E402, F401  (the tiny model)
import peft  # noqa: E402, F401

# What an engine's `import vllm` and a first torch.compile (FlexAttention on the CPU) import besides vLLM's own modules,
# whose import patches torch's compiler, which a worker without an engine must not carry: vLLM's import 5.1 -> 2.7 s,
# a first compile 0.9 s less
import torch._inductor.compile_fx  # noqa: E402, F401
import torch._inductor.lowering  # noqa: E402, F401

if importlib.util.find_spec("vllm") is not None:
    import aiohttp  # noqa: F401
    import cv2  # noqa: F401
    import fastapi  # noqa: F401
    import openai  # noqa: F401
    import xgrammar  # noqa: F401

from script_server import listen, serve, take_over  # noqa: E402  (also imports every module of common, then freezes them)

# Not Ray: its C++ part reads the worker's settings (RAY_JOB_ID, ...) from the environment once, as it loads
assert "ray" not in sys.modules

if __name__ == "__main__":
    launcher = sys.argv[2]
    take_over(serve(listen(sys.argv[1]), new_session=False))
    sys.path[:] = [os.path.dirname(os.path.abspath(sys.argv[0])), *BASE_PATH]
    sys.executable = launcher  # setup_worker.py starts default_worker.py with it: a fork again
    # OpenMP read OMP_NUM_THREADS as torch loaded, in the template; Ray sets it as a worker takes its actor or task
    import ray._private.utils as ray_utils

    set_omp_num_threads_if_unset = ray_utils.set_omp_num_threads_if_unset

    def set_omp_and_torch_threads() -> bool:
        was_unset = set_omp_num_threads_if_unset()
        if "OMP_NUM_THREADS" in os.environ:
            torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
        return was_unset

    ray_utils.set_omp_num_threads_if_unset = set_omp_and_torch_threads
    if os.path.basename(sys.argv[0]) == "setup_worker.py":
        # It starts default_worker.py with the Python its runtime env names (the runtime env agent's): the launcher's
        from ray._private.runtime_env.context import RuntimeEnvContext

        exec_worker = RuntimeEnvContext.exec_worker

        def exec_forked_worker(context, *args):
            context.py_executable = launcher
            exec_worker(context, *args)

        RuntimeEnvContext.exec_worker = exec_forked_worker
    runpy.run_path(sys.argv[0], run_name="__main__")
