#!/usr/bin/env bash
# One call on the GPU machine: build, GPU tests, benchmarks; the summary is printed last.
# Usage: STAGES="build tests bench sweeps" benchmarks/gpu_session.sh   (logs and results under $OUT)
# At most a handful of files land in $OUT: *.log, results.tgz (JSON + PNG), summary.txt.
#
# Stages (run in the order given):
#   build      pip install -e . (both extensions), GPU facts into build.log
#   share      start CUDA MPS so that RANKS_PER_GPU (default 2) ranks share each GPU: on a machine with
#              fewer GPUs than ranks, the multi-rank tests and benchmarks then run with ranks sharing
#              GPUs (a correctness run: "links" are the GPU's own memory, so timings are not NVLink's).
#              Later stages pass --ranks $BENCH_RANKS to the benchmarks where it is set.
#   unshare    stop that MPS daemon (a later `share`, in this call or another run of this script, starts its own:
#              `nvidia-cuda-mps-control -d` fails while one runs, and a quit needs the same pipe directory)
#   tests      pytest $PYTEST_ARGS (default: the native normal-mode tests), -k "$PYTEST_K" if set,
#              leaving HANG_RESERVE_S of the deadline to a later `timeouts` stage
#   staged     the intranode cases again with EP_PLUGIN_STREAM_WRITES=kernel (the copy-engine combine's
#              stream writes by a one-thread kernel instead of cuStreamWriteValue64)
#   timeouts   the tests where a peer never answers or an id is out of range (they end in a
#              device trap by design), each file alone under `timeout -k`
#   bench      ep-plugin bench, normal mode: BF16/FP8 x 24/16 SMs, reference + P2P in the same run, then
#              BF16 at 24 SMs with the combine on the SMs only (buffer.combine_staging_tokens: 0)
#   sweeps     SM sweep 8..48 and token sweep 128..16384 with plots
#   probe      benchmarks/link_probe.cu: the link by copy engine (push, pull) and by SM stores and loads
#              (PROBE_ARGS="58.7 rows": only the dispatch-shaped rows and what local traffic costs them;
#              "58.7 roles": local row copies by SM count and the dispatch's jobs split over separate SMs)
#   waitprobe  benchmarks/stream_wait_probe.cu: how soon a copy starts after the word it waits for is
#              written (one-thread wait kernel, cuStreamWaitValue64, cuStreamBatchMemOp, an event);
#              GPU 0 -> GPU 1 where there are two GPUs, else on one GPU
#   variants   one bench run (BF16, 24 SMs, no baseline) per line of VARIANTS: "name|ENV=value ...|bench args"
#              (the diagnostic environment variables of docs/configuration.md, or --config FILE)
#   tuning     ring/chunk settings: TUNING_PAIRS="send:recv ..." (default "8:256 16:512"), 24 SMs
#   ll         native low-latency GPU tests (LL_TESTS=0 skips them; the missing-peer ones are in
#              `timeouts`), then benchmarks/bench_low_latency.py, then again at 1/128/256 tokens with fp32
#              expert-sums partials (LL_FP32_PARTIALS=0 skips it)
#   internode  native internode tests on the emulated topology (2 nodes x 1 GPU; INTERNODE_TESTS=0
#              skips them), then an emulated bench, direct (NVLink stores) and EP_PLUGIN_NETWORK_PUTS=1
#   megatron   Megatron GPU tests (MEGATRON_TESTS=0 skips them) and the layer benchmark at MEGATRON_RANKS (default 2)
#              GPUs, once per expert implementation in MEGATRON_EXPERT_IMPLS (default "sequential"; also "grouped"),
#              then ep_plugin alone with the combine on the SMs (MEGATRON_SM_COMBINE=0 skips it)
#              (carry .whl with the megatron-core cp312 wheel;
#              MEGATRON_PROFILE=1 adds torch.profiler tables of the dispatcher round and the layer step per dispatcher)
# Megatron needs `carry: [".whl"]` in the device call, after (here, once; .gitignore ignores /.whl/):
#   python3 -m pip download --no-deps --only-binary=:all: \
#     --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 -d .whl megatron-core==0.19.2
#   profile    Nsight Compute (1 rank) and Nsight Systems (2 ranks) on normal-mode dispatch/combine
#   timeline   torch.profiler timelines of normal-mode rounds (4096 and 128 tokens): host time of each
#              step against its kernels' GPU time, top kernels, Chrome traces (benchmarks/profile_timeline.py)
#   ctimeline  benchmarks/combine_timeline.py: every GPU operation of the copy-engine combine on every rank, the GPU
#              alone (a sleep before each combine), at CTL_SMS (default 24) SMs; CTL_STAGING sets its
#              combine_staging_tokens (the copy engines at more than 2 ranks)
#   host       the host's time per call of layout / dispatch / cached dispatch / combine without a profiler, then a
#              cProfile of the same rounds, at HOST_TOKENS (default "128 4096") tokens (benchmarks/profile_host.py)
# CLOCK_LOG=1 logs every GPU's SM clock, power, temperature and throttle reasons every 200 ms into clocks.log for
# the whole call (the stage headers carry their start times, to line the two up).
# On 4 or 8 GPUs (EP4/EP8): EP_TEST_RANKS=4 (or 8) runs the intranode and low-latency tests at that many
# ranks; `ep-plugin bench` and benchmarks/bench_low_latency.py use every GPU of the machine.
# A device session has about 30 minutes and each call at most 10: split the stages over calls,
# e.g. "build tests bench" then "ll internode" then "megatron profile sweeps"; set DEADLINE_S a
# little under the call's limit so the tests stop in time and the summary still prints.
set -u
OUT=${OUT:-/tmp/ep_plugin_out}
rm -rf "$OUT/results_dir"  # only this call's results come back
mkdir -p "$OUT" "$OUT/results_dir"
# ep_plugin never uses NVLink multicast; keep it off in every process.
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
STAGES=${STAGES:-"build tests bench"}
TEST_TIMEOUT=${TEST_TIMEOUT:-900}
# Stages that would start after BUDGET_S seconds are skipped (the device call has a hard limit).
BUDGET_S=${BUDGET_S:-100000}
PYTEST_ARGS=${PYTEST_ARGS:-"tests/test_native_layout.py tests/test_native_intranode.py"}
summary="$OUT/summary.txt"
# The combine on the SMs only (no copy-engine staging area), for comparisons in the bench and megatron stages.
printf 'buffer: {combine_staging_tokens: 0}\n' > /tmp/sm_combine.yaml
: > "$summary"

