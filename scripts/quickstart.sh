#!/usr/bin/env bash
# Install fleetserve (and llama-server: built from source the first time, unless one is on PATH)
# and run its main job:
# `fleetserve up --model tiny` — control plane and agent on this machine over a SQLite file,
# serving a tiny model with llama.cpp on the CPU through the OpenAI API. It prints a chat
# completion answered by llama-server and a curl line; Ctrl-C stops everything.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh
exec .venv/bin/fleetserve up --model tiny "$@"
