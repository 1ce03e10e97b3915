"""
The cost of pretrain_ddp.py's one control all_reduce per optimizer step, as a % of the step time (BENCHMARKS.md
section 2).

    python bench/rank_sync.py --steps 6 --repeats 2            # 2 ranks (gloo, CPU), accum 1, 2, 4: the recorded run
    python bench/rank_sync.py --accums 1 --model-size mini --repeats 3
    python bench/rank_sync.py --accums 1 --steps 5 --calls 200 --repeats 1     # a smoke run

Two measurements, alternated --repeats times, each in fresh `torchrun --nproc_per_node N` processes:
- sync: what `all_reduce_ctrl` does, timed --calls times in a loop: a 6-element float64 CPU
  tensor built from a list, all_reduce (SUM, gloo), .tolist(). Per-call time = median of blocks.
- step: a real `pretrain_ddp.py` run of pretrain_ddp.STEADY_AFTER + --steps steps; the optimizer-step time is
  summary.json's steady rate (the steps after the first STEADY_AFTER: worker start, first steps).
The sync measured alone is the protocol's own cost; inside a run the same call also absorbs the
ranks' skew (the faster rank waits), which is load imbalance, not the cost of the call.
"""

import argparse
import os
import re
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import common  # noqa: E402

from pretrain_ddp import STEADY_AFTER  # noqa: E402  the steps its steady rates leave out


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].strip(),
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--nproc", type=int, default=2, help="ranks (torchrun --nproc_per_node)")
    p.add_argument("--accums", default="1,2,4", help="comma list of --accum-steps")
    p.add_argument("--model-size", default="tiny")
    p.add_argument("--objective", default="nsp", help="pretrain_ddp.py's default: nsp")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--steps", type=int, default=8, help=f"timed optimizer steps per run (after {STEADY_AFTER})")
    p.add_argument("--calls", type=int, default=2000, help="control all_reduces timed per sync measurement")
    p.add_argument("--repeats", type=int, default=2, help="alternating sync/step pairs")
    p.add_argument("--out-dir", default="/tmp/bert_ddp_bench/rank_sync")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # internal: run under torchrun
    return p.parse_args()


def sync_worker(args):
    """Under torchrun: time all_reduce_ctrl's work; rank 0 prints microseconds per call."""
    import torch
    import torch.distributed as dist
    dist.init_process_group("gloo")
    values = [1.0, 2.0, 3.0, 4.0, 5.0, 0.0]
    for _ in range(100):  # warm the connection
        dist.all_reduce(torch.tensor(values, dtype=torch.float64))
    dist.barrier()
    block, per_call = 100, []
    for _ in range(max(1, args.calls // block)):
        t0 = time.perf_counter()
        for _ in range(block):
            t = torch.tensor(values, dtype=torch.float64)
            dist.all_reduce(t)
            t.tolist()
        per_call.append((time.perf_counter() - t0) / block)
    if dist.get_rank() == 0:
        print(f"SYNC_US {statistics.median(per_call) * 1e6:.2f} {min(per_call) * 1e6:.2f} {max(per_call) * 1e6:.2f}")
    dist.destroy_process_group()


def torchrun(args, script_args, port):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(args.nproc), "--master_port",
           str(port), *script_args]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=common.ROOT, env=common.environment(1))
    if out.returncode:
        sys.exit(f"{' '.join(cmd)} failed:\n{out.stderr[-3000:]}")
    return out.stdout


def measure_sync(args, port):
    out = torchrun(args, [os.path.abspath(__file__), "--worker", "--calls", str(args.calls)], port)
    median, lo, hi = map(float, re.search(r"SYNC_US ([\d.]+) ([\d.]+) ([\d.]+)", out).groups())
    return median


def measure_step(args, accum):
    """Seconds per optimizer step of a real run, after its first STEADY_AFTER steps."""
    flags = ["--model-size", args.model_size, "--objective", args.objective, "--batch-size", str(args.batch_size),
             "--accum-steps", str(accum), "--max-steps", str(STEADY_AFTER + args.steps)]
    done = common.pretrain(flags, os.path.join(args.out_dir, f"run-accum{accum}"), ranks=args.nproc, threads=1)
    assert done.summary["steady_from_step"] == STEADY_AFTER, done.summary["steady_from_step"]
    return 3600 / done.summary["steps_per_hour"]


def main():
    args = parse_args()
    if args.worker:
        return sync_worker(args)
    os.makedirs(args.out_dir, exist_ok=True)
    accums = [int(a) for a in args.accums.split(",")]
    sync_us, step_s, port = [], {a: [] for a in accums}, 29600
    for r in range(args.repeats):
        port += 1
        sync_us.append(measure_sync(args, port))
        print(f"repeat {r}: control all_reduce {sync_us[-1]:.1f} us/call", flush=True)
        for a in accums:
            step_s[a].append(measure_step(args, a))
            print(f"repeat {r}: accum {a}: {step_s[a][-1] * 1e3:.1f} ms/optimizer step", flush=True)
    s = statistics.median(sync_us)
    print(f"\n{args.nproc} ranks, gloo, BERT-{args.model_size} {args.objective}, batch {args.batch_size}/rank; "
          f"control all_reduce median {s:.1f} us [{min(sync_us):.1f}-{max(sync_us):.1f}] over {args.repeats} runs")
    print("| accum | step ms median [min-max] | sync % of step median [min-max] |")
    print("| --- | --- | --- |")
    for a in accums:
        pct = [100 * s * 1e-6 / t for t in step_s[a]]
        print(f"| {a} | {statistics.median(step_s[a]) * 1e3:.0f} [{min(step_s[a]) * 1e3:.0f}-"
              f"{max(step_s[a]) * 1e3:.0f}] | {statistics.median(pct):.3f} [{min(pct):.3f}-{max(pct):.3f}] |")


if __name__ == "__main__":
    main()
