#!/usr/bin/env bash
# One call on the GPU machine: build, GPU tests, benchmarks; the summary is printed last.
# Usage: STAGES="build tests bench" bash benchmarks/gpu_session.sh   (results.tgz: logs and JSONs; summary.txt; under $OUT)
#
# Stages (run in the order given):
#   build      pip install -e . (both extensions); GPU names and topology into build.log
#   deepep     build DeepEP V1 from the carried .peers/ folder (../shared/peers; the device call carries `.peers`)
#              into /tmp/deepep, so that `bench` times it in the same run (`--baseline deepep`); with `build`
#              in the same call it builds while ep_plugin does
#   share      start CUDA MPS so that RANKS_PER_GPU (default 2) ranks share each GPU (correctness only: the
#              "links" are the GPU's own memory); set BENCH_RANKS to bench more ranks than GPUs
#   unshare    stop that MPS daemon
#   tests      pytest $PYTEST_ARGS (default: the native normal-mode files), -k "$PYTEST_K" if set
#   suite      every test file that uses GPUs, file by file (a summary line each) until DEADLINE_S, in passes
#              (SUITE_PASSES): `2`, the files of SUITE_A and SUITE_B at 2 ranks, in two streams on the GPU pairs
#              (0,1) and (2,3) where 4 GPUs are present (at 2 ranks the whole suite takes more than one call:
#              set SUITE_A / SUITE_B to the files of this call); `4a`, the intranode file at 4 ranks
#              (EP_TEST_RANKS=4); `4b`, the other rank-dependent files at 4 ranks. Carry .whl (megatron-core)
#              and build `deepep` first for the Megatron and DeepEP cases.
#   timeouts   the tests that end in a device trap by design (a missing peer, an out-of-range id, ranks that
#              disagree), each file alone under `timeout -k`
#   bench      ep-plugin bench, normal mode: BF16/FP8 x 24/16 SMs, the reference and the P2P ceiling in the same run
#   sweeps     SM sweep 8..48 and token sweep 128..16384, with plots
#   rings      the SM combine's rings at every GPU's rank count, send chunk / ring tokens (RING_CONFIGS, default
#              "1/64 2/64 2/128 2/256 4/256 9/256": pipelines 2 to 8 chunks deep, and DeepEP's), then the SM sweep with DeepEP beside
#   ll         the native low-latency tests (LL_TESTS=0 skips them), then benchmarks/bench_low_latency.py
#   internode  the native internode tests, then the bench on 2 emulated nodes of 1 GPU (NVLink underneath), direct
#              stores and the network path (`network.force_puts`)
#   megatron   the Megatron GPU tests and the layer benchmark (carry .whl with the megatron-core cp312 wheel:
#              python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#                --platform manylinux_2_28_x86_64 -d .whl megatron-core==0.19.2)
#   sum        the 2-rank combine's sum alone by SM count (benchmarks/probes/sm_rate.cu `sum`): fp32 and bf16 pairs,
#              L2 as left or flushed, the combine's per-token steps one by one (on one GPU: the local rows only);
#              then the library's reduction kernel alone (benchmarks/probes/staged_reduce.cu, one GPU, checked);
#              their rows into the summary
#   host       the host's time per call of layout / dispatch / cached dispatch / combine, then eager low-latency
#              pairs and layouts beside DeepEP V1 (benchmarks/profile_host.py, --eager)
#
# EP_TEST_RANKS=4 (or 8) runs the multi-rank tests at that many ranks; the benchmarks use every GPU.
# A device call lasts at most 10 minutes: split the stages over calls and set DEADLINE_S a little under the
# call's limit so that the tests stop in time and the summary still prints.
set -u
OUT=${OUT:-/tmp/ep_plugin_out}
rm -rf "$OUT/results_dir"  # only this call's results come back
mkdir -p "$OUT" "$OUT/results_dir"
# ep_plugin never uses NVLink multicast; keep it off in every process.
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
STAGES=${STAGES:-"build tests bench"}
TEST_TIMEOUT=${TEST_TIMEOUT:-900}
BUDGET_S=${BUDGET_S:-100000}  # stages that would start after BUDGET_S seconds are skipped
PYTEST_ARGS=${PYTEST_ARGS:-"tests/test_native_layout.py tests/test_native_intranode.py"}
BASELINE_ARGS=""             # `--baseline deepep` once the deepep stage has built it
summary="$OUT/summary.txt"
: > "$summary"

