"""
Data supply vs demand, and memory (BENCHMARKS.md sections 4, 5 and 10): short pretrain_ddp.py runs, their
data-wait fraction, and the peak RSS (VmHWM) of every rank and DataLoader worker.

    python bench/data_wait_mem.py --steps 12 --base-steps 3    # tiny: 1 process; 2 ranks x 0, 1, 2 workers; base
    python bench/data_wait_mem.py --only tiny-1x1,tiny-2x1 --steps 30
    python bench/data_wait_mem.py --only tiny-1x1 --steps 10   # a smoke run

Each run is launched (plain python, or torchrun for 2 ranks), and its process tree is polled every
--poll seconds: /proc/<pid>/status VmHWM is each process's peak resident set, so the last value
read before it exits is its peak. Ranks are the pretrain_ddp.py processes (not torchrun's agent); DataLoader
workers the children of a rank's forkserver (the server itself, and the resource tracker, are left out).
tokens/s: summary.json's steady rate (all ranks). train/data_wait is the fraction of a log interval the loop
spent waiting for batches (summary.json holds only the whole run's share); reported: the median over the log's
intervals after the first (the first holds the worker start).
"""

import argparse
import os
import re
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import common  # noqa: E402

# name: (model size, ranks, workers per rank, batch size)
RUNS = {"tiny-1x1": ("tiny", 1, 1, 32), "tiny-2x0": ("tiny", 2, 0, 32), "tiny-2x1": ("tiny", 2, 1, 32),
        "tiny-2x2": ("tiny", 2, 2, 32), "base-1x1": ("base", 1, 1, 8), "base-2x1": ("base", 2, 1, 8)}


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].strip(),
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--only", default=",".join(RUNS), help=f"comma list of {', '.join(RUNS)}")
    p.add_argument("--steps", type=int, default=15, help="optimizer steps of tiny runs (base: --base-steps)")
    p.add_argument("--base-steps", type=int, default=4)
    p.add_argument("--log-every", type=int, default=5, help="tiny runs' log interval (base: 1)")
    p.add_argument("--poll", type=float, default=0.2, help="seconds between /proc reads")
    p.add_argument("--out-dir", default="/tmp/bert_ddp_bench/data_wait_mem")
    return p.parse_args()


def proc_table():
    """{pid: (ppid, cmdline, VmHWM kB)} of every process we can read."""
    table = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
            with open(f"/proc/{pid}/status") as f:
                hwm = int(re.search(r"VmHWM:\s+(\d+)", f.read())[1])
        except (OSError, TypeError, IndexError, ValueError):
            continue
        table[int(pid)] = (ppid, cmd, hwm)
    return table


def run(args, name):
    size, ranks, workers, batch = RUNS[name]
    steps, log_every = (args.base_steps, 1) if size == "base" else (args.steps, args.log_every)
    flags = ["--model-size", size, "--batch-size", str(batch), "--num-workers", str(workers), "--max-steps",
             str(steps), "--log-every", str(log_every)]
    peak = {}  # pid -> (role, VmHWM kB)

    def watch(proc):
        table = proc_table()
        tree = {proc.pid}
        for _ in range(4):  # launcher -> ranks -> workers (a few levels)
            tree |= {pid for pid, (ppid, _, _) in table.items() if ppid in tree}
        for pid in tree & table.keys():
            ppid, cmd, hwm = table[pid]
            parent = table.get(ppid, (0, "", 0))[1]
            if "multiprocessing.forkserver" in parent:  # DataLoader workers come from a forkserver per rank
                peak[pid] = ("worker", max(hwm, peak.get(pid, ("", 0))[1]))
            elif "pretrain_ddp.py" in cmd and "torch.distributed.run" not in cmd:
                peak[pid] = ("rank", max(hwm, peak.get(pid, ("", 0))[1]))

    done = common.pretrain(flags, os.path.join(args.out_dir, name), ranks=ranks, watch=watch, every=args.poll,
                           env=os.environ)
    waits = [row["train/data_wait"] for row in common.log_steps(done.log) if "train/data_wait" in row]
    mb = {role: [h / 1024 for r, h in peak.values() if r == role] for role in ("rank", "worker")}
    return {"name": name, "size": size, "ranks": ranks, "workers": workers, "batch": batch,
            "tokens_per_sec": done.summary["tokens_per_sec"], "data_wait": statistics.median(waits[1:] or waits),
            "first_wait": waits[0], "rank_mb": mb["rank"], "worker_mb": mb["worker"]}


def main():
    args = parse_args()
    os.makedirs(args.out_dir, exist_ok=True)
    print("| run | model | ranks x workers | batch/rank | tokens/s (all ranks) | data_wait median (first interval) "
          "| peak RSS per rank MB | peak RSS per worker MB |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for name in args.only.split(","):
        r = run(args, name)
        ranks = ", ".join(f"{m:,.0f}" for m in sorted(r["rank_mb"])) or "-"
        workers = ", ".join(f"{m:,.0f}" for m in sorted(r["worker_mb"])) or "-"
        print(f"| {name} | {r['size']} | {r['ranks']} x {r['workers']} | {r['batch']} | {r['tokens_per_sec']:,.0f} | "
              f"{r['data_wait']:.1%} ({r['first_wait']:.1%}) | {ranks} | {workers} |", flush=True)


if __name__ == "__main__":
    main()
