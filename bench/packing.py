"""
Real tokens/s of pretrain_ddp.py with one change against without it, A/B in one run (issue 37): packed nsp pairs
against a padded row per pair, or any other pair of flag sets.

    python bench/packing.py                                      # tiny + mini, 128 + 512, packed vs --no-packing
    python bench/packing.py --sizes mini --seq-lens 128 --a "" --b "--no-packing" --repeats 3
    python bench/packing.py --sizes tiny --seq-lens 128 --steps 1200 --eval-every 300 --repeats 3   # learning

Each run is `pretrain_ddp.py --objective nsp` on the builtin corpus in a fresh process (its real loop: DataLoader
worker, collate, train_step), --steps optimizer steps; the numbers are summary.json's steady rates (after step 5,
without eval and saves): tokens_per_sec and mfu count real tokens only, padding_share is the share of the
computed positions that were padding. The sides alternate (a, b, b, a, ...), one fresh process each; the ratio
a / b of steps/hour is given per repeat (both take --batch-size pairs a step: the ratio of real tokens/s, also
against an older commit's trainer, e.g. --b-script /tmp/base/pretrain_ddp.py, whose tokens/s counted padding).
A side may run through a wrapper script (--a-script) that changes the trainer before its main() (bench/last_layer.py's
way to switch a model change that has no flag). With --eval-every, repeat k runs
with --seed k on both sides (the same initial weights and data) and evaluates builtin's held-out split; the
table gives each side's mean eval MLM loss at each eval step and the mean paired difference a - b (standard error).
"""
import argparse
import json
import os
import re
import shlex
import subprocess
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def run(args, script, flags, size, seq_len, out_dir, seed):
    evals = ["--eval-corpus", "builtin", "--eval-every", str(args.eval_every), "--seed", str(seed)] \
        if args.eval_every else ["--eval-corpus", "none"]
    cmd = [sys.executable, script, "--objective", "nsp", "--model-size", size, "--max-seq-len", str(seq_len),
           "--batch-size", str(args.batch_size), "--max-steps", str(args.steps), "--log-every", "1000",
           "--log-to", "stdout", *evals, "--save-every", "1000000", "--out-dir", out_dir,
           "--resume", "none", "--overwrite", *shlex.split(flags)]
    root = os.path.dirname(os.path.abspath(script))  # the side's own repository: its workers import from there
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=os.path.dirname(root) if root.endswith("bench")
                         else root)
    if out.returncode:
        sys.exit(f"pretrain_ddp.py failed ({' '.join(cmd)}):\n{out.stderr[-3000:]}")
    with open(os.path.join(out_dir, "summary.json")) as f:
        summary = json.load(f)
    summary["evals"] = {int(k): float(v) for k, v in re.findall(r"^step (\d+): eval/mlm_loss ([\d.]+)", out.stdout,
                                                                re.M)}
    return summary


def cells(found, key, fmt):
    return tuple(" / ".join(fmt.format(s.get(key) or 0) for s in found[side]) for side in "ab")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].strip(),
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--sizes", default="tiny,mini")
    p.add_argument("--seq-lens", default="128,512")
    p.add_argument("--a", default="", help="flags of side a (default: the defaults: packed)")
    p.add_argument("--b", default="--no-packing", help="flags of side b")
    p.add_argument("--a-script", default=os.path.join(ROOT, "pretrain_ddp.py"))
    p.add_argument("--b-script", default=os.path.join(ROOT, "pretrain_ddp.py"))
    p.add_argument("--repeats", type=int, default=2, help="alternating pairs per configuration")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--eval-every", type=int, default=0, help="also compare the eval loss (repeat k: --seed k)")
    p.add_argument("--out-dir", default="/tmp/bert_ddp_bench/packing")
    args = p.parse_args()
    sides = {"a": (args.a_script, args.a), "b": (args.b_script, args.b)}
    print(f"a: {os.path.basename(args.a_script)} {args.a or '(defaults)'}; b: {os.path.basename(args.b_script)} "
          f"{args.b or '(defaults)'}; batch {args.batch_size}, {args.steps} steps, builtin nsp\n")
    print("| size | max seq len | a tokens/s | b tokens/s | a / b (pairs/s) | padding a / b | MFU a / b |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for size in args.sizes.split(","):
        for seq_len in [int(x) for x in args.seq_lens.split(",")]:
            found = {"a": [], "b": []}
            for repeat in range(args.repeats):
                for side in ("ab" if repeat % 2 == 0 else "ba"):
                    script, flags = sides[side]
                    found[side].append(run(args, script, flags, size, seq_len,
                                           os.path.join(args.out_dir, f"{size}-{seq_len}-{side}"), repeat))
            # Steps/hour: both sides take --batch-size pairs a step, so this is the ratio of real tokens/s even
            # against an older trainer whose tokens/s counted padding (and whose summary has no padding_share).
            ratios = [a["steps_per_hour"] / b["steps_per_hour"] for a, b in zip(found["a"], found["b"], strict=True)]
            tok_a, tok_b = cells(found, "tokens_per_sec", "{:,.0f}")
            pad_a, pad_b = cells(found, "padding_share", "{:.0%}")
            mfu_a, mfu_b = cells(found, "mfu", "{:.1%}")
            print(f"| {size} | {seq_len} | {tok_a} | {tok_b} | {' / '.join(f'{r:.2f}' for r in ratios)} | "
                  f"{pad_a} ; {pad_b} | {mfu_a} ; {mfu_b} |", flush=True)
            for step in sorted(found["a"][0]["evals"]) if args.eval_every else ():
                a, b = (np.array([s["evals"][step] for s in found[side]]) for side in "ab")
                diff = a - b
                print(f"  eval MLM loss at step {step}: a {a.mean():.4f}, b {b.mean():.4f}, a - b {diff.mean():+.4f} "
                      f"(standard error {diff.std(ddof=1) / np.sqrt(len(diff)) if len(diff) > 1 else 0:.4f})")


if __name__ == "__main__":
    main()
