#!/usr/bin/env bash
# Run bench/gpu_check.py on a GPU machine, from the repository root: with ./.venv where it works
# there (a machine bootstrapped with scripts/bootstrap.sh), else with the machine's python3 and the
# wheels bench/gpu_check_bundle.sh left in .gpucheck/wheels (a lent machine with no network: a
# .venv made elsewhere points at an interpreter that is not there). The table goes to stdout; the
# rows to $OUT/gpu_check.json, the output to $OUT/gpu_check.log, the CUDA build's log beside them.
# Usage: bench/gpu_check_device.sh [gpu_check.py options]   (OUT defaults to ./gpu-check-out)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-check-out}
mkdir -p "$OUT"
if [ -x .venv/bin/python ] && .venv/bin/python -c 'import fleetserve, openai, pynvml' 2>/dev/null; then
  py=.venv/bin/python
else
  site=${GPU_CHECK_SITE:-/tmp/gpu-check-site}
  if ! compgen -G ".gpucheck/wheels/*.whl" >/dev/null; then
    echo "gpu_check_device: no working ./.venv and no .gpucheck/wheels: run bench/gpu_check_bundle.sh where pip has network" >&2
    exit 2
  fi
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --disable-pip-version-check \
    --upgrade --target "$site" .gpucheck/wheels/*.whl || exit 2
  export PYTHONPATH="$PWD/src:$site${PYTHONPATH:+:$PYTHONPATH}"
  py=python3
fi
echo "gpu_check_device: $($py --version 2>&1) ($py), $(nproc) cores" >&2
PYTHONUNBUFFERED=1 "$py" bench/gpu_check.py --json "$OUT/gpu_check.json" "$@" 2>&1 | tee "$OUT/gpu_check.log"
code=${PIPESTATUS[0]}
build_log=.gpucheck/build-cuda/gpu_check_build.log
[ -f "$build_log" ] && tail -c 4000000 "$build_log" >"$OUT/gpu_check_build.log"
exit "$code"
