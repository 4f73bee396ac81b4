#!/usr/bin/env bash
# Call 4 (twenty-fifth session, 2x H200 over NVLink, main at 013aa12):
# (1) build, then benchmarks/stream_wait_probe.cu across the link (GPU 0 -> GPU 1): how soon a copy follows the word
#     it waits for;
# (2) torch.profiler timelines of normal-mode rounds at 4096 and 128 tokens (host time against kernel time; the
#     Chrome traces show when the copy-engine combine's copies start).
set -u
export MAX_JOBS=16
ALL=$OUT
OUT=$ALL/c PROFILE_TIMEOUT=150 STAGES="build waitprobe timeline" bash benchmarks/gpu_session.sh > $ALL/stdout.txt 2>&1
echo "##### summary"; cat $ALL/c/summary.txt
tail -25 $ALL/c/probe.log | cut -c1-200
grep -v "^ep_plugin env\|UserWarning\|_warn_once" $ALL/c/profile.log | cut -c1-200 | head -90
cd $ALL && tar -czf all.tgz c stdout*.txt 2>/dev/null; rm -rf c stdout*.txt
