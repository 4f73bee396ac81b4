"""Notify's steps timed on the GPU, in a loop of dispatches with notify (2 ranks, one per GPU).

Thread 0 of the notify kernel stamps %globaltimer after each of its steps in a build with
notify_steps.patch; the host reads the last 64 notifies' stamps after each block of 64 dispatches.
The loop is eager_rounds.py's `--dispatch-only` rounds: explicit Config, torch's default device and dtype set.

  cp -r . /tmp/steps && cd /tmp/steps && git apply benchmarks/probes/notify_steps.patch \\
      && EP_PLUGIN_SKIP_NVSHMEM=1 python3 setup.py build_ext --inplace && cd -
  PYTHONPATH=/tmp/steps python3 benchmarks/probes/notify_steps.py [--tokens 128] [--blocks 3]

Prints per block and rank: the host's time per dispatch, notify's steps (median over the block), the
time between two notify kernels (the dispatch kernel and the GPU's wait for the host), and the host's
time from notify's launch to seeing the received count.
"""
import argparse
import statistics
import time

STEPS = ("ids and counts", "blocks into the headers", "barrier", "count matrix", "fence and tag", "send_pos scan")
NOTIFIES = 64  # the patch keeps the last 64 notifies' stamps
WORDS = len(STEPS) + 2  # a stamp at the start and after each step, then the epoch


def stamp_rows(words: list[int]) -> list[list[int]]:
    """The notifies' stamp rows in epoch order, the never written (epoch 0) left out."""
    rows = [words[i * WORDS:(i + 1) * WORDS] for i in range(len(words) // WORDS)]
    return sorted((row for row in rows if row[-1] > 0), key=lambda row: row[-1])


def step_medians_us(rows: list[list[int]]) -> dict[str, float]:
    """Median duration of each step, and of the gap from one notify's end to the next one's start."""
    result = {name: statistics.median((row[k + 1] - row[k]) / 1e3 for row in rows) for k, name in enumerate(STEPS)}
    gaps = [(later[0] - earlier[len(STEPS)]) / 1e3 for earlier, later in zip(rows, rows[1:])
            if later[-1] == earlier[-1] + 1]
    result["between notify kernels"] = statistics.median(gaps) if gaps else float("nan")
    return result


class LaunchClock:
    """Wraps the intranode runtime: host time of each notify's launch and of the host seeing its count."""

    def __init__(self, runtime):
        self._runtime, self.launched, self.seen = runtime, [], []

    def __getattr__(self, name):
        return getattr(self._runtime, name)

    def notify(self, args, stream):
        self.launched.append(time.perf_counter())
        self._runtime.notify(args, stream)

    def wait_notify(self, tag, stream):
        count = self._runtime.wait_notify(tag, stream)
        self.seen.append(time.perf_counter())
        return count


def rank_main(rank, num_ranks, group, args):
    import torch
    import torch.distributed as dist

    import ep_plugin
    from eager_rounds import Step, step_inputs  # this directory is the script's: first on sys.path
    from ep_plugin.launch import rank_device

    step = Step(ep_plugin, group, *step_inputs(rank, args.tokens), explicit=True)
    runtime = step.buffer._backend._runtime
    if not hasattr(runtime, "notify_steps"):
        step.buffer.destroy()
        raise SystemExit("this build has no notify step stamps: build a copy with notify_steps.patch (see the docstring)")
    blocks = []
    torch.set_default_device(rank_device(rank))
    torch.set_default_dtype(torch.bfloat16)
    try:
        step.dispatch_rounds(50)
        clock = step.buffer._backend._runtime = LaunchClock(runtime)
        for _ in range(args.blocks):
            torch.cuda.synchronize()
            dist.barrier(group=group)
            clock.launched.clear()
            clock.seen.clear()
            stamps = step.dispatch_rounds(NOTIFIES)
            per_dispatch_us = (stamps[-1][1] - stamps[0][0]) / NOTIFIES * 1e6
            torch.cuda.synchronize()
            seen_us = statistics.median((s - l) * 1e6 for l, s in zip(clock.launched, clock.seen))
            blocks.append((per_dispatch_us, seen_us, step_medians_us(stamp_rows(runtime.notify_steps()))))
    finally:
        step.buffer._backend._runtime = runtime
        torch.set_default_device(None)
        torch.set_default_dtype(torch.float32)
    step.buffer.destroy()
    return blocks


def main():
    from ep_plugin.launch import parallel_launch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--blocks", type=int, default=3)
    args = parser.parse_args()
    results = parallel_launch(2, rank_main, args, timeout_s=300)
    print(f"notify's steps, 2 ranks, {args.tokens} tokens x 7168, top-8 of 256 experts, blocks of {NOTIFIES} dispatches")
    for b in range(args.blocks):
        for rank, blocks in enumerate(results):
            per_dispatch_us, seen_us, steps = blocks[b]
            print(f"block {b} rank {rank}: {per_dispatch_us:.1f} us per dispatch, count seen {seen_us:.1f} us after "
                  f"notify's launch | " + ", ".join(f"{name} {us:.1f}" for name, us in steps.items()))


if __name__ == "__main__":
    main()
