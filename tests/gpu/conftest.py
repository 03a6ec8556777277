"""The devices the tests of tests/gpu run on: the CPU always (CI runs them there), a CUDA GPU where there is one."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

DEVICES = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]


@pytest.fixture(params=DEVICES)
def device(request) -> str:
    return request.param
