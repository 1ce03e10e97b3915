"""
Scaling on one box: 2 ranks x 1 thread (torchrun, gloo) vs 1 process x 2 threads, same global batch.

    python bench/scaling.py --steps 40 --repeats 3

Alternates the two, one fresh run each; tokens/s are the median of each run's log intervals after the
first (worker start and first steps left out). Prints the per-repeat ratio and its median.
"""
import argparse
import os
import re
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def steady_tokens_per_sec(cmd, threads):
    out = subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=ROOT,
                         env={**os.environ, "OMP_NUM_THREADS": str(threads)}).stdout
    rates = [float(x) for x in re.findall(r"train/tokens_per_sec (\S+),", out)]
    return statistics.median(rates[1:])


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].strip())
    p.add_argument("--steps", type=int, default=40, help="optimizer steps per run")
    p.add_argument("--repeats", type=int, default=3, help="alternating pairs")
    p.add_argument("--model-size", default="tiny")
    args = p.parse_args()
    common = ["pretrain_ddp.py", "--model-size", args.model_size, "--max-steps", str(args.steps), "--log-every", "5",
              "--log-to", "stdout", "--eval-corpus", "none", "--save-every", "100000"]
    ratios = []
    for r in range(args.repeats):
        one = steady_tokens_per_sec([sys.executable, *common, "--batch-size", "64", "--out-dir",
                                     f"/tmp/bert_ddp_bench/scaling/one{r}", "--overwrite", "--resume", "none"], 2)
        two = steady_tokens_per_sec([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                     "--nproc_per_node", "2", *common, "--batch-size", "32", "--out-dir",
                                     f"/tmp/bert_ddp_bench/scaling/two{r}", "--overwrite", "--resume", "none"], 1)
        ratios.append(two / one)
        print(f"repeat {r}: 1 process x 2 threads {one:,.0f} tokens/s, 2 ranks x 1 thread {two:,.0f} tokens/s, "
              f"ratio {two / one:.2f}", flush=True)
    print(f"2 ranks x 1 thread / 1 process x 2 threads: median {statistics.median(ratios):.2f} "
          f"[{min(ratios):.2f}-{max(ratios):.2f}]")


if __name__ == "__main__":
    main()
