"""
The four configurations of the original FARM speed measurement, on whatever hardware this is (BENCHMARKS.md
section 3).

    python bench/seed_table.py                       # BERT-tiny, 20 optimizer steps each
    python bench/seed_table.py --steps 12            # the recorded table
    python bench/seed_table.py --model-size base --steps 5 --batch-size 8
    python bench/seed_table.py --only ab --steps 3   # a smoke run

(a) one process, gradient accumulation (--accum-steps 3, no DataLoader workers)
(b) DDP, --nproc ranks, --amp (no workers)
(c) DDP, --amp, 2 DataLoader workers per rank
(d) DDP, 2 workers per rank, no --amp
Each row is one pretrain_ddp.py run; its summary.json gives the iterations, the time taken
(the whole training loop: the DataLoader start and the first steps included) and the steady
steps/hour (after the first 5 steps, without eval and saves; `steady_from_step`). Projected
total = the reference job (500k steps at effective batch 945, i.e. 500000 x 945 samples) at
this run's samples/hour: 500000 * 945 / effective batch / steps per hour. The dtype is the run's config line's.
"""

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import common  # noqa: E402

REFERENCE_SAMPLES = 500_000 * 945


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].strip(),
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model-size", default="tiny")
    p.add_argument("--batch-size", type=int, default=32, help="B: micro-batch per rank")
    p.add_argument("--max-seq-len", type=int, default=128)
    p.add_argument("--steps", type=int, default=20, help="optimizer steps per configuration")
    p.add_argument("--nproc", type=int, default=2, help="DDP ranks of (b)-(d)")
    p.add_argument("--workers", type=int, default=2, help="DataLoader workers per rank of (c), (d)")
    p.add_argument("--only", default="abcd", help="subset of the configurations to run")
    p.add_argument("--extra", default="", help="more pretrain_ddp.py flags for every run, e.g. '--objective mlm'")
    p.add_argument("--out-dir", default="/tmp/bert_ddp_bench/seed_table")
    return p.parse_args()


def run(args, name, ranks, accum, amp, workers):
    flags = ["--model-size", args.model_size, "--batch-size", str(args.batch_size), "--max-seq-len",
             str(args.max_seq_len), "--accum-steps", str(accum), "--max-steps", str(args.steps), "--num-workers",
             str(workers), *(["--amp"] if amp else []), *args.extra.split()]
    done = common.pretrain(flags, os.path.join(args.out_dir, name), ranks=ranks, env=os.environ)
    return done.summary, common.config_of(done.log)["amp_dtype"], "training in fp32" in done.log


def main():
    args = parse_args()
    B, n, w = args.batch_size, args.nproc, args.workers
    configs = {"a": ("(a) 1 process + accumulation", 1, 3, False, 0),
               "b": (f"(b) DDP {n} ranks + --amp", n, 1, True, 0),
               "c": (f"(c) DDP + --amp + {w} workers/rank", n, 1, True, w),
               "d": (f"(d) DDP + {w} workers/rank", n, 1, False, w)}
    rows, notes = [], []
    for key in args.only:
        label, ranks, accum, amp, workers = configs[key]
        summary, amp_dtype, warned = run(args, key, ranks, accum, amp, workers)
        eff, sph = summary["effective_batch"], summary["steps_per_hour"]
        projected_h = REFERENCE_SAMPLES / eff / sph
        rows.append(f"| {label} | {B} x {ranks} | {accum} | {eff} | {args.max_seq_len} | {summary['steps']} | "
                    f"{summary['time_s']:.1f} s | {sph * accum:,.0f} => {sph:,.0f} | {projected_h:,.0f} h "
                    f"({projected_h / 24:,.1f} days) | {amp_dtype} |")
        if amp and warned:
            notes.append(f"{label}: --amp fell back to fp32 on this CPU (no native bf16; pretrain_ddp warned)")
        elif amp:
            notes.append(f"{label}: --amp trained in {amp_dtype} (this CPU reports native bf16)")
        print(rows[-1], flush=True)
    print(f"\nBERT-{args.model_size}, {args.steps} optimizer steps per row; steps/hour: steady (summary.json); "
          "reference job: 500k steps x 945 samples")
    print("| config | batch size x ranks | accumulation | effective batch | max seq len | iterations | time taken "
          "| steps (micro-batches)/hour => effective batches/hour | projected total (500k x 945 samples) | dtype |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    print("\n".join(rows))
    for note in notes:
        print(f"note: {note}")


if __name__ == "__main__":
    main()
