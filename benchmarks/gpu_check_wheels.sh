#!/usr/bin/env bash
# Run here, before a device check: downloads into .whl/ (ignored by git) the wheels that the one-process path imports
# and the device machine lacks (tyro and what it needs), for its Python 3.12 on x86-64. The device's command installs
# them from there (docs/gpu-check.md).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl tyro==1.0.17 docstring-parser==0.18.0 typeguard==4.6.1 typing-extensions==4.16.0
du -sh .whl
