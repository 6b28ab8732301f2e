#!/usr/bin/env bash
# benchmarks/peer.py on the GPU host's 16 CPU cores, in one command of at most 6 minutes (the GPU is not used):
# the ceiling (dense_only), torchrec DMP table-wise and fxdist's servers with prefetch over sockets (separate
# processes, exact and with max_staleness=1; on 16 cores the trainers' pushes go from a sender thread, and
# the four systems of the DMP comparison, 3 interleaved rounds x 200 steps at 1e6 x 16 (about 280 s there), plus where a step goes
# (--profile) and every process's CPU a step (--cpu-account).
#
#   bash scripts/peer_16core.sh [peer.py arguments, replacing the defaults below]
#
# As scripts/gpu_checks.sh: where the machine lacks torchrec (a CUDA image with only torch), put its wheels in
# .whl/ first (torchrec 1.6.1, fbgemm-gpu-cpu 1.6.0, tensordict, iopath, pyvers for torch 2.11 / Python 3.12):
# they are installed under /tmp/site. fxdist is installed editable without dependencies, so that its pass entry
# points resolve. Output goes to $OUT (default /tmp/peer_16core): device.txt, peer.txt (the tables),
# peer_progress.txt, and peer_files.txt, the profiles and CPU accounts of peer.py's run directory in one file (the
# lent machine returns at most 8 files) from the run directory /tmp/peer_16core_run (or $PEER_RUN_DIR).
# PEER_TIMEOUT (seconds, default 320) bounds peer.py (its SIGTERM: peer.py kills the run in flight and prints the
# tables of the runs finished); each run is bounded by --timeout 120. PEER_CPUS (a taskset
# list, e.g. 0-1) pins peer.py and every process it starts to those cores: two or three pinned runs on disjoint
# cores then measure side by side, e.g. a 2-core run beside a 12-core one.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/peer_16core}
source scripts/device_env.sh || exit 1  # $OUT, $PY, the carried wheels, fxdist editable
"$PY" -c "import torch, torchrec; print('torch', torch.__version__, 'torchrec', torchrec.__version__)" \
  | tee "$OUT/device.txt" || exit 1
PIN=()
[ -n "${PEER_CPUS:-}" ] && PIN=(taskset -c "$PEER_CPUS")
{ "${PIN[@]}" nproc | sed 's/^/cpu cores: /'; echo "cores pinned: ${PEER_CPUS:-none}"; grep -m1 'model name' /proc/cpuinfo
  uptime; } | tee -a "$OUT/device.txt"
if [ $# -eq 0 ]; then
  set -- --sizes 1000000x16 --rounds 3 --steps 200 --warmup 10 \
    --systems dense_only dmp_tw fx_prefetch_0ms fx_stale1_0ms --profile 5 --cpu-account
fi
RUN_DIR=${PEER_RUN_DIR:-/tmp/peer_16core_run}
timeout "${PEER_TIMEOUT:-320}" "${PIN[@]}" "$PY" benchmarks/peer.py --timeout 120 --run-dir "$RUN_DIR" "$@" \
  2>"$OUT/peer_progress.txt" | tee "$OUT/peer.txt"
rc=${PIPESTATUS[0]}
for f in "$RUN_DIR"/*.txt; do [ -f "$f" ] && { echo "== $(basename "$f")"; cat "$f"; }; done >"$OUT/peer_files.txt"
grep '^  round' "$OUT/peer_progress.txt" | tail -20
[ "$rc" = 124 ] && echo "peer.py stopped after ${PEER_TIMEOUT:-320} s (PEER_TIMEOUT); its tables cover the runs finished"
exit "$rc"