stage() {  # stage NAME COMMAND...: run, log, record rc and duration
  local name=$1; shift
  local start=$SECONDS
  if [ "$SECONDS" -ge "$BUDGET_S" ]; then
    echo "$name: skipped (time budget of $BUDGET_S s spent): $*" >> "$summary"
    return 0
  fi
  echo "=== $name ($(date +%T.%N | cut -c1-12)): $*" >> "$OUT/$name.log"
  "$@" >> "$OUT/$name.log" 2>&1
  local rc=$?
  echo "$name: rc=$rc, $((SECONDS - start)) s" >> "$summary"
  return $rc
}

bench() {  # bench NAME ARGS...: one `ep-plugin bench` run with its JSON kept
  local name=$1; shift
  stage bench timeout "${BENCH_TIMEOUT:-300}" python3 -m ep_plugin bench --out "$OUT/results_dir/$name.json" \
    ${BENCH_RANKS:+--ranks "$BENCH_RANKS"} "$@"
}

if [ "${CLOCK_LOG:-0}" = 1 ]; then
  nvidia-smi --format=csv -lms 200 \
    --query-gpu=timestamp,index,clocks.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active \
    > "$OUT/clocks.log" 2>&1 &
  trap "kill $! 2>/dev/null" EXIT  # also when a stage ends the script early (a failed build)
fi

