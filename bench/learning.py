"""
Learning verified, not assumed (BENCHMARKS.md section 11, issues 11 and 29): pretrain_ddp.py vs transformers.Trainer
(run_mlm recipe), scored by one evaluator.

    python bench/learning.py                       # the recorded configuration (BENCHMARKS.md section 11), ~29 min
    python bench/learning.py --quick               # a smoke run: 120 steps, 2 evaluation points, one seed
    python bench/learning.py --steps 2400 --eval-every 600 --seeds 0,1,2
    python bench/learning.py --sides ours --seeds 0 # one side only (e.g. a longer run of ours)

Both sides train the same model (pretrain_ddp.model_from, the same torch seed before it, so the same initial
weights for the same seed), on the same data (builtin's train split), with the same optimizer (torch fused AdamW,
betas 0.9/0.98, eps 1e-6, decay --weight-decay on params with ndim >= 2 except LayerNorm), the same LR plan
(estimate_steps.lr_factor: warmup (pos+1)/warmup_steps, linear decay to 0 at --steps; given to the Trainer as a
LambdaLR, since its built-in linear schedule starts at 0), batch, max_seq_len, dropout, clipping 1.0, steps.

Ours: `pretrain_ddp.py --objective mlm --tokenizer T --max-steps N --save-every E --keep-last 1000`, one process;
its checkpoints step_XXXXXX/trainer.pt hold the Hugging Face state_dict ("model").
Trainer: bench/common.py's worker, run_mlm.py's recipe (line_by_line=False) on a dataset of one record per document
(or, --trainer-data, other records); its state_dict is saved at the same steps by a callback.
The evaluator: bench/common.py's (builtin's held-out split, masked once with --mask-seed; baselines: the most
frequent token's accuracy and the unigram loss -- the plateau).

The tokenizer is trained once by a 1-step run of pretrain_ddp.py and passed to both sides. Every training process
runs alone with OMP_NUM_THREADS=--threads. Noise: the spread between the two seeds of one side at each step; ours
is within noise at a step if |ours mean - Trainer mean| <= max(ours seed spread, Trainer seed spread) (with one
seed per side no verdict is given).
"""

import argparse
import json
import math
import os
import shlex
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import common  # noqa: E402

sys.path.insert(0, os.path.dirname(HERE))
import checkpoints  # noqa: E402


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.strip().split("\n\n")[0].strip(),
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model-size", default="tiny", help="pretrain_ddp.MODEL_SIZES")
    p.add_argument("--lr", type=float, default=2e-3, help="peak learning rate, both sides")
    p.add_argument("--batch-size", type=int, default=16, help="per step, both sides")
    p.add_argument("--max-seq-len", type=int, default=128, help="tokens per window/block, both sides")
    p.add_argument("--steps", type=int, default=1200, help="optimizer steps per run (= the LR plan's total)")
    p.add_argument("--eval-every", type=int, default=300, help="evaluate the models saved every N steps")
    p.add_argument("--warmup", type=float, default=0.06, help="warmup fraction of --steps")
    p.add_argument("--weight-decay", type=float, default=0.01, help="AdamW decay (not biases/LayerNorm)")
    p.add_argument("--dropout", type=float, default=0.1, help="hidden and attention dropout")
    p.add_argument("--seeds", default="0,1", help="comma list: each side trains once per seed")
    p.add_argument("--sides", default="ours,trainer", help="comma list of ours, trainer")
    p.add_argument("--mask-seed", type=int, default=1234, help="the evaluator's fixed masking seed")
    p.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS of every training process")
    p.add_argument("--quick", action="store_true", help="smoke run: --steps 120 --eval-every 60 --seeds 0")
    p.add_argument("--corpus", default="builtin", choices=["builtin", "pydoc-topics"],
                   help="builtin's train/eval split, or the pydoc topics alone (few documents, very uneven lengths)")
    p.add_argument("--out-dir", default=None,
                   help="runs, tokenizer, results.json (default /tmp/bert_ddp_bench/learning[-CORPUS])")
    p.add_argument("--order-table", action="store_true",
                   help="only print the data order's distinct documents per batch by quarter of the epoch")
    p.add_argument("--reuse", action="store_true", help="skip runs whose saved models are all there (re-score only)")
    p.add_argument("--trainer-data", default="blocks",
                   choices=["blocks", "blocks-random-docs", "ours", "ours-shuffled"],
                   help="the Trainer's training data: run_mlm's shuffled blocks (of the documents in corpus order, or "
                        "in a random order, fixed: neighbours in a block then are unrelated, as in our windows), or "
                        "our stream's windows (unmasked: its collator masks them) in our order or shuffled within "
                        "each epoch: our data vs our loop, and our windows vs our order")
    p.add_argument("--ours-flags", default="",
                   help="more pretrain_ddp.py flags for our side, to change one thing (e.g. '--shuffle-block 64'); "
                        "give it its own --out-dir with the tokenizer-run and trainer-seed* of the base comparison")
    args = p.parse_args()
    if args.quick:
        args.steps, args.eval_every, args.seeds = 120, 60, "0"
    if args.out_dir is None:
        args.out_dir = "/tmp/bert_ddp_bench/learning" + ("" if args.corpus == "builtin" else "-" + args.corpus)
    return args


