"""
The data layer against an older commit's, side by side in one run (issue 37; BENCHMARKS.md section 16, "The data
layer"). A one-off A/B, recorded: to be deleted after its last run.

    python bench/data_ab.py --before 3bfe93f                 # this tree's data_stream.py against 3bfe93f's
    python bench/data_ab.py --before a0fd358 --rounds 3 --seconds 10

Corpora (generated once into --work-dir by bench/common.py's write_corpus): 30 documents of ~1 MB (books of Zipf
words) and 3,000 documents of builtin-corpus sentences. One WordPiece per corpus, trained once and
given to both sides. Each measurement is `bench/stream_bench.py` in a fresh process (one worker's work: one thread,
TOKENIZERS_PARALLELISM=false), run from a copy beside the side's data_stream.py, with a BERT_DDP_CACHE of its own:
- first batch on the books: from iter() to the first batch, with an empty token cache (cold) and a full one (warm);
- warm rate: tokens/s over whole epochs with the token cache full (filled first by the side's --build-cache),
  over the bare tokenizer's encode_batch on about the same text in the same process.
The sides alternate within each round (before, after, before, ...), so a slower minute hits both.
"""
import argparse
import os
import re
import shutil
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, ROOT)


def stream_bench(side_dir, cache, corpus, tokenizer, objective, seconds, batch_size):
    """(first batch s, tokens/s, bare tokenizer tokens/s) of one stream_bench.py run with side_dir's modules."""
    env = {**os.environ, "BERT_DDP_CACHE": cache, "TOKENIZERS_PARALLELISM": "false"}
    out = subprocess.run([sys.executable, os.path.join(side_dir, "bench", "stream_bench.py"), "--corpus", corpus,
                          "--tokenizer", tokenizer, "--objective", objective,
                          "--seconds", str(seconds), "--batch-size", str(batch_size)],
                         capture_output=True, text=True, env=env, check=True).stdout
    first = float(re.search(r"first batch after ([\d.]+) s", out).group(1))
    rate = float(re.search(r"([\d,]+) tokens/s \(one worker", out).group(1).replace(",", ""))
    bare = float(re.search(r"one thread: ([\d,]+) tokens/s", out).group(1).replace(",", ""))
    return first, rate, bare


def fill_cache(side_dir, cache, corpus, tokenizer, objective):
    env = {**os.environ, "BERT_DDP_CACHE": cache}
    subprocess.run([sys.executable, os.path.join(side_dir, "data_stream.py"), "--corpus", corpus, "--tokenizer",
                    tokenizer, "--objective", objective, "--build-cache"], capture_output=True, env=env, check=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].strip(),
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--before", required=True, help="git revision whose data_stream.py is the baseline")
    p.add_argument("--rounds", type=int, default=2, help="alternating rounds (each measures both sides)")
    p.add_argument("--seconds", type=float, default=10.0, help="time budget of each warm-rate run")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--books", type=int, default=30)
    p.add_argument("--docs", type=int, default=3000)
    p.add_argument("--work-dir", default="/tmp/bert_ddp_bench/data_ab")
    args = p.parse_args()
    from common import write_corpus

    os.makedirs(args.work_dir, exist_ok=True)
    books = os.path.join(args.work_dir, f"books-{args.books}.txt")
    write_corpus(books, docs=args.books, doc_mb=1.0, words="zipf")
    docs = os.path.join(args.work_dir, f"docs-{args.docs}.txt")
    write_corpus(docs, docs=args.docs)
    sides = {}
    for name, rev in (("before", args.before), ("after", None)):
        side = os.path.join(args.work_dir, name)
        shutil.rmtree(side, ignore_errors=True)
        os.makedirs(os.path.join(side, "bench"))
        shutil.copy(os.path.join(HERE, "stream_bench.py"), os.path.join(side, "bench"))  # imports the side's modules
        for module in ("data_stream.py", "arrow_corpus.py"):
            if rev is None:
                shutil.copy(os.path.join(ROOT, module), side)
            else:
                with open(os.path.join(side, module), "wb") as f:
                    f.write(subprocess.run(["git", "show", f"{rev}:{module}"], cwd=ROOT, capture_output=True,
                                           check=True).stdout)
        sides[name] = side
    import data_stream  # this tree's: trains the two tokenizers both sides use
    tokenizers = {}
    for corpus in (books, docs):
        tok = data_stream.get_tokenizer(None, [corpus], 8192)
        tokenizers[corpus] = os.path.join(args.work_dir, f"tok-{os.path.basename(corpus)}")
        if not os.path.isdir(tokenizers[corpus]):
            tok.save_pretrained(tokenizers[corpus])
    rows = {}
    for rnd in range(args.rounds):
        for name, side in (sides.items() if rnd % 2 == 0 else reversed(sides.items())):
            for objective in ("nsp", "mlm"):
                cache = os.path.join(args.work_dir, f"cache-{name}-{objective}")
                shutil.rmtree(cache, ignore_errors=True)
                cold = stream_bench(side, cache, books, tokenizers[books], objective, 0.001, args.batch_size)
                fill_cache(side, cache, books, tokenizers[books], objective)
                warm = stream_bench(side, cache, books, tokenizers[books], objective, 0.001, args.batch_size)
                fill_cache(side, cache, docs, tokenizers[docs], objective)
                _, rate, bare = stream_bench(side, cache, docs, tokenizers[docs], objective, args.seconds,
                                             args.batch_size)
                rows.setdefault((name, objective), []).append((cold[0], warm[0], rate, bare))
                print(f"round {rnd} {name} {objective}: first batch on books {cold[0]:.2f} s cold, {warm[0]:.2f} s "
                      f"warm; warm rate {rate:,.0f} tokens/s = {rate / bare:.2f}x the bare tokenizer", flush=True)
    print("\n| side | objective | first batch, books, cold cache (s) | warm cache (s) | warm tokens/s | "
          "x bare tokenizer |\n| --- | --- | --- | --- | --- | --- |")
    for (name, objective), values in rows.items():
        label = f"{name} ({args.before})" if name == "before" else "after (this tree)"
        cells = [" / ".join(f"{v[i]:.2f}" for v in values) for i in (0, 1)]
        cells.append(" / ".join(f"{v[2]:,.0f}" for v in values))
        cells.append(" / ".join(f"{v[2] / v[3]:.2f}" for v in values))
        print(f"| {label} | {objective} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
