"""
The data layer on large generated corpora (BENCHMARKS.md sections 7 and 10): one worker's stream next to the bare
tokenizer, a worker's memory as the corpus grows, estimate_steps.py's exact and sample modes, the first launch of a
2-rank run, and book-sized documents.

    python bench/data_scale.py --parts stream,rss,estimate --stream-mb 100 --rss-mb 10,100 --estimate-mb 50 \\
        --seconds 15                                                            # section 7
    python bench/data_scale.py --work-dir /tmp/db_1g --parts stream,rss,estimate --stream-mb 10 --rss-mb 10,20 \\
        --estimate-mb 1000 --seconds 3                                          # section 7, the estimator on 1 GB
    python bench/data_scale.py --parts launch --launch-mb 100,1000             # section 10, first launch
    python bench/data_scale.py --parts books                                   # section 10, 30 books of ~1 MB
    python bench/data_scale.py --stream-mb 2 --rss-mb 1,2 --estimate-mb 2 --launch-mb 2 --books 2 --book-mb 0.2 \\
        --seconds 1 --work-dir /tmp/data_scale_smoke                            # a smoke run of every part

Corpora: bench/common.py's write_corpus, words='zipf' (made-up Zipf-distributed words, 5-45 sentences a document;
books: documents of --book-mb each), generated once into --work-dir and kept; a WordPiece of 8192 trained on the
--stream-mb corpus is given to every part but the first launch (which trains its own, as a user's first run does).
- stream: bench/stream_bench.py (one worker, TOKENIZERS_PARALLELISM=false) on builtin and on --stream-mb, nsp and
  mlm: stream tokens/s over the bare tokenizer's on about the same text;
- rss: one stream iterated for 10 s in a fresh process, its peak RSS (the index and the open documents, never the
  corpus), at each --rss-mb;
- estimate: `estimate_steps.py --world-size 8 --num-workers 2` in sample and exact mode on --estimate-mb: the
  sample's error and whether its 95% interval holds the exact count;
- launch: `torchrun --nproc_per_node 2 pretrain_ddp.py --max-steps 1`, launch to the line of step 1, with an empty
  BERT_DDP_CACHE (index, tokenizer, estimate) and again with the cache it left;
- books: stream_bench.py --token-cache none on --books documents of --book-mb (every document read and tokenized):
  the first batch, tokens/s and how many documents a batch of 32 mixes.
"""
import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import common  # noqa: E402

PARTS = ("stream", "rss", "estimate", "launch", "books")


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.strip().split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma list of {', '.join(PARTS)}")
    p.add_argument("--work-dir", default="/tmp/bert_ddp_bench/data_scale", help="generated corpora, runs, caches")
    p.add_argument("--stream-mb", type=float, default=100, help="generated corpus of the stream rates (and tokenizer)")
    p.add_argument("--rss-mb", default="10,100", help="comma list of corpus sizes for a worker's memory")
    p.add_argument("--estimate-mb", type=float, default=200, help="generated corpus of the estimator")
    p.add_argument("--launch-mb", default="100,1000", help="comma list of corpus sizes for the first launch")
    p.add_argument("--ranks", type=int, default=2, help="ranks of the first launch")
    p.add_argument("--books", type=int, default=30, help="book-sized documents")
    p.add_argument("--book-mb", type=float, default=1.0)
    p.add_argument("--seconds", type=float, default=15, help="time budget of each stream measurement (books: x4)")
    p.add_argument("--worker", choices=["rss"], help=argparse.SUPPRESS)  # internal: a stream's peak RSS
    p.add_argument("--corpus", help=argparse.SUPPRESS)
    p.add_argument("--tokenizer", help=argparse.SUPPRESS)
    return p.parse_args()


def generated(args, mb):
    return common.write_corpus(os.path.join(args.work_dir, f"zipf-{mb:g}mb.txt"), mb=mb, words="zipf")


