#!/usr/bin/env bash
# Create .venv and install fxdist with its pinned dependencies. Idempotent: a second run with an
# unchanged requirements.txt returns at once (a stamp file records what was installed).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
VENV=.venv
STAMP=$VENV/.fxdist-installed
want=$(cat requirements.txt pyproject.toml scripts/bootstrap.sh | sha256sum | cut -d' ' -f1)
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then
  exit 0
fi
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip() { "$VENV/bin/python" -m pip "$@"; }
pip install -q --upgrade pip
# torch first and pinned, so no resolver can swap in a CUDA build.
pip install -q torch==2.13.0
pip install -q -r requirements.txt
# torchrec 1.8.0 names the CUDA fbgemm-gpu; we use fbgemm-gpu-cpu instead.
pip install -q --no-deps torchrec==1.8.0
pip install -q --no-deps -e .
echo "$want" > "$STAMP"
