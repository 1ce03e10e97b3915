"""
What a real corpus costs before and at the first step (issue 10): first launch at two corpus sizes
(fresh and warm cache), and book-sized documents (time to the first batch, tokens/s).

    python bench/first_launch.py                        # 100 MB and 1 GB, 2 ranks; 30 books of 1 MB
    python bench/first_launch.py --sizes-mb 10,100 --books 10

First launch: `torchrun --nproc_per_node 2 pretrain_ddp.py --max-steps 1` on a generated corpus
(bench/data_bench.py's Zipf words), timed from the launch to the line of step 1, once with an
empty BERT_DDP_CACHE (index, tokenizer, estimate) and once more with the cache the first left.
Books: `bench/stream_bench.py --token-cache none` on documents of ~1 MB, nsp and mlm: the cold rate (every
document read and tokenized), time to the first batch, and how many documents a batch mixes.
Every comparison is taken in this one run, on this machine; see BENCHMARKS.md.
"""
import argparse
import os
import re
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
from data_bench import generate  # noqa: E402


def first_step_seconds(corpus, cache, out_dir, ranks):
    """Launch to the 'step 1:' line of a 1-step run (the run then ends)."""
    env = {**os.environ, "BERT_DDP_CACHE": cache}
    cmd = ["torchrun", "--standalone", f"--nproc_per_node={ranks}", os.path.join(ROOT, "pretrain_ddp.py"),
           "--corpus", corpus, "--max-steps", "1", "--log-every", "1", "--eval-corpus", "none",
           "--log-to", "stdout", "--out-dir", out_dir, "--overwrite", "--resume", "none", "--num-workers", "1"]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=ROOT)
    seconds, lines = None, []
    for line in proc.stdout:
        lines.append(line)
        if seconds is None and line.startswith("step 1:"):
            seconds = time.perf_counter() - t0
    if proc.wait() != 0 or seconds is None:
        sys.exit("first launch failed:\n" + "".join(lines[-20:]))
    return seconds


def write_books(path, count, megabytes):
    """count documents of ~megabytes each, cut from a generated corpus (blank lines removed)."""
    source = generate(path + ".src", count * megabytes + 1)
    with open(source) as f, open(path, "w") as out:
        for _ in range(count):
            lines, size = [], 0
            while size < megabytes * 1e6:
                line = f.readline()
                if line.strip():
                    lines.append(line)
                    size += len(line)
            out.write("".join(lines) + "\n")
    return path


def book_bench(path, cache, objective, seconds):
    env = {**os.environ, "BERT_DDP_CACHE": cache}
    out = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "stream_bench.py"), "--corpus", path,
                          "--objective", objective, "--seconds", str(seconds), "--token-cache", "none"],
                         capture_output=True, text=True,
                         env=env, cwd=ROOT, check=True).stdout
    tokens = re.search(r"([\d,]+) tokens/s \(one worker", out).group(1)
    first = re.search(r"first batch after ([\d.]+) s", out).group(1)
    distinct = re.search(r"([\d.]+) distinct documents", out).group(1)
    return tokens, first, distinct


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].strip(),
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--sizes-mb", default="100,1000", help="comma list of corpus sizes for the first launch")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--books", type=int, default=30, help="book-sized documents (0: skip)")
    p.add_argument("--book-mb", type=float, default=1.0)
    p.add_argument("--bench-seconds", type=float, default=60.0, help="cap per book run (one cold epoch: ~30 s)")
    p.add_argument("--work-dir", default="/tmp/bert_ddp_bench/first_launch")
    args = p.parse_args()
    os.makedirs(args.work_dir, exist_ok=True)
    print("| corpus | first launch, fresh cache (s) | again, warm cache (s) |\n| --- | --- | --- |")
    for mb in [int(x) for x in args.sizes_mb.split(",") if x]:
        corpus = generate(os.path.join(args.work_dir, f"corpus-{mb}mb.txt"), mb)
        cache = os.path.join(args.work_dir, f"cache-{mb}")
        shutil.rmtree(cache, ignore_errors=True)
        out_dir = os.path.join(args.work_dir, f"run-{mb}")
        fresh = first_step_seconds(corpus, cache, out_dir, args.ranks)
        warm = first_step_seconds(corpus, cache, out_dir, args.ranks)
        print(f"| {os.path.getsize(corpus) / 1e6:,.0f} MB, {args.ranks} ranks | {fresh:.1f} | {warm:.1f} |", flush=True)
    if args.books:
        path = write_books(os.path.join(args.work_dir, f"books-{args.books}.txt"), args.books, args.book_mb)
        print(f"\n{args.books} documents of ~{args.book_mb} MB, one worker, no token cache (cold rate):\n")
        print("| objective | first batch (s) | tokens/s | distinct documents per batch of 32 |")
        print("| --- | --- | --- | --- |")
        for objective in ("nsp", "mlm"):
            tokens, first, distinct = book_bench(path, os.path.join(args.work_dir, "cache-books"), objective,
                                                 args.bench_seconds)
            print(f"| {objective} | {first} | {tokens} | {distinct} |", flush=True)


if __name__ == "__main__":
    main()