def stream_bench(corpus, objective, seconds, *flags, env=None):
    out = subprocess.run([sys.executable, os.path.join(HERE, "stream_bench.py"), "--corpus", corpus, "--objective",
                          objective, "--seconds", str(seconds), "--json", *flags], capture_output=True, text=True,
                         cwd=common.ROOT, env=env or common.environment())
    if out.returncode:
        sys.exit(f"stream_bench.py failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def rss_worker(args):
    """One stream iterated for `seconds`: this process's peak RSS (MB) and the corpus's documents."""
    import data_stream
    tokenizer = data_stream.get_tokenizer(args.tokenizer)
    stream = data_stream.BertPretrainStream(args.corpus, tokenizer, rank=0, world_size=1)
    t0 = time.time()
    for _ in stream:
        if time.time() - t0 > args.seconds:
            break
    print(json.dumps({"peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                      "documents": stream.num_docs}))


def main():
    args = parse_args()
    if args.worker == "rss":
        return rss_worker(args)
    parts = args.parts.split(",")
    assert set(parts) <= set(PARTS), parts
    os.makedirs(args.work_dir, exist_ok=True)
    results = {}
    tok_dir = os.path.join(args.work_dir, "tokenizer")
    if set(parts) - {"launch"} and not os.path.isdir(tok_dir):
        import data_stream
        data_stream.get_tokenizer(None, [generated(args, args.stream_mb)], 8192).save_pretrained(tok_dir)

    if "stream" in parts:
        print("| corpus | objective | stream tokens/s | bare tokenizer tokens/s | stream / tokenizer |\n"
              "| --- | --- | --- | --- | --- |")
        corpora = (("builtin", "builtin", ()),
                   (f"{args.stream_mb:g} MB", generated(args, args.stream_mb), ("--tokenizer", tok_dir)))
        for name, corpus, flags in corpora:
            for objective in ("nsp", "mlm"):
                r = stream_bench(corpus, objective, args.seconds, *flags)
                ratio = r["tokens_per_s"] / r["tokenizer_tokens_per_s"]
                results[f"stream {name} {objective}"] = {**r, "ratio": ratio}
                print(f"| {name} | {objective} | {r['tokens_per_s']:,.0f} | {r['tokenizer_tokens_per_s']:,.0f} | "
                      f"{ratio:.2f} |", flush=True)

    if "rss" in parts:
        for mb in (float(x) for x in args.rss_mb.split(",")):
            out = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", "rss", "--corpus",
                                  generated(args, mb), "--tokenizer", tok_dir, "--seconds", "10"], capture_output=True,
                                 text=True, cwd=common.ROOT, env=common.environment(), check=True).stdout
            r = results[f"rss {mb:g} MB"] = json.loads(out.strip().splitlines()[-1])
            print(f"worker peak RSS on {mb:g} MB ({r['documents']:,} documents): {r['peak_rss_mb']:.0f} MB", flush=True)

    if "estimate" in parts:
        path, found = generated(args, args.estimate_mb), {}
        for mode in ("sample", "exact"):
            t0 = time.perf_counter()
            out = subprocess.run([sys.executable, "estimate_steps.py", "--corpus", path, "--tokenizer", tok_dir,
                                  "--mode", mode, "--world-size", "8", "--num-workers", "2", "--json"],
                                 capture_output=True, text=True, check=True, cwd=common.ROOT).stdout
            found[mode] = {**json.loads(out), "wall_s": time.perf_counter() - t0}
        exact, sample = found["exact"], found["sample"]
        error = sample["total_steps"] / exact["total_steps"] - 1
        inside = sample["total_steps_ci"][0] <= exact["total_steps"] <= sample["total_steps_ci"][1]
        results["estimator"] = {"corpus_mb": args.estimate_mb, "exact_steps": exact["total_steps"],
                                "exact_wall_s": exact["wall_s"],
                                "exact_tokens_per_s": exact["tokens"] / exact["seconds"],
                                "sample_steps": sample["total_steps"], "sample_ci": sample["total_steps_ci"],
                                "sample_wall_s": sample["wall_s"], "sample_error": error, "exact_inside_ci": inside}
        print(f"estimator on {args.estimate_mb:g} MB: exact {exact['total_steps']:,} steps in {exact['wall_s']:.0f} s "
              f"({exact['tokens'] / exact['seconds']:,.0f} tokens/s); sample {sample['total_steps']:,} "
              f"{sample['total_steps_ci']} in {sample['wall_s']:.0f} s, error {error:+.2%}, exact inside the "
              f"interval: {inside}", flush=True)

    if "launch" in parts:
        print("\n| corpus | first launch, fresh cache (s) | again, warm cache (s) |\n| --- | --- | --- |")
        for mb in (float(x) for x in args.launch_mb.split(",") if x):
            corpus, cache = generated(args, mb), os.path.join(args.work_dir, f"cache-{mb:g}")
            shutil.rmtree(cache, ignore_errors=True)
            seconds = []
            for _ in ("fresh", "warm"):
                first = []
                common.pretrain(["--corpus", corpus, "--max-steps", "1", "--log-every", "1", "--num-workers", "1"],
                                os.path.join(args.work_dir, f"run-{mb:g}"), ranks=args.ranks, every=0.05,
                                env=common.environment(BERT_DDP_CACHE=cache),
                                on_line=lambda line, s, first=first: first.append(s) if line.startswith("step 1:")
                                else None)
                seconds.append(first[0])
            results[f"launch {mb:g} MB"] = dict(zip(("fresh_s", "warm_s"), seconds, strict=True))
            print(f"| {os.path.getsize(corpus) / 1e6:,.0f} MB, {args.ranks} ranks | {seconds[0]:.1f} | "
                  f"{seconds[1]:.1f} |", flush=True)

    if "books" in parts:
        path = common.write_corpus(os.path.join(args.work_dir, f"books-{args.books}x{args.book_mb:g}mb.txt"),
                                   docs=args.books, doc_mb=args.book_mb, words="zipf")
        print(f"\n{args.books} documents of ~{args.book_mb:g} MB, one worker, no token cache (cold rate):\n\n"
              "| objective | first batch (s) | tokens/s | distinct documents per batch of 32 |\n"
              "| --- | --- | --- | --- |")
        env = common.environment(BERT_DDP_CACHE=os.path.join(args.work_dir, "cache-books"))
        for objective in ("nsp", "mlm"):
            r = results[f"books {objective}"] = stream_bench(path, objective, 4 * args.seconds, "--tokenizer", tok_dir,
                                                             "--token-cache", "none", env=env)
            print(f"| {objective} | {r['first_batch_s']:.2f} | {r['tokens_per_s']:,.0f} | "
                  f"{r['distinct_documents']:.1f} |", flush=True)
    with open(os.path.join(args.work_dir, "data_scale.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
