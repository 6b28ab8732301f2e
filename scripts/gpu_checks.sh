#!/usr/bin/env bash
# The checks that need a CUDA device, in one run: the CUDA tests of a GPU trainer with CPU parameter servers
# (tests/scheduling/test_ps_device.py) and benchmarks/gpu_ps.py. CI has no GPU; run this on a machine with one.
#
#   bash scripts/gpu_checks.sh [gpu_ps.py arguments]
#
# Where the machine lacks torchrec (a CUDA image with only torch), put its wheels in .whl/ first (torchrec,
# fbgemm-gpu-cpu, tensordict, iopath, pyvers for that Python): they are installed under /tmp/site. fxdist is
# installed editable without dependencies, so that its pass entry points resolve. Logs go to $OUT (default
# /tmp/gpu_checks). GPU_TESTS=0 skips the tests; FXDIST_PS_KERNEL=fbgemm gives the servers FBGEMM's kernel.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_checks}
source scripts/device_env.sh || exit 1  # $OUT, $PY, the carried wheels, fxdist editable
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/device.txt"
"$PY" -c "import torch, torchrec; print('torch', torch.__version__, 'torchrec', torchrec.__version__, 'cuda',
torch.cuda.is_available(), torch.cuda.get_device_name() if torch.cuda.is_available() else '')" | tee -a "$OUT/device.txt"
nproc | sed 's/^/cpu cores: /' | tee -a "$OUT/device.txt"
if [ "${GPU_TESTS:-1}" != 0 ]; then
  timeout 240 "$PY" -m pytest -q -rs tests/scheduling/test_ps_device.py 2>&1 | tee "$OUT/tests.txt" | tail -25
fi
timeout "${BENCH_TIMEOUT:-300}" "$PY" benchmarks/gpu_ps.py "$@" 2>&1 | tee "$OUT/gpu_ps.txt"
