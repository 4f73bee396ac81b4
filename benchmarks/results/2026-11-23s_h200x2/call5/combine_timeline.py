"""Per combine in a rank's Chrome trace: when the staged reduction, the sender's wait kernel, the
copies and the refill memset ran, in us from the reduction's start (GPU timestamps)."""
import glob, json, sys

for path in sorted(glob.glob(sys.argv[1] + "/**/*.json", recursive=True)):
    try:
        trace = json.load(open(path))
    except Exception:
        continue
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and e.get("cat") in
              ("kernel", "gpu_memcpy", "gpu_memset")]
    if not events:
        continue
    events.sort(key=lambda e: e["ts"])
    reduces = [e for e in events if "staged_reduce" in e["name"]]
    print(f"== {path}: {len(reduces)} staged reductions")
    for red in reduces[-4:]:
        t0 = red["ts"]
        window = [e for e in events if t0 - 60 <= e["ts"] <= t0 + red["dur"] + 80]
        for e in window:
            name = e["name"]
            short = ("reduce" if "staged_reduce" in name else "stage_wait" if "staging_wait" in name else
                     "write_word" if "write_word" in name else name[:40])
            size = e.get("args", {}).get("bytes", "")
            print(f"  {short:40s} stream {e.get('tid')!s:>6} start {e['ts'] - t0:8.1f} end {e['ts'] + e['dur'] - t0:8.1f}"
                  f" dur {e['dur']:7.1f} {size}")
        print()
