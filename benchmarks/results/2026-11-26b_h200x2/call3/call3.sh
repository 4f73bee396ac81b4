#!/usr/bin/env bash
# Call 3 (twenty-sixth session, 2x H200): the host path made cheaper (streams and events by device index, reused
# events, default configs kept, the layout's id check not repeated by its dispatch, CUDA availability asked once).
# Build; host time per call with the old Python files (849919e, same extension) and the new ones, alternating;
# the bench's FP8/BF16 runs; then the GPU tests of the changed path.
set -u
export MAX_JOBS=16 NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
ALL=$OUT
OUT=$ALL/c STAGES="build" bash benchmarks/gpu_session.sh > $ALL/stdout.txt 2>&1
mkdir -p /tmp/old && cp -r ep_plugin /tmp/old/
for f in ep_plugin/buffer.py ep_plugin/validation.py ep_plugin/backends/native.py; do git show 849919e:$f > /tmp/old/$f; done
for round in a b; do
  for side in old new; do
    for t in 128 4096; do
      path=$PWD; [ $side = old ] && path=/tmp/old
      PYTHONPATH=$path timeout 120 python3 benchmarks/profile_host.py --tokens $t --iters 300 --top 30 > $ALL/host_${side}_${t}_$round.log 2>&1
      echo "profile_host $side $t $round: rc=$? $(PYTHONPATH=$path python3 -c 'import ep_plugin; print(ep_plugin.__file__)')" >> $ALL/c/summary.txt
    done
  done
done
V="fp8||--dtype fp8 --iters 30
bf16||--iters 30"
OUT=$ALL/v BENCH_TIMEOUT=60 VARIANTS="$V" STAGES="variants" bash benchmarks/gpu_session.sh >> $ALL/stdout.txt 2>&1
OUT=$ALL/t DEADLINE_S=$((560 - SECONDS)) PYTEST_ARGS="tests/test_native_intranode.py tests/test_reference_normal.py" \
  PYTEST_K="(test_cases_multi_rank and not chunks and not copy_engine and not register) or cuda_graph or async_events or 1000_back or cases_one_rank or test_normal" \
  STAGES="tests" bash benchmarks/gpu_session.sh >> $ALL/stdout.txt 2>&1
echo "##### summary"; cat $ALL/c/summary.txt $ALL/v/summary.txt $ALL/t/summary.txt
grep -h "passed\|failed\|FAILED\|Error" $ALL/t/tests.log | cut -c1-300 | tail -8
grep -h "^=== bench\|^dispatch\|^combine" $ALL/v/bench.log | sed 's/.*results_dir.//' | cut -c1-150
for t in 128 4096; do for r in a b; do for side in old new; do echo "## $side $t $r: $(grep -A1 '^host us' $ALL/host_${side}_${t}_$r.log | tail -1)"; grep "^rank 1" $ALL/host_${side}_${t}_$r.log; done; done; done
grep -A28 "by own time" $ALL/host_new_128_b.log | cut -c1-140 | tail -22
cd $ALL && tar -czf all.tgz c v t stdout.txt 2>/dev/null; cp t/tests.log tests.log; rm -rf c v t stdout.txt