stage() {  # stage NAME COMMAND...: run, log, record rc and duration
  local name=$1; shift
  local start=$SECONDS
  if [ "$SECONDS" -ge "$BUDGET_S" ]; then
    echo "$name: skipped (time budget of $BUDGET_S s spent): $*" >> "$summary"
    return 0
  fi
  echo "=== $name ($(date +%T)): $*" >> "$OUT/$name.log"
  "$@" >> "$OUT/$name.log" 2>&1
  local rc=$?
  echo "$name: rc=$rc, $((SECONDS - start)) s" >> "$summary"
  return $rc
}

# The GPU-using test files, in two halves of similar length at 2 ranks; the rank-dependent ones at 4.
SUITE_A=${SUITE_A:-"tests/test_native_intranode.py tests/test_cli.py tests/test_permute.py tests/test_reference_normal.py
  tests/test_reference_low_latency.py tests/test_launch.py tests/test_examples.py tests/test_native_memcheck.py"}
SUITE_B=${SUITE_B:-"tests/test_native_low_latency.py tests/test_deepep_compat.py tests/test_native_layout.py
  tests/test_output_region.py tests/test_native_internode.py tests/test_megatron_gpu.py
  tests/test_megatron_integration.py tests/test_torch_grouped_experts.py tests/test_torch_outputs.py"}
SUITE_4="tests/test_native_low_latency.py tests/test_deepep_compat.py tests/test_native_internode.py tests/test_native_memcheck.py"

suite_pass() {  # suite_pass NAME GPUS FILES...: each file's tests on those GPUs (all if GPUS is empty), a line each
  local name=$1 gpus=$2 file left start; shift 2
  for file in "$@"; do
    left=$(time_left 20)
    if [ "$left" -lt 30 ]; then echo "$name: $file not run (deadline)" >> "$summary"; continue; fi
    start=$SECONDS
    # SIGINT first: pytest then names the test it was in and prints its summary.
    env ${gpus:+CUDA_VISIBLE_DEVICES=$gpus} PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}" \
      timeout -s INT -k 20 "$left" python3 -m pytest -q -rfEs --durations=5 ${SUITE_K:+-k "$SUITE_K"} "$file" >> "$OUT/$name.log" 2>&1
    echo "$name: $file rc=$?, $((SECONDS - start)) s ($(grep -E "passed|failed|skipped|error" "$OUT/$name.log" | tail -1))" \
      >> "$summary"
  done
}

bench() {  # bench NAME ARGS...: one `ep-plugin bench` run with its JSON kept
  local name=$1; shift
  stage bench timeout "${BENCH_TIMEOUT:-300}" python3 -m ep_plugin bench --out "$OUT/results_dir/$name.json" \
    ${BENCH_RANKS:+--ranks "$BENCH_RANKS"} "$@"
}

time_left() {  # seconds of DEADLINE_S left, less a margin for the summary
  echo $(( ${DEADLINE_S:-100000} - SECONDS - $1 ))
}

for s in $STAGES; do
  case $s in
    build)
      { nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; nvidia-smi topo -m; } > "$OUT/build.log" 2>&1
      # A later deepep stage builds DeepEP V1 meanwhile (the two builds take about as long as one).
      if [[ " $STAGES " == *" deepep "* ]] && [ -f .peers/build_deepep_v1.sh ]; then
        stage deepep bash .peers/build_deepep_v1.sh .peers/deepep-v1 /tmp/deepep & deepep_build=$!
      fi
      stage build python3 -m pip install --no-build-isolation --no-deps -e . || { cat "$summary"; tail -40 "$OUT/build.log"; exit 1; }
      ;;
    deepep)
      if [ -n "${deepep_build:-}" ]; then
        wait "$deepep_build"; deepep_rc=$?
      elif [ -f .peers/build_deepep_v1.sh ]; then
        stage deepep bash .peers/build_deepep_v1.sh .peers/deepep-v1 /tmp/deepep; deepep_rc=$?
      else
        echo "deepep: skipped (carry .peers: a copy of ../shared/peers)" >> "$summary"; deepep_rc=1
      fi
      if [ "$deepep_rc" = 0 ]; then
        export PYTHONPATH=/tmp/deepep${PYTHONPATH:+:$PYTHONPATH}
        BASELINE_ARGS="--baseline deepep"
      fi
      ;;
    share)
      per_gpu=${RANKS_PER_GPU:-2}
      export CUDA_MPS_PIPE_DIRECTORY=/tmp/ep_mps_pipe CUDA_MPS_LOG_DIRECTORY=/tmp/ep_mps_log
      mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
      # NOTE: NVSHMEM shares a GPU between PEs under MPS when their active-thread shares add up to at most 100%.
      if stage share nvidia-cuda-mps-control -d && stage share python3 -c "import torch; torch.ones(1, device='cuda').sum().item()" \
          && echo get_server_list | nvidia-cuda-mps-control | grep -q '[0-9]'; then
        export EP_PLUGIN_RANKS_PER_GPU=$per_gpu CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=$((100 / per_gpu))
        # A test case asks for at most the SMs of a rank's share (a ring kernel's blocks must all be resident).
        EP_TEST_MAX_SMS=$(python3 -c "import torch; print(torch.cuda.get_device_properties(0).multi_processor_count)")
        export EP_TEST_MAX_SMS
        echo "share: CUDA MPS runs; $per_gpu ranks per GPU, $CUDA_MPS_ACTIVE_THREAD_PERCENTAGE% of each GPU" \
             "($EP_TEST_MAX_SMS SMs) per rank" >> "$summary"
      else
        echo "share: CUDA MPS did not start (see share.log and $CUDA_MPS_LOG_DIRECTORY); ranks keep their own GPUs" >> "$summary"
        cat "$CUDA_MPS_LOG_DIRECTORY"/*.log >> "$OUT/share.log" 2>/dev/null
      fi
      ;;
    unshare)
      CUDA_MPS_PIPE_DIRECTORY=/tmp/ep_mps_pipe nvidia-cuda-mps-control <<< quit >> "$OUT/share.log" 2>&1
      sleep 2
      unset EP_PLUGIN_RANKS_PER_GPU CUDA_MPS_ACTIVE_THREAD_PERCENTAGE CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY \
        EP_TEST_MAX_SMS
      echo "unshare: MPS stopped; ranks keep their own GPUs" >> "$summary"
      ;;
    tests)
      left=$(time_left 20)
      [ "$left" -lt "$TEST_TIMEOUT" ] && TEST_TIMEOUT=$left
      stage tests timeout -k 10 "$TEST_TIMEOUT" python3 -m pytest -q -rs --durations=25 $PYTEST_ARGS \
        ${PYTEST_K:+-k "$PYTEST_K"}
      ;;
    suite)
      ls .whl/megatron_core-*.whl > /dev/null 2>&1 && \
        python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl >> "$OUT/tests.log" 2>&1
      for pass in ${SUITE_PASSES:-2}; do
        case $pass in
          2)
            if [ "$(nvidia-smi -L | wc -l)" -ge 4 ]; then
              suite_pass suite2a 0,1 $SUITE_A & suite_pass suite2b 2,3 $SUITE_B & wait
            else
              suite_pass suite2 "" $SUITE_A $SUITE_B
            fi
            ;;
          # The intranode tests of one rank ran in pass 2.
          4a) EP_TEST_RANKS=4 SUITE_K="not test_cases_one_rank and not at_one_rank" \
                suite_pass suite4a "" tests/test_native_intranode.py ;;
          4b) EP_TEST_RANKS=4 suite_pass suite4b "" $SUITE_4 ;;
          *) echo "suite: unknown pass $pass (2, 4a, 4b)" >> "$summary" ;;
        esac
      done
      ;;
    timeouts)
      # -s shows the device's report of the wait that timed out.
      for f in tests/test_native_intranode.py tests/test_native_low_latency.py tests/test_native_internode.py; do
        limit=100
        left=$(time_left 15)
        [ "$left" -lt "$limit" ] && limit=$left
        [ "$limit" -lt 30 ] && { echo "timeouts: skipped $f (deadline)" >> "$summary"; continue; }
        stage timeouts timeout -k 5 "$limit" python3 -m pytest -q -rs -s -o faulthandler_timeout=$((limit - 10)) \
          "$f" -k "missing_peer or out_of_range or disagree"
      done
      ;;
    bench)
      for dtype in bf16 fp8; do
        for sms in 24 16; do
          bench "${dtype}_sms${sms}" --num-sms "$sms" --dtype "$dtype" $BASELINE_ARGS
        done
      done
      ;;
    sweeps)
      bench sweep_sms --sweep num_sms=8,16,24,32,48 --no-baseline --warmup 2 --iters 10 --plot "$OUT/results_dir/sweep_sms.png"
      bench sweep_tokens --num-sms 24 --sweep tokens=128,512,1024,2048,4096,8192,16384 --no-baseline --warmup 2 --iters 10 \
        --plot "$OUT/results_dir/sweep_tokens.png"
      ;;
    rings)
      for ring in ${RING_CONFIGS:-1/64 2/64 2/128 2/256 4/256 9/256}; do
        name="rings_${ring%/*}_${ring#*/}"
        printf 'combine: {nvl_chunked_send_tokens: %s, nvl_chunked_recv_tokens: %s}\n' "${ring%/*}" "${ring#*/}" \
          > "/tmp/$name.yaml"
        bench "$name" --config "/tmp/$name.yaml" --no-baseline --no-check
      done
      bench sweep_sms_combine --sweep num_sms=16,24,32,48 --no-check $BASELINE_ARGS
      ;;
    ll)
      [ "${LL_TESTS:-1}" = 1 ] && stage tests timeout 300 \
        python3 -m pytest -q -rs --durations=10 tests/test_native_low_latency.py -k "not missing_peer and not disagree"
      stage bench timeout "${BENCH_TIMEOUT:-300}" python3 benchmarks/bench_low_latency.py ${BENCH_RANKS:+--ranks "$BENCH_RANKS"} \
        --out "$OUT/results_dir/low_latency.json" --plot "$OUT/results_dir/low_latency_tokens.png"
      ;;
    internode)
      stage tests timeout 300 python3 -m pytest -q -rs --durations=10 tests/test_native_internode.py
      # Emulation: 2 "nodes" x 1 GPU; the network leg runs through NVSHMEM over NVLink underneath.
      printf 'backend: native\ntransport: nvlink\ntopology: {ranks_per_node: 1}\n' > /tmp/emulated_2x1.yaml
      bench internode_emulated_bf16 --config /tmp/emulated_2x1.yaml --num-sms 24 --dtype bf16
      # The same through the network path (staged puts with signal), the code path real RDMA takes.
      printf 'backend: native\ntransport: nvlink\ntopology: {ranks_per_node: 1}\nnetwork: {force_puts: true}\n' \
        > /tmp/emulated_2x1_puts.yaml
      bench internode_emulated_bf16_puts --config /tmp/emulated_2x1_puts.yaml --num-sms 24 --dtype bf16 --no-baseline
      ;;
    megatron)
      if ls .whl/megatron_core-*.whl > /dev/null 2>&1; then
        python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl >> "$OUT/tests.log" 2>&1
        export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
        stage tests timeout 300 python3 -m pytest -q -rs tests/test_megatron_gpu.py
        for impl in ${MEGATRON_EXPERT_IMPLS:-grouped}; do  # the layer's experts: sequential, grouped, te
          stage bench timeout "${BENCH_TIMEOUT:-300}" python3 benchmarks/bench_megatron_layer.py --ranks "${MEGATRON_RANKS:-2}" \
            --expert-impl "$impl" --out "$OUT/results_dir/megatron_layer_$impl.json"
        done
      else
        echo "megatron: skipped (carry .whl with the megatron-core cp312 wheel; see docs/megatron.md)" >> "$summary"
      fi
      ;;
    host)
      for t in 128 4096; do
        stage host timeout 120 python3 benchmarks/profile_host.py --tokens "$t" --iters 300 --top 30
      done
      # Eager calls as a DeepEP program makes them, DeepEP V1 beside (after the deepep stage).
      stage host timeout 180 python3 benchmarks/profile_host.py --eager --iters 200 --top 30
      ;;
    sum)
      # The 2-rank combine's sum alone (its floor by SM count), then the reduction kernel alone.
      for probe in sm_rate staged_reduce; do
        stage sum nvcc -O3 -std=c++17 -arch=sm_90a -I csrc -I /usr/local/cuda/include/cccl -o "/tmp/$probe" \
          "benchmarks/probes/$probe.cu"
      done
      stage sum timeout 300 /tmp/sm_rate sum
      stage sum timeout 120 /tmp/staged_reduce
      grep -E "^(sum|staged_reduce)" "$OUT/sum.log" >> "$summary"
      ;;
    *)
      echo "$s: unknown stage" >> "$summary"
      ;;
  esac
done

echo "===== tail of logs ====="
for f in "$OUT"/*.log; do [ -f "$f" ] && { echo "--- $f"; tail -25 "$f"; }; done
echo "===== summary ====="
cat "$summary"
grep -h -A12 "^ep_plugin bench" "$OUT/bench.log" 2>/dev/null | grep -v "^--$" | head -80
# NOTE: the device tool brings back at most 8 files from $OUT: the logs and results travel as one archive.
(cd "$OUT" && { logs=$(ls ./*.log 2>/dev/null); tar -czf results.tgz results_dir $logs && rm -rf results_dir $logs; })
