#!/usr/bin/env bash
# For a GPU machine without internet access that has torch, transformers, peft and accelerate: run on a machine with
# internet access, it puts into .whl/ (ignored by git) what benchmarks/gpu_check.py and gpu_step_trl.py import beyond
# those, for the GPU machine's Python (3.12 unless given: `benchmarks/gpu_check_wheels.sh 3.11`) on x86-64:
#   - tyro and what it needs (the scripts' flags);
#   - Ray, this environment's version, as ray.tar.xz: its wheel without what the project never imports (rllib, data,
#     train, tune, serve, llm, its Java jars, the dashboard's web client), tarred and compressed with xz -6, with
#     jsonschema and what it needs;
#   - TRL and datasets with dill and multiprocess, for benchmarks/gpu_step_trl.py; never a dependency of hybridrl.
# It prints the size of it all (about 28 MB). On the GPU machine, install the wheels and unpack Ray into one folder on
# PYTHONPATH (docs/gpu-check.md).
set -euo pipefail
cd "$(dirname "$0")/.."
python_version="${1:-3.12}"
ray_version="$(python3 -c 'import importlib.metadata as m; print(m.version("ray"))')"
download() {
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$python_version" --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        --platform any -d "$@"
}
rm -rf .whl && mkdir -p .whl
download .whl tyro==1.0.17 docstring-parser==0.18.0 typeguard==4.6.1 typing-extensions==4.16.0
download .whl jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==0.30.0
download .whl trl==1.16.0 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19
staging="$(mktemp -d)"
trap 'rm -rf "$staging"' EXIT
download "$staging" "ray==$ray_version"
unzip -q "$staging"/ray-*.whl -d "$staging/site"  # unzip keeps the executables' modes
rm -rf "$staging"/site/ray/{rllib,data,train,tune,serve,llm,jars,dashboard/client}
tar -C "$staging/site" -cf - . | xz -6 -T0 >.whl/ray.tar.xz
echo "Ray $ray_version for Python $python_version, pruned: $(du -h .whl/ray.tar.xz | cut -f1)"
du -ch .whl/* | tail -1
