#!/usr/bin/env bash
# Install fleetserve and run its main job: place the mixed-datacenter example and explain it.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh
.venv/bin/fleetserve plan --fleet examples/datacenter/fleet.yaml --deployments examples/datacenter/deployments.yaml "$@"
