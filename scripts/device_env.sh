# Sourced by the scripts run on the lent GPU host (gpu_checks.sh, peer_16core.sh), from the repository root,
# after `set -uo pipefail` and with OUT set: makes $OUT, sets PY and unbuffered output, installs the wheels
# carried in .whl/ (torchrec, fbgemm-gpu-cpu, tensordict, iopath, pyvers for that torch and Python) under
# /tmp/site on PYTHONPATH, and fxdist editable without dependencies (so its pass entry points resolve).
# Installs once per machine (a stamp under /tmp/site), so several scripts may source it one after another.
# Returns non-zero when an install fails.
mkdir -p "$OUT"
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
if compgen -G ".whl/*.whl" >/dev/null; then
  if [ ! -f /tmp/site/.fxdist-wheels ]; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
      || return 1
    touch /tmp/site/.fxdist-wheels
  fi
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
if [ ! -f /tmp/.fxdist-editable ]; then
  "$PY" -m pip install -q --no-index --no-deps --no-build-isolation -e . >/dev/null 2>&1 || return 1
  touch /tmp/.fxdist-editable
fi
