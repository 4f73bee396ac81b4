#!/usr/bin/env bash
# Call 6 (twenty-sixth session, 2x H200; the machine still warm from call 5, its extension still built from call 5's
# branch): the bench with EP_PLUGIN_COMBINE_WEIGHTS_COPY=engine, i.e. main's combine path (the branch's switch gives
# the code before it), with the reference backend and the P2P ceiling in the same run. The command as run:
export EP_PLUGIN_COMBINE_WEIGHTS_COPY=engine; python3 -c "import ep_plugin._C" && OUT=$OUT/b BENCH_TIMEOUT=45 STAGES=bench bash benchmarks/gpu_session.sh > $OUT/stdout.txt 2>&1; cat $OUT/b/summary.txt; grep -h "^=== bench\|^dispatch\|^combine\|^P2P\|^reference" $OUT/b/bench.log | sed 's/.*results_dir.//; s/ (1 GiB into the next GPU, all ranks at once)//' | cut -c1-150; cd $OUT && tar -czf all.tgz b stdout.txt && rm -rf b stdout.txt
