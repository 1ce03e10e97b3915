"""
Data supply vs demand, and memory: short pretrain_ddp.py runs, their data-wait fraction, and the
peak RSS (VmHWM) of every rank and DataLoader worker.

    python bench/data_wait_mem.py                       # tiny: 1 process; 2 ranks x 0, 1, 2 workers; base
    python bench/data_wait_mem.py --only tiny-1x1 --steps 30

Each run is launched (plain python, or torchrun for 2 ranks), and its process tree is polled every
--poll seconds: /proc/<pid>/status VmHWM is each process's peak resident set, so the last value
read before it exits is its peak. Ranks are pretrain_ddp.py processes whose parent is not one
(torchrun's children, or the plain process); workers are pretrain_ddp.py children of a rank.
train/data_wait is the fraction of a log interval the loop spent waiting for batches; reported:
the median over the intervals after the first (the first holds the worker start).
"""

import argparse
import os
import re
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
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
    flags = ["pretrain_ddp.py", "--model-size", size, "--batch-size", str(batch), "--num-workers", str(workers),
             "--max-steps", str(steps), "--log-every", str(log_every), "--log-to", "stdout", "--eval-corpus", "none",
             "--save-every", "1000000", "--out-dir", os.path.join(args.out_dir, name), "--resume", "none",
             "--overwrite"]
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks)] \
        if ranks > 1 else [sys.executable]
    log = open(os.path.join(args.out_dir, f"{name}.log"), "w+")
    proc = subprocess.Popen([*launch, *flags], stdout=log, stderr=subprocess.STDOUT, cwd=ROOT)
    peak = {}  # pid -> (role, VmHWM kB)
    while proc.poll() is None:
        table = proc_table()
        tree = {proc.pid}
        for _ in range(4):  # launcher -> ranks -> workers (a few levels)
            tree |= {pid for pid, (ppid, _, _) in table.items() if ppid in tree}
        for pid in tree & table.keys():
            ppid, cmd, hwm = table[pid]
            if "pretrain_ddp.py" not in cmd or "torch.distributed.run" in cmd:
                continue
            parent_cmd = table.get(ppid, (0, "", 0))[1]
            role = "worker" if "pretrain_ddp.py" in parent_cmd and "torch.distributed.run" not in parent_cmd \
                else "rank"
            peak[pid] = (role, max(hwm, peak.get(pid, ("", 0))[1]))
        time.sleep(args.poll)
    log.seek(0)
    out = log.read()
    if proc.returncode:
        sys.exit(f"{name} failed:\n{out[-3000:]}")
    rows = [(int(m[1]), float(m[2]), float(m[3])) for m in
            re.finditer(r"^step (\d+): .*train/tokens_per_sec ([\d.e+]+), .*train/data_wait ([\d.e+-]+)", out, re.M)]
    later = rows[1:] or rows
    mb = {role: [h / 1024 for r, h in peak.values() if r == role] for role in ("rank", "worker")}
    return {"name": name, "size": size, "ranks": ranks, "workers": workers, "batch": batch,
            "tokens_per_sec": statistics.median([r[1] for r in later]),
            "data_wait": statistics.median([r[2] for r in later]),
            "first_wait": rows[0][2], "rank_mb": mb["rank"], "worker_mb": mb["worker"]}


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