def eval_steps(args):
    return [s for s in range(args.eval_every, args.steps + 1, args.eval_every)] or [args.steps]


def corpus_paths(args):
    """{'train': path, 'eval': path} of --corpus. builtin: data_stream's own split (every 20th document held out);
    pydoc-topics: the pydoc topics alone (builtin's first 79 documents, few and of very different lengths),
    every 10th held out (71 train, 8 eval), written into --out-dir."""
    import data_stream
    if args.corpus == "builtin":
        train, held_out = data_stream.build_builtin_corpus()
        return {"train": train, "eval": held_out}
    import pydoc_data.topics
    texts = [pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics)]
    docs = [s for s in map(data_stream._split_prose, texts) if len(s) >= 2]
    paths = {"train": os.path.join(args.out_dir, "corpus", "train.txt"),
             "eval": os.path.join(args.out_dir, "corpus", "eval.txt")}
    os.makedirs(os.path.dirname(paths["train"]), exist_ok=True)
    for split, part in (("eval", docs[::10]), ("train", [d for i, d in enumerate(docs) if i % 10])):
        if not os.path.exists(paths[split]):
            text = "\n\n".join("\n".join(d) for d in part) + "\n"
            data_stream.atomic_write(paths[split], lambda f, text=text: f.write(text), "w")
    return paths


def corpus_flag(args, split):
    """What pretrain_ddp.py's --corpus/--eval-corpus is given for a split."""
    return "builtin" if args.corpus == "builtin" else corpus_paths(args)[split]


def split_documents(tok, args, split):
    """Token ids (no special tokens) of each document of --corpus's split, as pretrain_ddp.py's stream reads them."""
    return common.documents(tok, corpus_flag(args, split), split)


# ----------------------------------------------------------------------------- the tokenizer (ours, once)

def make_tokenizer(args, env):
    run_dir = os.path.join(args.out_dir, "tokenizer-run")
    tok_dir = os.path.join(run_dir, "tokenizer")
    if not os.path.isdir(tok_dir):
        common.pretrain(["--objective", "mlm", "--max-steps", "1", "--corpus", corpus_flag(args, "train")], run_dir,
                        env=env)
    return tok_dir


# ----------------------------------------------------------------------------- ours

def epochs_needed(args, tok_dir):
    """Enough --epochs that --max-steps ends the run (one spare): a huge --epochs would make pretrain_ddp.py's
    estimate list every epoch (100,000 epochs: 7 s and a 20 MB summary.json)."""
    import data_stream
    import estimate_steps
    tokens = sum(len(doc) + 1 for doc in split_documents(data_stream.get_tokenizer(tok_dir), args, "train"))
    steps_per_epoch = math.ceil(estimate_steps.shard_samples_of(tokens, "mlm", args.max_seq_len) / args.batch_size)
    return math.ceil(args.steps / steps_per_epoch) + 1


