"""
Scaling on one box (BENCHMARKS.md section 8): 2 ranks x 1 thread (torchrun, gloo) vs 1 process x 2 threads, the
same global batch.

    python bench/scaling.py --steps 40 --repeats 3        # the recorded run
    python bench/scaling.py --steps 10 --repeats 1        # a smoke run

Alternates the two, one fresh run each; tokens/s are summary.json's steady rate (after pretrain_ddp.STEADY_AFTER
steps: worker start and first steps left out). Prints the per-repeat ratio and its median.
"""
import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import common  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__.strip().split("\n\n")[0])
    p.add_argument("--steps", type=int, default=40, help="optimizer steps per run")
    p.add_argument("--repeats", type=int, default=3, help="alternating pairs")
    p.add_argument("--model-size", default="tiny")
    p.add_argument("--out-dir", default="/tmp/bert_ddp_bench/scaling")
    args = p.parse_args()
    flags = ["--model-size", args.model_size, "--max-steps", str(args.steps), "--log-every", "5"]
    ratios = []
    for r in range(args.repeats):
        one = common.pretrain([*flags, "--batch-size", "64"], os.path.join(args.out_dir, f"one{r}"), threads=2)
        two = common.pretrain([*flags, "--batch-size", "32"], os.path.join(args.out_dir, f"two{r}"), ranks=2,
                              threads=1)
        one, two = one.summary["tokens_per_sec"], two.summary["tokens_per_sec"]
        ratios.append(two / one)
        print(f"repeat {r}: 1 process x 2 threads {one:,.0f} tokens/s, 2 ranks x 1 thread {two:,.0f} tokens/s, "
              f"ratio {two / one:.2f}", flush=True)
    print(f"2 ranks x 1 thread / 1 process x 2 threads: {common.spread(ratios, '{:.2f}')}")


if __name__ == "__main__":
    main()
