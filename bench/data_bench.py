"""
Data-side benchmarks: the stream next to the bare tokenizer, worker memory as the corpus grows,
and estimate_steps.py's exact and sample modes on a large generated corpus.

    python bench/data_bench.py                          # builtin + 100 MB, RSS at 10/100 MB, estimator at 200 MB
    python bench/data_bench.py --estimate-mb 1000       # the estimator on 1 GB (exact mode takes ~15 min)

Every comparison is taken in this one run, on this machine; see BENCHMARKS.md.
"""
import argparse
import json
import os
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


def generate(path, megabytes, seed=0):
    """A BERT-format corpus of made-up Zipf-distributed words: ~20 sentences a document."""
    if os.path.exists(path) and os.path.getsize(path) >= megabytes * 1e6:
        return path
    rng = np.random.default_rng(seed)
    letters = np.array(list("etaoinshrdlucmfwypvbgkjqxz"))
    vocab = ["".join(rng.choice(letters, rng.integers(2, 10))) for _ in range(20000)]
    zipf = 1 / np.arange(1, len(vocab) + 1)
    zipf /= zipf.sum()
    with open(path + ".tmp", "w") as f:
        written = 0
        while written < megabytes * 1e6:
            words = rng.choice(len(vocab), 200_000, p=zipf)
            lengths = rng.integers(5, 30, 20_000)
            cuts = np.cumsum(lengths)
            sentences = [" ".join(vocab[w] for w in words[a:b]) + " ." for a, b in zip(cuts[:-1], cuts[1:],
                                                                                      strict=True)]
            docs = ["\n".join(sentences[i:i + int(rng.integers(5, 40))]) for i in range(0, len(sentences), 20)]
            text = "\n\n".join(docs) + "\n\n"
            f.write(text)
            written += len(text)
    os.replace(path + ".tmp", path)
    return path


def run(cmd):
    return subprocess.run(cmd, capture_output=True, text=True, check=True, cwd=ROOT).stdout


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].strip())
    p.add_argument("--work-dir", default="/tmp/bert_ddp_bench", help="where generated corpora go")
    p.add_argument("--stream-mb", type=int, default=100, help="generated corpus for the stream-vs-tokenizer rate")
    p.add_argument("--rss-mb", type=int, nargs=2, default=[10, 100], help="two corpus sizes for worker memory")
    p.add_argument("--estimate-mb", type=int, default=200, help="generated corpus for the estimator")
    p.add_argument("--seconds", type=float, default=15, help="time budget of each stream measurement")
    args = p.parse_args()
    os.makedirs(args.work_dir, exist_ok=True)
    tok_dir = os.path.join(args.work_dir, "tokenizer")
    results = {}

    # 1. stream vs bare tokenizer (bench/stream_bench.py prints both, one worker, same text)
    corpora = {"builtin": "builtin", f"{args.stream_mb} MB": generate(
        os.path.join(args.work_dir, f"gen{args.stream_mb}.txt"), args.stream_mb)}
    if not os.path.isdir(tok_dir):
        subprocess.run([sys.executable, "-c", "import data_stream as d; "
                        f"t = d.get_tokenizer(None, [{corpora[f'{args.stream_mb} MB']!r}], 8192); "
                        f"t.save_pretrained({tok_dir!r})"], check=True, cwd=ROOT)
    for name, corpus in corpora.items():
        extra = [] if corpus == "builtin" else ["--tokenizer", tok_dir]
        for objective in ("nsp", "mlm"):
            out = run([sys.executable, "bench/stream_bench.py", "--corpus", corpus, *extra, "--objective", objective,
                       "--seconds", str(args.seconds)])
            stream = float(out.split("samples/s, ")[1].split(" tokens/s")[0].replace(",", ""))
            bare = float(out.split("one thread: ")[1].split(" tokens/s")[0].replace(",", ""))
            results[f"stream {name} {objective}"] = {"stream_tokens_per_s": stream, "tokenizer_tokens_per_s": bare,
                                                     "ratio": stream / bare}
            print(f"{name:>8} {objective}: stream {stream:,.0f} tokens/s, bare tokenizer {bare:,.0f} tokens/s, "
                  f"ratio {stream / bare:.2f}", flush=True)

    # 2. worker memory at two corpus sizes: index + one chunk of documents, never the corpus
    for mb in args.rss_mb:
        path = generate(os.path.join(args.work_dir, f"gen{mb}.txt"), mb)
        code = ("import resource, data_stream as d, time; "
                f"s = d.BertPretrainStream({path!r}, d.get_tokenizer({tok_dir!r}), rank=0, world_size=1); "
                "t = time.time(); n = 0\n"
                "for b in s:\n    n += 1\n    if time.time() - t > 10: break\n"
                "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, len(s.index['start']))")
        out = run([sys.executable, "-c", code]).split()
        results[f"rss {mb} MB"] = {"peak_rss_mb": float(out[0]), "documents": int(out[1])}
        print(f"worker peak RSS on {mb} MB ({int(out[1]):,} documents): {float(out[0]):.0f} MB", flush=True)

    # 3. the estimator: exact tokens/s, sample-mode time and its error against exact
    path = generate(os.path.join(args.work_dir, f"gen{args.estimate_mb}.txt"), args.estimate_mb)
    estimates = {}
    for mode in ("sample", "exact"):
        t0 = time.perf_counter()
        out = run([sys.executable, "estimate_steps.py", "--corpus", path, "--tokenizer", tok_dir,
                   "--mode", mode, "--world-size", "8", "--num-workers", "2", "--json"])
        estimates[mode] = json.loads(out)
        estimates[mode]["wall_s"] = time.perf_counter() - t0
    exact, sample = estimates["exact"], estimates["sample"]
    error = sample["total_steps"] / exact["total_steps"] - 1
    inside = sample["total_steps_ci"][0] <= exact["total_steps"] <= sample["total_steps_ci"][1]
    results["estimator"] = {"corpus_mb": args.estimate_mb, "exact_steps": exact["total_steps"],
                            "exact_wall_s": exact["wall_s"], "exact_tokens_per_s": exact["tokens"] / exact["seconds"],
                            "sample_steps": sample["total_steps"], "sample_ci": sample["total_steps_ci"],
                            "sample_wall_s": sample["wall_s"], "sample_error": error, "exact_inside_ci": inside}
    print(f"estimator on {args.estimate_mb} MB: exact {exact['total_steps']:,} steps in {exact['wall_s']:.0f} s "
          f"({exact['tokens'] / exact['seconds']:,.0f} tokens/s); sample {sample['total_steps']:,} "
          f"{sample['total_steps_ci']} in {sample['wall_s']:.0f} s, error {error:+.2%}, exact inside the interval: "
          f"{inside}")
    with open(os.path.join(args.work_dir, "data_bench.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