def run_ours(args, seed, tok_dir, run_dir, env):
    flags = ["--objective", "mlm", "--corpus", corpus_flag(args, "train"), "--eval-corpus", corpus_flag(args, "eval"),
             "--model-size", args.model_size, "--tokenizer", tok_dir, "--batch-size", str(args.batch_size),
             "--max-seq-len", str(args.max_seq_len), "--lr", str(args.lr), "--warmup", str(args.warmup),
             "--weight-decay", str(args.weight_decay), "--dropout", str(args.dropout), "--clip", "1.0", "--seed",
             str(seed), "--max-steps", str(args.steps), "--epochs", str(epochs_needed(args, tok_dir)),
             "--save-every", str(args.eval_every), "--keep-last", "1000", "--eval-every", str(args.steps),
             "--log-every", str(args.eval_every), *shlex.split(args.ours_flags)]
    steps = common.pretrain(flags, run_dir, env=env).summary["steps"]
    assert steps == args.steps, steps
    return {s: os.path.join(run_dir, "checkpoints", checkpoints.step_name(s), "trainer.pt") for s in eval_steps(args)}


# ----------------------------------------------------------------------------- Trainer (run_mlm recipe)

def run_trainer(args, seed, tok_dir, run_dir, env):
    """bench/common.py's Trainer worker on --trainer-data, its weights saved at the evaluation steps."""
    spec = {"tokenizer": tok_dir, "size": args.model_size, "seed": seed, "batch_size": args.batch_size,
            "max_seq_len": args.max_seq_len, "lr": args.lr, "warmup": args.warmup, "weight_decay": args.weight_decay,
            "dropout": args.dropout, "steps": args.steps, "save_steps": eval_steps(args),
            "corpus": corpus_flag(args, "train"), "in_order": not args.trainer_data.startswith("blocks")}
    if args.trainer_data == "blocks-random-docs":  # neighbours in a block then are unrelated, as in our windows
        spec["doc_order"] = "random"
    elif not args.trainer_data.startswith("blocks"):  # our default flags' windows (not --ours-flags)
        os.makedirs(run_dir, exist_ok=True)
        spec["rows"] = os.path.join(run_dir, "rows.json")
        with open(spec["rows"], "w") as f:
            json.dump(our_windows(args, seed, tok_dir, shuffled=args.trainer_data == "ours-shuffled"), f)
    result = common.trainer_run(spec, run_dir, env)
    return {m["step"]: m["file"] for m in result["marks"]}


def our_windows(args, seed, tok_dir, shuffled):
    """pretrain_ddp.py's mlm windows of this seed, epoch after epoch in its order (one shard: 1 rank x 1 worker,
    as run_ours) or shuffled within each epoch, unmasked (mask_prob 0): token id lists, the Trainer's records."""
    import data_stream
    settings = data_stream.StreamSettings(objective="mlm", batch_size=args.batch_size, max_seq_len=args.max_seq_len,
                                          mask_prob=0.0, seed=seed)
    stream = data_stream.BertPretrainStream(corpus_flag(args, "train"), data_stream.get_tokenizer(tok_dir), settings)
    rows, rng = [], np.random.default_rng(seed)
    for epoch in range(epochs_needed(args, tok_dir)):
        stream.set_epoch(epoch)
        epoch_rows = []
        for batch in stream:
            for ids, mask in zip(batch["input_ids"], batch["attention_mask"], strict=True):
                epoch_rows.append(ids[mask.bool()].tolist())
        rows += [epoch_rows[i] for i in rng.permutation(len(epoch_rows))] if shuffled else epoch_rows
    return rows


# ----------------------------------------------------------------------------- the data order

def quarters(batches):
    """Mean distinct documents per full batch in each quarter of an epoch's batches (lists of per-row doc lists)."""
    full = [b for b in batches if len(b) == len(batches[0])]
    return [float(np.mean([len({d for row in b for d in row}) for b in part]))
            for part in np.array_split(np.array(full, dtype=object), 4)]