for s in $STAGES; do
  case $s in
    build)
      { nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; nvidia-smi topo -m; } > "$OUT/build.log" 2>&1
      stage build python3 -m pip install --no-build-isolation --no-deps -e . || { cat "$summary"; tail -40 "$OUT/build.log"; exit 1; }
      ;;
    share)
      per_gpu=${RANKS_PER_GPU:-2}
      export CUDA_MPS_PIPE_DIRECTORY=/tmp/ep_mps_pipe CUDA_MPS_LOG_DIRECTORY=/tmp/ep_mps_log
      mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
      # NOTE: NVSHMEM shares a GPU between PEs under MPS when their active-thread shares add up to at most 100%.
      if stage share nvidia-cuda-mps-control -d && stage share python3 -c "import torch; torch.ones(1, device='cuda').sum().item()" \
          && echo get_server_list | nvidia-cuda-mps-control | grep -q '[0-9]'; then
        export EP_PLUGIN_RANKS_PER_GPU=$per_gpu CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=$((100 / per_gpu))
        echo "share: CUDA MPS runs; $per_gpu ranks per GPU, $CUDA_MPS_ACTIVE_THREAD_PERCENTAGE% of each GPU per rank" >> "$summary"
      else
        echo "share: CUDA MPS did not start (see share.log and $CUDA_MPS_LOG_DIRECTORY); ranks keep their own GPUs" >> "$summary"
        cat "$CUDA_MPS_LOG_DIRECTORY"/*.log >> "$OUT/share.log" 2>/dev/null
      fi
      ;;
    unshare)
      CUDA_MPS_PIPE_DIRECTORY=/tmp/ep_mps_pipe nvidia-cuda-mps-control <<< quit >> "$OUT/share.log" 2>&1
      sleep 2
      unset EP_PLUGIN_RANKS_PER_GPU CUDA_MPS_ACTIVE_THREAD_PERCENTAGE CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
      echo "unshare: MPS stopped; ranks keep their own GPUs" >> "$summary"
      ;;
    tests)
      # With DEADLINE_S set, the tests get what is left of it (less a margin for the summary).
      left=$(( ${DEADLINE_S:-100000} - SECONDS - 20 - ${HANG_RESERVE_S:-0} ))
      [ "$left" -lt "$TEST_TIMEOUT" ] && TEST_TIMEOUT=$left
      stage tests timeout -k 10 "$TEST_TIMEOUT" python3 -m pytest -q -rs --durations=25 $PYTEST_ARGS \
        ${PYTEST_K:+-k "$PYTEST_K"}
      ;;
    staged)  # the copy-engine combine's cases again, its stream writes made by a one-thread kernel
      stage staged env EP_PLUGIN_STREAM_WRITES=kernel timeout -k 10 "${STAGED_TIMEOUT:-200}" python3 -m pytest -q \
        tests/test_native_intranode.py -k "multi_rank and not one_rank"
      ;;
    timeouts)
      # -s shows the device's report and, with EP_PLUGIN_STACK_DUMP_S, each rank's Python stacks.
      for f in ${TIMEOUTS_FILES:-tests/test_native_intranode.py tests/test_native_low_latency.py tests/test_native_internode.py}; do
        limit=${TIMEOUTS_TEST_TIMEOUT:-100}
        left=$(( ${DEADLINE_S:-100000} - SECONDS - 15 ))
        [ "$left" -lt "$limit" ] && limit=$left
        [ "$limit" -lt 30 ] && { echo "timeouts: skipped $f (deadline)" >> "$summary"; continue; }
        stage timeouts timeout -k 5 "$limit" python3 -m pytest -q -rs -s -o faulthandler_timeout=$((limit - 10)) \
          "$f" -k "missing_peer or out_of_range or disagree"
      done
      ;;
    bench)
      bench bf16_sms24 --num-sms 24 --dtype bf16
      bench fp8_sms24 --num-sms 24 --dtype fp8
      bench bf16_sms16 --num-sms 16 --dtype bf16
      bench fp8_sms16 --num-sms 16 --dtype fp8
      # The combine on the SMs alone (no copy-engine staging area), for comparison in the same call.
      bench bf16_sms24_sm_combine --num-sms 24 --dtype bf16 --config /tmp/sm_combine.yaml --no-baseline
      ;;
    tuning)  # ring and chunk sizes (dispatch and combine alike), 24 SMs
      for pair in ${TUNING_PAIRS:-8:256 16:512}; do
        set -- ${pair/:/ }
        printf 'dispatch: {nvl_chunked_send_tokens: %s, nvl_chunked_recv_tokens: %s}\ncombine: {nvl_chunked_send_tokens: %s, nvl_chunked_recv_tokens: %s}\n' \
          "$1" "$2" "$1" "$2" > "/tmp/tuning_$1_$2.yaml"
        bench "tuning_send$1_recv$2" --config "/tmp/tuning_$1_$2.yaml" --num-sms 24 --no-baseline
      done
      ;;
    ll)
      [ "${LL_TESTS:-1}" = 1 ] && stage tests timeout "${LL_TEST_TIMEOUT:-300}" \
        python3 -m pytest -q -rs --durations=10 tests/test_native_low_latency.py -k "not missing_peer and not disagree"
      stage bench timeout "${BENCH_TIMEOUT:-300}" python3 benchmarks/bench_low_latency.py ${BENCH_RANKS:+--ranks "$BENCH_RANKS"} \
        --out "$OUT/results_dir/low_latency.json" --plot "$OUT/results_dir/low_latency_tokens.png"
      # Expert-side sums with fp32 partials beside the default bf16 ones (LL_FP32_PARTIALS=0 skips it).
      [ "${LL_FP32_PARTIALS:-1}" = 1 ] && stage bench timeout "${BENCH_TIMEOUT:-300}" python3 benchmarks/bench_low_latency.py \
        ${BENCH_RANKS:+--ranks "$BENCH_RANKS"} --expert-sums-partials fp32 --sweep 1,128,256 --reference-iters 0 \
        --out "$OUT/results_dir/low_latency_fp32_partials.json"
      ;;
    internode)
      [ "${INTERNODE_TESTS:-1}" = 1 ] && stage tests timeout "${INTERNODE_TEST_TIMEOUT:-300}" \
        python3 -m pytest -q -rs --durations=10 tests/test_native_internode.py
      # Emulation: 2 "nodes" x 1 GPU; the network leg runs through NVSHMEM over NVLink underneath.
      printf 'backend: native\ntransport: nvlink\ntopology: {ranks_per_node: 1}\n' > /tmp/emulated_2x1.yaml
      bench internode_emulated_bf16 --config /tmp/emulated_2x1.yaml --num-sms 24 --dtype bf16
      # The same through the network path (staged puts with signal), what real RDMA runs.
      EP_PLUGIN_NETWORK_PUTS=1 bench internode_emulated_bf16_puts --config /tmp/emulated_2x1.yaml --num-sms 24 \
        --dtype bf16 --no-baseline
      ;;
    megatron)
      if ls .whl/megatron_core-*.whl > /dev/null 2>&1; then
        python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl >> "$OUT/tests.log" 2>&1
        export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
        [ "${MEGATRON_TESTS:-1}" = 1 ] && \
          stage tests timeout "${MEGATRON_TEST_TIMEOUT:-300}" python3 -m pytest -q -rs tests/test_megatron_gpu.py
        for impl in ${MEGATRON_EXPERT_IMPLS:-sequential}; do  # the layer's experts: sequential, grouped, te
          stage bench timeout "${BENCH_TIMEOUT:-300}" python3 benchmarks/bench_megatron_layer.py --ranks "${MEGATRON_RANKS:-2}" \
            --expert-impl "$impl" --out "$OUT/results_dir/megatron_layer_$impl.json" \
            ${MEGATRON_PROFILE:+--profile-dir "$OUT/results_dir/megatron_profile_$impl"}
        done
        # ep_plugin with the combine on the SMs only, for comparison in the same call (MEGATRON_SM_COMBINE=0 skips it).
        [ "${MEGATRON_SM_COMBINE:-1}" = 1 ] && \
          stage bench timeout "${BENCH_TIMEOUT:-300}" python3 benchmarks/bench_megatron_layer.py --ranks "${MEGATRON_RANKS:-2}" \
            --dispatchers ep_plugin --ep-plugin-config /tmp/sm_combine.yaml --out "$OUT/results_dir/megatron_layer_sm_combine.json"
      else
        echo "megatron: skipped (carry .whl with the megatron-core cp312 wheel; see docs/megatron.md)" >> "$summary"
      fi
      ;;
    profile)
      # NOTE: ncu replays a kernel several times, which a kernel waiting for a peer cannot survive:
      # profile one rank under ncu (the kernels' own cost: row copies, reductions, ring protocol),
      # and the two-rank timeline (host gaps, notify, skew) under nsys where it is installed.
      stage profile timeout "${PROFILE_TIMEOUT:-240}" ncu --kernel-name regex:"dispatch_kernel|combine_kernel|notify_kernel" \
        --launch-skip 12 --launch-count 3 --set full -o "$OUT/results_dir/intranode_1rank" \
        python3 -m ep_plugin bench --ranks 1 --num-sms 24 --no-baseline --no-check --warmup 3 --iters 3
      if command -v nsys > /dev/null; then
        stage profile timeout "${PROFILE_TIMEOUT:-240}" nsys profile -t cuda,nvtx --stats=true -o "$OUT/results_dir/intranode_2ranks" \
          python3 -m ep_plugin bench --num-sms 24 --no-baseline --no-check --warmup 3 --iters 10
      fi
      ;;
    timeline)
      stage profile timeout "${PROFILE_TIMEOUT:-240}" python3 benchmarks/profile_timeline.py ${BENCH_RANKS:+--ranks "$BENCH_RANKS"} \
        --out-dir "$OUT/results_dir/timeline_4096"
      stage profile timeout "${PROFILE_TIMEOUT:-240}" python3 benchmarks/profile_timeline.py ${BENCH_RANKS:+--ranks "$BENCH_RANKS"} --tokens 128 \
        --out-dir "$OUT/results_dir/timeline_128"
      ;;
    probe)  # what the link carries by who moves the bytes (benchmarks/link_probe.cu)
      stage probe nvcc -O3 -std=c++17 -arch=sm_90a -o /tmp/link_probe benchmarks/link_probe.cu && \
        stage probe /tmp/link_probe ${PROBE_ARGS:-}
      ;;
    waitprobe)  # how soon a copy follows the word it waits for (benchmarks/stream_wait_probe.cu)
      stage probe nvcc -O3 -std=c++17 -arch=sm_90a -o /tmp/stream_wait_probe benchmarks/stream_wait_probe.cu && \
        stage probe timeout -k 5 "${WAIT_PROBE_TIMEOUT:-90}" /tmp/stream_wait_probe --peer ${WAIT_PROBE_ARGS:-}
      ;;
    variants)  # BF16, 24 SMs: each VARIANTS entry "name|ENV=value ...|bench args" as its own bench run
      while IFS='|' read -r name envs args; do
        [ -z "$name" ] && continue
        ( [ -n "$envs" ] && export $envs; echo "variant $name: ${envs:-no overrides} $args" >> "$summary"
          bench "variant_$name" --num-sms 24 --dtype bf16 --no-baseline --warmup 3 --iters 20 $args )
      done <<< "${VARIANTS:-}"
      ;;
    ctimeline)
      stage ctimeline timeout 120 python3 benchmarks/combine_timeline.py --num-sms "${CTL_SMS:-24}" \
        ${CTL_STAGING:+--staging-tokens "$CTL_STAGING"} --out-dir "$OUT/results_dir/combine_timeline_${CTL_SMS:-24}"
      ;;
    host)  # the host's time per call and where it goes (benchmarks/profile_host.py)
      for t in ${HOST_TOKENS:-128 4096}; do
        stage host timeout 120 python3 benchmarks/profile_host.py --tokens "$t" --iters 300 --top 30
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
