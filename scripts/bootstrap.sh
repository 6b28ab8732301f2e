#!/usr/bin/env bash
# Create .venv and install fxdist with its pinned dependencies. Idempotent: a second run with an
# unchanged requirements.txt returns at once (a stamp file records what was installed).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
VENV=.venv
STAMP=$VENV/.fxdist-installed
want=$(cat requirements.txt pyproject.toml setup.py scripts/bootstrap.sh | sha256sum | cut -d' ' -f1)

# Debian packages used by the tests: graphviz's `dot` (graph drawing) and a Prometheus server.
need_apt=()
command -v dot >/dev/null 2>&1 || need_apt+=(graphviz)
command -v ip >/dev/null 2>&1 || need_apt+=(iproute2)  # tests/jobs/test_cluster.py: network namespaces
command -v prometheus >/dev/null 2>&1 || [ -x /usr/bin/prometheus ] || need_apt+=(prometheus)
command -v chromium >/dev/null 2>&1 || need_apt+=(chromium)  # tests/test_docs_site.py: the built site, headless
if [ ${#need_apt[@]} -gt 0 ]; then
  if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    echo "bootstrap: installing Debian packages: ${need_apt[*]}"
    apt-get update -qq >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need_apt[@]}" >/dev/null
  else
    echo "bootstrap: warning: cannot install ${need_apt[*]} (needs apt-get as root); tests that use them will skip" >&2
  fi
fi
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then
  exit 0
fi
echo "bootstrap: creating $VENV and installing pinned dependencies (first run takes a few minutes)"
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
# pip warns about the machine's optional local index folders; keep only real messages.
pip() { "$VENV/bin/python" -m pip "$@" 2>&1 | { grep -v "^WARNING: Location 'file:" || true; }; return "${PIPESTATUS[0]}"; }
pip install -q --upgrade pip
# torch first and pinned, so no resolver can swap in a CUDA build.
pip install -q torch==2.13.0
pip install -q -r requirements.txt
# torchrec 1.8.0 names the CUDA fbgemm-gpu; we use fbgemm-gpu-cpu instead.
pip install -q --no-deps torchrec==1.8.0
# setuptools warns that an editable install is one (BuildBackendWarning, a UserWarning): expected here. Built with
# the venv's pinned setuptools (no isolated build env to download); the compiled kernels are not built for it
# (setup.py: the source tree compiles them at first use).
PYTHONWARNINGS=ignore::UserWarning pip install -q --no-deps --no-build-isolation -e .
echo "$want" > "$STAMP"