def order_table(args, tok_dir, epochs=3):
    """Distinct documents per batch by quarter of the epoch: our stream (one worker, as the default CPU run), the same
    windows globally shuffled, and the Trainer's blocks; mean over --seeds and the first `epochs` epochs."""
    import data_stream
    tok = data_stream.get_tokenizer(tok_dir)
    b = args.batch_size
    stream = {}
    for seed in [int(s) for s in args.seeds.split(",")]:
        settings = data_stream.StreamSettings(objective="mlm", batch_size=b, max_seq_len=args.max_seq_len, seed=seed)
        stream[seed] = data_stream.BertPretrainStream(corpus_flag(args, "train"), tok, settings, rank=0, world_size=1)
    docs = split_documents(tok, args, "train")
    owner = [d for d, doc in enumerate(docs) for _ in range(len(doc) + 2)]  # [CLS] doc [SEP], as run_mlm
    n = args.max_seq_len
    blocks = [sorted(set(owner[i:i + n])) for i in range(0, len(owner) // n * n, n)]
    rows = {"ours (stream)": [], "ours' windows, global shuffle": [], "Trainer blocks (shuffled)": []}
    for seed, s in stream.items():
        for epoch in range(epochs):
            s.set_epoch(epoch)
            ours = [docs_of for _, docs_of in s.batches()]
            rows["ours (stream)"].append(quarters(ours))
            rng = np.random.default_rng([seed, epoch])
            windows = [w for batch in ours for w in batch]
            for name, units in (("ours' windows, global shuffle", windows), ("Trainer blocks (shuffled)", blocks)):
                units = [units[i] for i in rng.permutation(len(units))]
                rows[name].append(quarters([units[i:i + b] for i in range(0, len(units), b)]))
    print(f"distinct documents per batch of {b} by quarter of the epoch ({args.corpus}, {len(docs)} train documents, "
          f"seeds {args.seeds}, epochs 0-{epochs - 1}):")
    print("| order | Q1 | Q2 | Q3 | Q4 | Q4 / Q1 |\n| --- | --- | --- | --- | --- | --- |")
    for name, values in rows.items():
        q = np.mean(values, axis=0)
        print(f"| {name} | " + " | ".join(f"{v:.1f}" for v in q) + f" | {q[3] / q[0]:.2f} |")


# ----------------------------------------------------------------------------- main

def fmt_pair(values, key, pct):
    return " / ".join(f"{v[key]:.1%}" if pct else f"{v[key]:.3f}" for v in values)


def main():
    import estimate_steps
    args = parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    sides = args.sides.split(",")
    assert set(sides) <= {"ours", "trainer"} and args.eval_every >= 1 and args.steps >= 1
    os.makedirs(args.out_dir, exist_ok=True)
    env = common.environment(args.threads)
    tok_dir = make_tokenizer(args, env)
    if args.order_table:
        return order_table(args, tok_dir)
    warmup = estimate_steps.warmup_steps(args.warmup, args.steps)
    print(f"BERT-{args.model_size}, lr {args.lr}, batch {args.batch_size} x seq {args.max_seq_len}, {args.steps} "
          f"steps (warmup {warmup}), eval at {eval_steps(args)}, seeds {seeds}, {args.threads} thread(s) per run",
          flush=True)
    saved, minutes = {}, {}
    for side in sides:
        for seed in seeds:
            run_dir = os.path.join(args.out_dir, f"{side}-seed{seed}")
            expected = (run_ours if side == "ours" else run_trainer).__name__
            t0 = time.perf_counter()
            paths = None
            if args.reuse and os.path.exists(os.path.join(run_dir, "paths.json")):
                with open(os.path.join(run_dir, "paths.json")) as f:
                    paths = {int(k): v for k, v in json.load(f).items()}
                if set(paths) != set(eval_steps(args)) or not all(map(os.path.exists, paths.values())):
                    paths = None
            if paths is None:
                paths = globals()[expected](args, seed, tok_dir, run_dir, env)
                with open(os.path.join(run_dir, "paths.json"), "w") as f:
                    json.dump(paths, f)
            minutes[side, seed] = (time.perf_counter() - t0) / 60
            saved[side, seed] = paths
            print(f"  {side} seed {seed}: {minutes[side, seed]:.1f} min", flush=True)
    evaluator = common.Evaluator(tok_dir, corpus_flag(args, "train"), corpus_flag(args, "eval"), args.max_seq_len,
                                 args.mask_seed)
    info = evaluator.info
    scores = {key: {s: evaluator.score(p, args.model_size) for s, p in paths.items()} for key, paths in saved.items()}
    rows, verdicts = [], []
    for step in eval_steps(args):
        cells, means, spreads = [], {}, {}
        for side in sides:
            values = [scores[side, seed][step] for seed in seeds]
            cells += [fmt_pair(values, "loss", False), fmt_pair(values, "accuracy", True)]
            means[side] = {k: sum(v[k] for v in values) / len(values) for k in ("loss", "accuracy")}
            spreads[side] = {k: max(v[k] for v in values) - min(v[k] for v in values) for k in ("loss", "accuracy")}
        verdict = ""
        if len(sides) == 2 and len(seeds) >= 2:
            ok = []
            for k in ("loss", "accuracy"):
                diff, noise = abs(means["ours"][k] - means["trainer"][k]), max(s[k] for s in spreads.values())
                ok.append(diff <= noise)
                verdict += (f"{k} |d| {diff:.3f} vs {noise:.3f}; " if k == "loss" else
                            f"acc |d| {diff:.1%} vs {noise:.1%}: ")
            verdict += "within noise" if all(ok) else "OUTSIDE noise"
            verdicts.append(all(ok))
        rows.append(f"| {step} | " + " | ".join(cells) + (f" | {verdict} |" if verdict else " |"))
    with open(os.path.join(args.out_dir, "results.json"), "w") as f:
        json.dump({"args": vars(args), "evaluator": info, "minutes": {f"{k[0]}-{k[1]}": v for k, v in minutes.items()},
                   "scores": {f"{k[0]}-{k[1]}": v for k, v in scores.items()}}, f, indent=1)
    print(f"\nheld-out: {info['windows']} windows, {info['masked']} masked tokens (mask seed {args.mask_seed}); "
          f"baselines: most frequent token {info['most_frequent_token']!r} {info['most_frequent_accuracy']:.1%} "
          f"accuracy, unigram loss {info['unigram_loss']:.3f}")
    print("minutes per run: " + ", ".join(f"{k[0]} seed {k[1]} {v:.1f}" for k, v in minutes.items()))
    seed_names = "/".join(map(str, seeds))
    head = "| step | " + " | ".join(f"{side} loss (seed {seed_names}) | {side} acc (seed {seed_names})"
                                      for side in sides)
    print("\n" + head + (" | ours vs Trainer (mean diff vs max seed spread) |" if verdicts else " |"))
    print("| --- " * (1 + 2 * len(sides) + bool(verdicts)) + "|")
    print("\n".join(rows))
    if verdicts:
        print(f"\nverdict: ours within noise of the Trainer at {sum(verdicts)}/{len(verdicts)} points")
        # issue 29's bar: the mean gap at most +0.01 nats at every checkpoint, and ours lower at the end
        gaps = {step: sum(scores["ours", s][step]["loss"] - scores["trainer", s][step]["loss"] for s in seeds)
                / len(seeds) for step in eval_steps(args)}
        end = eval_steps(args)[-1]
        lower = sum(scores["ours", s][end]["loss"] < scores["trainer", s][end]["loss"] for s in seeds)
        print("mean (ours - Trainer) eval loss: " + ", ".join(f"step {k} {v:+.3f}" for k, v in gaps.items()) +
              f" ({'all' if max(gaps.values()) <= 0.01 else 'NOT all'} <= +0.01); ours lower at step {end} for "
              f"{lower} of {len(seeds)} seeds")


if __name__ == "__main__":
    main()
