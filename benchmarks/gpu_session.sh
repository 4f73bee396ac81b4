#!/usr/bin/env bash
# One call on the GPU machine: build, GPU tests, benchmarks; the summary is printed last.
# Usage: STAGES="build tests bench sweeps" benchmarks/gpu_session.sh   (logs and results under $OUT)
# At most a handful of files land in $OUT: *.log, results.tgz (JSON + PNG), summary.txt.
set -u
OUT=${OUT:-/tmp/ep_plugin_out}
mkdir -p "$OUT" "$OUT/results_dir"
# ep_plugin never uses NVLink multicast; keep it off in every process.
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
STAGES=${STAGES:-"build tests bench"}
TEST_TIMEOUT=${TEST_TIMEOUT:-900}
# Stages that would start after BUDGET_S seconds are skipped (the device call has a hard limit).
BUDGET_S=${BUDGET_S:-100000}
PYTEST_ARGS=${PYTEST_ARGS:-"tests/test_native_layout.py tests/test_native_intranode.py"}
summary="$OUT/summary.txt"
: > "$summary"

stage() {  # stage NAME COMMAND...: run, log, record rc and duration
  local name=$1; shift
  local start=$SECONDS
  if [ "$SECONDS" -ge "$BUDGET_S" ]; then
    echo "$name: skipped (time budget of $BUDGET_S s spent): $*" >> "$summary"
    return 0
  fi
  echo "=== $name: $*" >> "$OUT/$name.log"
  "$@" >> "$OUT/$name.log" 2>&1
  local rc=$?
  echo "$name: rc=$rc, $((SECONDS - start)) s" >> "$summary"
  return $rc
}

bench() {  # bench NAME ARGS...: one `ep-plugin bench` run with its JSON kept
  local name=$1; shift
  stage bench timeout "${BENCH_TIMEOUT:-300}" python3 -m ep_plugin bench --out "$OUT/results_dir/$name.json" "$@"
}

for s in $STAGES; do
  case $s in
    build)
      { nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; nvidia-smi topo -m; } > "$OUT/build.log" 2>&1
      stage build python3 -m pip install --no-build-isolation --no-deps -e . || { cat "$summary"; tail -40 "$OUT/build.log"; exit 1; }
      ;;
    tests)
      # With DEADLINE_S set, the tests get what is left of it (less a margin for the summary).
      [ -n "${DEADLINE_S:-}" ] && TEST_TIMEOUT=$(( DEADLINE_S - SECONDS - 20 < TEST_TIMEOUT ? DEADLINE_S - SECONDS - 20 : TEST_TIMEOUT ))
      stage tests timeout "$TEST_TIMEOUT" python3 -m pytest -q -rs --durations=15 $PYTEST_ARGS
      ;;
    bench)
      bench bf16_sms24 --num-sms 24 --dtype bf16
      bench fp8_sms24 --num-sms 24 --dtype fp8
      bench bf16_sms16 --num-sms 16 --dtype bf16
      bench fp8_sms16 --num-sms 16 --dtype fp8
      ;;
    tuning)  # ring and chunk sizes (dispatch and combine alike), 24 SMs
      for pair in "4 128" "16 512"; do
        set -- $pair
        printf 'dispatch: {nvl_chunked_send_tokens: %s, nvl_chunked_recv_tokens: %s}\ncombine: {nvl_chunked_send_tokens: %s, nvl_chunked_recv_tokens: %s}\n' \
          "$1" "$2" "$1" "$2" > "/tmp/tuning_$1_$2.yaml"
        bench "tuning_send$1_recv$2" --config "/tmp/tuning_$1_$2.yaml" --num-sms 24 --no-baseline
      done
      ;;
    sweeps)
      bench sweep_sms --sweep num_sms=8,16,24,32,48 --no-baseline --warmup 2 --iters 10 --plot "$OUT/results_dir/sweep_sms.png"
      bench sweep_tokens --num-sms 24 --sweep tokens=128,512,1024,2048,4096,8192,16384 --no-baseline --warmup 2 --iters 10 \
        --plot "$OUT/results_dir/sweep_tokens.png"
      ;;
  esac
done

tar -czf "$OUT/results.tgz" -C "$OUT" results_dir 2>/dev/null && rm -rf "$OUT/results_dir"
echo "===== tail of logs ====="
for f in "$OUT"/*.log; do echo "--- $f"; tail -25 "$f"; done
echo "===== summary ====="
cat "$summary"
grep -h -A12 "^ep_plugin bench" "$OUT/bench.log" 2>/dev/null | grep -v "^--$" | head -80
