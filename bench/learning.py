"""
Learning verified, not assumed: pretrain_ddp.py vs transformers.Trainer (run_mlm recipe), scored by one evaluator.

    python bench/learning.py                       # the recorded configuration (BENCHMARKS.md section 11), ~29 min
    python bench/learning.py --quick               # a smoke run: 120 steps, 2 evaluation points, one seed
    python bench/learning.py --steps 2400 --eval-every 600 --seeds 0,1,2
    python bench/learning.py --sides ours --seeds 0 # one side only (e.g. a longer run of ours)

Both sides train the same model (pretrain_ddp.model_from, the same torch seed before it, so the same initial
weights for the same seed), on the same data (builtin's train split), with the same optimizer (torch fused AdamW,
betas 0.9/0.98, eps 1e-6, decay --weight-decay on params with ndim >= 2 except LayerNorm), the same LR plan
(pretrain_ddp.lr_factor: warmup (pos+1)/warmup_steps, linear decay to 0 at --steps; given to the Trainer as a
LambdaLR, since its built-in linear schedule starts at 0), batch, max_seq_len, dropout, clipping 1.0, steps.

Ours: `pretrain_ddp.py --objective mlm --tokenizer T --max-steps N --save-every E --keep-last 1000`, one process;
its checkpoints step_XXXXXX/trainer.pt hold the Hugging Face state_dict ("model").
Trainer: run_mlm.py's recipe (line_by_line=False) on a dataset of one record per document: each record tokenized
with [CLS]/[SEP], concatenated in corpus order, cut into max_seq_len blocks (group_texts, remainder dropped),
shuffled by the Trainer's sampler, DataCollatorForLanguageModeling(mlm_probability=0.15); the model's state_dict is
saved at the same steps by a callback.

The evaluator (one function, both sides): builtin's held-out split tokenized with the run's tokenizer, each
document's tokens + [SEP], concatenated, cut into [CLS] + (max_seq_len - 2) + [SEP] windows; 15% of the non-special
tokens masked 80/10/10 once with a fixed numpy seed (--mask-seed), so every model sees identical masked inputs.
It reports MLM loss and accuracy at the masked positions, and two baselines from the training split's token counts:
always predicting the most frequent token (accuracy) and the unigram distribution (loss) -- the plateau.

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
import subprocess
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)


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
    p.add_argument("--worker", choices=["trainer"], help=argparse.SUPPRESS)  # internal: one Trainer run
    p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--tokenizer", default=None, help=argparse.SUPPRESS)
    p.add_argument("--run-dir", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.quick:
        args.steps, args.eval_every, args.seeds = 120, 60, "0"
    if args.out_dir is None:
        args.out_dir = "/tmp/bert_ddp_bench/learning" + ("" if args.corpus == "builtin" else "-" + args.corpus)
    return args


def eval_steps(args):
    return [s for s in range(args.eval_every, args.steps + 1, args.eval_every)] or [args.steps]


def lr_plan(args):
    import estimate_steps
    warmup = estimate_steps.warmup_steps(args.warmup, args.steps)
    return {"total": args.steps, "warmup": warmup, "decay_from": [warmup, 1.0]}


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
    import data_stream
    corpus = data_stream.open_corpus(corpus_flag(args, split), split, "mlm")
    return [data_stream.tokenize_lines(tok, corpus.read(d))[0].tolist() for d in range(corpus.num_docs)]


# ----------------------------------------------------------------------------- the tokenizer (ours, once)

def make_tokenizer(args, env):
    run_dir = os.path.join(args.out_dir, "tokenizer-run")
    tok_dir = os.path.join(run_dir, "tokenizer")
    if not os.path.isdir(tok_dir):
        cmd = [sys.executable, os.path.join(ROOT, "pretrain_ddp.py"), "--objective", "mlm", "--max-steps", "1",
               "--corpus", corpus_flag(args, "train"), "--eval-corpus", "none", "--log-to", "stdout", "--out-dir",
               run_dir, "--resume", "none", "--overwrite"]
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT)
        if out.returncode:
            sys.exit(f"pretrain_ddp.py (tokenizer run) failed:\n{out.stderr[-3000:]}")
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
    cmd = [sys.executable, os.path.join(ROOT, "pretrain_ddp.py"), "--objective", "mlm", "--corpus",
           corpus_flag(args, "train"), "--eval-corpus", corpus_flag(args, "eval"), "--model-size", args.model_size,
           "--tokenizer", tok_dir, "--batch-size", str(args.batch_size), "--max-seq-len",
           str(args.max_seq_len), "--lr", str(args.lr), "--warmup", str(args.warmup), "--weight-decay",
           str(args.weight_decay), "--dropout", str(args.dropout), "--clip", "1.0", "--seed", str(seed),
           "--max-steps", str(args.steps), "--epochs", str(epochs_needed(args, tok_dir)),
           "--save-every", str(args.eval_every), "--keep-last", "1000", "--eval-every", str(args.steps),
           "--log-every", str(args.eval_every), "--log-to", "stdout", "--out-dir", run_dir, "--resume", "none",
           "--overwrite", *shlex.split(args.ours_flags)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT)
    if out.returncode:
        sys.exit(f"pretrain_ddp.py failed:\n{out.stderr[-3000:]}")
    with open(os.path.join(run_dir, "summary.json")) as f:
        summary = json.load(f)
    assert summary["steps"] == args.steps, summary["steps"]
    return {s: os.path.join(run_dir, "checkpoints", f"step_{s:06d}", "trainer.pt") for s in eval_steps(args)}


# ----------------------------------------------------------------------------- Trainer (run_mlm recipe)

def trainer_worker(args):
    import torch
    from transformers import DataCollatorForLanguageModeling, Trainer, TrainerCallback, TrainingArguments

    import data_stream
    import pretrain_ddp
    tok = data_stream.get_tokenizer(args.tokenizer)
    # run_mlm.py, line_by_line=False, one record per document: tokenize (with [CLS]/[SEP]), concatenate, cut
    if args.trainer_data.startswith("blocks"):
        docs = split_documents(tok, args, "train")
        if args.trainer_data == "blocks-random-docs":
            docs = [docs[i] for i in np.random.default_rng(args.seed).permutation(len(docs))]
        ids = [t for doc in docs for t in [tok.cls_token_id, *doc, tok.sep_token_id]]
        n = args.max_seq_len
        blocks = [{"input_ids": ids[i:i + n], "token_type_ids": [0] * n, "attention_mask": [1] * n}
                  for i in range(0, len(ids) // n * n, n)]
    else:  # our default flags' windows (not --ours-flags)
        blocks = our_windows(tok, args, shuffled=args.trainer_data == "ours-shuffled")
    torch.manual_seed(args.seed)  # as pretrain_ddp.py: the seed, then the model (same initial weights)
    architecture = pretrain_ddp.new_architecture(args.model_size, len(tok), args.max_seq_len, tok.pad_token_id)
    model = pretrain_ddp.model_from(architecture, "mlm", args.dropout)
    # pretrain_ddp.py's optimizer groups and settings, and its LR plan (the Trainer's linear schedule starts at 0)
    named = list(model.named_parameters())
    decay = [p for name, p in named if p.ndim >= 2 and "LayerNorm" not in name]
    no_decay = [p for name, p in named if p.ndim < 2 or "LayerNorm" in name]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.98),
                                  eps=1e-6, fused=True)
    plan = lr_plan(args)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: pretrain_ddp.lr_factor(plan, s))
    save_at = set(eval_steps(args))
    os.makedirs(args.run_dir, exist_ok=True)

    class Save(TrainerCallback):
        def on_step_end(self, targs, state, control, model=None, **kw):
            if state.global_step in save_at:
                torch.save({"model": model.state_dict()},
                           os.path.join(args.run_dir, f"step_{state.global_step:06d}.pt"))

    targs = TrainingArguments(
        output_dir=os.path.join(args.run_dir, "trainer_tmp"), per_device_train_batch_size=args.batch_size,
        max_steps=args.steps, learning_rate=args.lr, weight_decay=args.weight_decay, adam_beta1=0.9,
        adam_beta2=0.98, adam_epsilon=1e-6, max_grad_norm=1.0, use_cpu=True, dataloader_num_workers=0,
        logging_strategy="no", save_strategy="no", report_to="none", disable_tqdm=True, seed=args.seed)
    class InOrder(Trainer):  # our windows come in our order: no sampler of its own
        def _get_train_sampler(self, train_dataset=None):
            return torch.utils.data.SequentialSampler(train_dataset or self.train_dataset)

    trainer = (Trainer if args.trainer_data.startswith("blocks") else InOrder)(
        model=model, args=targs, train_dataset=blocks, optimizers=(optimizer, scheduler),
                      data_collator=DataCollatorForLanguageModeling(tok, mlm=True, mlm_probability=0.15),
                      callbacks=[Save()])
    t0 = time.perf_counter()
    trainer.train()
    print(json.dumps({"time_s": time.perf_counter() - t0, "blocks": len(blocks), "threads": torch.get_num_threads(),
                      "final_lr": scheduler.get_last_lr()[0]}))


def our_windows(tok, args, shuffled):
    """pretrain_ddp.py's mlm windows of this seed, epoch after epoch in its order (one shard: 1 rank x 1 worker,
    as run_ours) or shuffled within each epoch, unmasked (mask_prob 0), as Trainer records."""
    import data_stream
    stream = data_stream.BertPretrainStream(corpus_flag(args, "train"), tok, objective="mlm",
                                            batch_size=args.batch_size, max_seq_len=args.max_seq_len, mask_prob=0.0,
                                            seed=args.seed)
    rows, rng = [], np.random.default_rng(args.seed)
    for epoch in range(epochs_needed(args, args.tokenizer)):
        stream.set_epoch(epoch)
        epoch_rows = []
        for batch in stream:
            for ids, mask in zip(batch["input_ids"], batch["attention_mask"], strict=True):
                row = ids[mask.bool()].tolist()
                epoch_rows.append({"input_ids": row, "token_type_ids": [0] * len(row),
                                   "attention_mask": [1] * len(row)})
        rows += [epoch_rows[i] for i in rng.permutation(len(epoch_rows))] if shuffled else epoch_rows
    return rows


def run_trainer(args, seed, tok_dir, run_dir, env):
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "trainer", "--seed", str(seed), "--tokenizer",
           tok_dir, "--run-dir", run_dir]
    for flag in ("corpus", "out_dir", "model_size", "lr", "batch_size", "max_seq_len", "steps", "eval_every", "warmup",
                 "weight_decay", "dropout", "trainer_data"):
        cmd += ["--" + flag.replace("_", "-"), str(getattr(args, flag))]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT)
    if out.returncode:
        sys.exit(f"Trainer run failed:\n{out.stderr[-3000:]}")
    return {s: os.path.join(run_dir, f"step_{s:06d}.pt") for s in eval_steps(args)}


# ----------------------------------------------------------------------------- the evaluator

class Evaluator:
    """Held-out windows masked once (fixed seed) + baselines; score(state_dict or HF folder) -> loss, accuracy."""

    def __init__(self, tok_dir, args, mask_prob=0.15, batch_size=32):
        import numpy as np
        import torch

        import data_stream
        self.tok = tok = data_stream.get_tokenizer(tok_dir)
        max_seq_len, seed = args.max_seq_len, args.mask_seed
        self.max_seq_len, self.batch_size = max_seq_len, batch_size
        stream = [t for doc in split_documents(tok, args, "eval") for t in [*doc, tok.sep_token_id]]
        width = max_seq_len - 2
        rows = [[tok.cls_token_id, *stream[i:i + width], tok.sep_token_id]
                for i in range(0, len(stream) // width * width, width)]
        ids = np.array(rows, np.int64)
        special = np.isin(ids, tok.all_special_ids)
        rng = np.random.default_rng(seed)
        chosen = (rng.random(ids.shape) < mask_prob) & ~special
        how = rng.random(ids.shape)
        normal = np.setdiff1d(np.arange(len(tok)), tok.all_special_ids)
        labels = np.where(chosen, ids, -100)
        ids[chosen & (how < 0.8)] = tok.mask_token_id
        swap = chosen & (how >= 0.8) & (how < 0.9)
        ids[swap] = rng.choice(normal, int(swap.sum()))
        self.ids, self.labels = torch.from_numpy(ids), torch.from_numpy(labels)
        targets = labels[labels != -100]
        counts = np.bincount([t for doc in split_documents(tok, args, "train") for t in doc], minlength=len(tok))
        probs = (counts + 1) / (counts + 1).sum()  # add-one: every target has some probability
        self.info = {"windows": len(rows), "masked": len(targets), "eval_tokens": len(stream),
                     "most_frequent_token": tok.convert_ids_to_tokens(int(counts.argmax())),
                     "most_frequent_accuracy": float((targets == counts.argmax()).mean()),
                     "unigram_loss": float(-np.log(probs[targets]).mean())}

    def score(self, weights, model_size):
        import torch
        from transformers import BertForMaskedLM

        import pretrain_ddp
        if isinstance(weights, str) and os.path.isdir(weights):
            model = BertForMaskedLM.from_pretrained(weights)
        else:
            state = torch.load(weights, map_location="cpu", weights_only=True)["model"] \
                if isinstance(weights, str) else weights
            architecture = pretrain_ddp.new_architecture(model_size, len(self.tok), self.max_seq_len,
                                                         self.tok.pad_token_id)
            model = pretrain_ddp.model_from(architecture, "mlm", 0.0)
            model.load_state_dict(state)
        model.eval()
        loss_sum, correct = 0.0, 0
        with torch.no_grad():
            for i in range(0, len(self.ids), self.batch_size):
                ids, labels = self.ids[i:i + self.batch_size], self.labels[i:i + self.batch_size]
                hidden = model.bert(input_ids=ids, token_type_ids=torch.zeros_like(ids)).last_hidden_state
                picked = labels != -100
                logits = model.cls(hidden[picked]).double()
                loss_sum += float(torch.nn.functional.cross_entropy(logits, labels[picked], reduction="sum"))
                correct += int((logits.argmax(-1) == labels[picked]).sum())
        masked = int((self.labels != -100).sum())
        return {"loss": loss_sum / masked, "accuracy": correct / masked}


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
        stream[seed] = data_stream.BertPretrainStream(corpus_flag(args, "train"), tok, objective="mlm", batch_size=b,
                                                      max_seq_len=args.max_seq_len, seed=seed, rank=0, world_size=1)
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
    args = parse_args()
    if args.worker == "trainer":
        return trainer_worker(args)
    seeds = [int(s) for s in args.seeds.split(",")]
    sides = args.sides.split(",")
    assert set(sides) <= {"ours", "trainer"} and args.eval_every >= 1 and args.steps >= 1
    os.makedirs(args.out_dir, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "TOKENIZERS_PARALLELISM": "false"}
    tok_dir = make_tokenizer(args, env)
    if args.order_table:
        return order_table(args, tok_dir)
    print(f"BERT-{args.model_size}, lr {args.lr}, batch {args.batch_size} x seq {args.max_seq_len}, {args.steps} "
          f"steps (warmup {lr_plan(args)['warmup']}), eval at {eval_steps(args)}, seeds {seeds}, "
          f"{args.threads} thread(s) per run", flush=True)
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
    evaluator = Evaluator(tok_dir, args)
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
