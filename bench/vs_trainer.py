"""
pretrain_ddp.py's training loop vs Hugging Face transformers.Trainer (the run_mlm recipe), tokens/s.

    python bench/vs_trainer.py                              # tiny + mini, vocab 30522 and 8192
    python bench/vs_trainer.py --sizes small --vocabs 30522 --repeats 2

Ours: `pretrain_ddp.py --objective mlm` run as a subprocess (its real loop: DataLoader worker,
prepare, train_step, MLM head on masked rows only), timed from its per-step log lines after
--warmup steps. Trainer: BertForMaskedLM (the same model_from config) on run_mlm's recipe:
lines tokenized with [CLS]/[SEP], concatenated, cut into max_seq_len blocks (group_texts),
DataCollatorForLanguageModeling(mlm_probability=0.15), AdamW (torch fused: the Trainer default, like ours), fp32,
timed with a TrainerCallback from the end of step --warmup to the end of the last step.
Both count non-pad tokens, use the same thread count (OMP_NUM_THREADS) and the same dropout.
The two sides alternate, one fresh process each, --repeats times; ratios are per repeat.

The builtin corpus holds fewer than 30522 WordPieces (~11.7k): for --vocabs 30522 the trained
tokenizer is padded with never-matching [unusedN] entries, so the model (what sets the speed)
has the full 30522-row embedding and output layer.
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].strip(),
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--sizes", default="tiny,mini", help="comma list of pretrain_ddp.MODEL_SIZES")
    p.add_argument("--vocabs", default="30522,8192", help="comma list of model vocabulary sizes")
    p.add_argument("--repeats", type=int, default=3, help="alternating A/B pairs per configuration")
    p.add_argument("--steps", type=int, default=8, help="timed optimizer steps per run")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (worker start, allocator)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--max-seq-len", type=int, default=128)
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="torch threads on both sides")
    p.add_argument("--num-workers", type=int, default=1, help="pretrain_ddp.py --num-workers (its default: 1)")
    p.add_argument("--out-dir", default="/tmp/bert_ddp_bench/vs_trainer", help="run folders and results.json")
    p.add_argument("--worker", choices=["trainer"], help=argparse.SUPPRESS)  # internal: one Trainer run
    p.add_argument("--model-size", default="tiny", help=argparse.SUPPRESS)
    p.add_argument("--tokenizer", default=None, help=argparse.SUPPRESS)
    return p.parse_args()


def tokenizer_dir(vocab):
    """A tokenizer folder whose len() is exactly `vocab` (trained on builtin; padded if the corpus is short)."""
    import data_stream
    files = data_stream.resolve_corpus("builtin")
    tok = data_stream.get_tokenizer(None, files, vocab)
    if len(tok) == vocab:
        return tok.name_or_path
    out = os.path.join(data_stream.CACHE_DIR, "bench", f"wordpiece-padded-{vocab}-{os.path.basename(tok.name_or_path)}")
    if not os.path.isdir(out):
        from tokenizers import Tokenizer
        from transformers import PreTrainedTokenizerFast
        spec = json.loads(tok.backend_tokenizer.to_str())
        words = spec["model"]["vocab"]
        # "[unusedN]" never forms one pre-token (BertPreTokenizer splits at "["), so nothing changes but the size
        for i in range(vocab - len(words)):
            words[f"[unused{i}]"] = len(words)
        padded = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(spec)), unk_token="[UNK]",
                                         pad_token="[PAD]", cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]")
        padded.save_pretrained(out + ".tmp")
        os.replace(out + ".tmp", out)
    assert len(data_stream.get_tokenizer(out)) == vocab
    return out


# ----------------------------------------------------------------------------- ours

def run_ours(args, size, tok_dir, run_dir, env):
    total = args.warmup + args.steps
    cmd = [sys.executable, os.path.join(ROOT, "pretrain_ddp.py"), "--objective", "mlm", "--model-size", size,
           "--tokenizer", tok_dir, "--batch-size", str(args.batch_size), "--max-seq-len", str(args.max_seq_len),
           "--max-steps", str(total), "--log-every", "1", "--log-to", "stdout", "--eval-corpus", "none",
           "--save-every", "1000000", "--num-workers", str(args.num_workers), "--out-dir", run_dir,
           "--resume", "none", "--overwrite"]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT)
    if out.returncode:
        sys.exit(f"pretrain_ddp.py failed:\n{out.stderr[-3000:]}")
    # step k: ..., train/tokens_per_sec X, train/samples_per_sec Y, ...  (each line is one step: --log-every 1)
    seconds = tokens = 0.0
    for m in re.finditer(r"^step (\d+): .*train/tokens_per_sec ([\d.e+]+), train/samples_per_sec ([\d.e+]+)",
                         out.stdout, re.M):
        step, tps, sps = int(m[1]), float(m[2]), float(m[3])
        if step > args.warmup:
            seconds += args.batch_size / sps  # full batches: packed mlm blocks, one epoch not yet over
            tokens += args.batch_size * tps / sps
    return tokens / seconds


# ----------------------------------------------------------------------------- Trainer (run_mlm recipe)

def trainer_worker(args):
    import torch
    from transformers import DataCollatorForLanguageModeling, Trainer, TrainerCallback, TrainingArguments

    import data_stream
    import pretrain_ddp
    tok = data_stream.get_tokenizer(args.tokenizer)
    with open(data_stream.resolve_corpus("builtin")[0], encoding="utf-8") as f:
        lines = [ln.strip() for ln in f if ln.strip()]
    # run_mlm.py, line_by_line=False: tokenize every line (with special tokens), concatenate, cut into blocks
    ids = [t for e in tok(lines, return_special_tokens_mask=False)["input_ids"] for t in e]
    n = args.max_seq_len
    blocks = [{"input_ids": ids[i:i + n], "token_type_ids": [0] * n, "attention_mask": [1] * n}
              for i in range(0, len(ids) // n * n, n)]
    architecture = pretrain_ddp.new_architecture(args.model_size, len(tok), args.max_seq_len, tok.pad_token_id)
    model = pretrain_ddp.model_from(architecture, "mlm", 0.1)
    collator = DataCollatorForLanguageModeling(tok, mlm=True, mlm_probability=0.15)
    counted = []

    def collate(examples):  # counts the non-pad tokens each step trains on
        batch = collator(examples)
        counted.append(int(batch["attention_mask"].sum()))
        return batch

    marks = []

    class Timer(TrainerCallback):
        def on_step_end(self, targs, state, control, **kw):
            marks.append(time.perf_counter())

    total = args.warmup + args.steps
    targs = TrainingArguments(
        output_dir=os.path.join(args.out_dir, "trainer_tmp"), per_device_train_batch_size=args.batch_size,
        max_steps=total, learning_rate=1e-3, weight_decay=0.01, adam_beta1=0.9, adam_beta2=0.98, adam_epsilon=1e-6,
        warmup_steps=max(1, round(0.06 * total)), lr_scheduler_type="linear", max_grad_norm=1.0,
        optim="adamw_torch_fused", use_cpu=True, dataloader_num_workers=0, logging_strategy="no", save_strategy="no",
        report_to="none", disable_tqdm=True, seed=0)
    trainer = Trainer(model=model, args=targs, train_dataset=blocks, data_collator=collate, callbacks=[Timer()])
    trainer.train()
    assert len(marks) == total, (len(marks), total)
    seconds = marks[-1] - marks[args.warmup - 1]
    print(json.dumps({"tokens_per_sec": sum(counted[args.warmup:total]) / seconds,
                      "threads": torch.get_num_threads(), "blocks": len(blocks)}))


def run_trainer(args, size, tok_dir, env):
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "trainer", "--model-size", size, "--tokenizer",
           tok_dir, "--steps", str(args.steps), "--warmup", str(args.warmup), "--batch-size", str(args.batch_size),
           "--max-seq-len", str(args.max_seq_len), "--out-dir", args.out_dir]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT)
    if out.returncode:
        sys.exit(f"Trainer run failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])["tokens_per_sec"]


# ----------------------------------------------------------------------------- main

def spread(values):
    return f"{statistics.median(values):,.0f} [{min(values):,.0f}-{max(values):,.0f}]"


def main():
    args = parse_args()
    if args.worker == "trainer":
        return trainer_worker(args)
    assert args.warmup >= 1 and args.steps >= 1
    os.makedirs(args.out_dir, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "TOKENIZERS_PARALLELISM": "false"}
    print(f"batch {args.batch_size} x seq {args.max_seq_len}, fp32, {args.threads} threads, {args.warmup} warmup + "
          f"{args.steps} timed steps per run, {args.repeats} alternating repeats; "
          f"ours --num-workers {args.num_workers}")
    rows, results = [], []
    for size in args.sizes.split(","):
        for vocab in map(int, args.vocabs.split(",")):
            tok_dir = tokenizer_dir(vocab)
            ours, theirs = [], []
            for r in range(args.repeats):
                ours.append(run_ours(args, size, tok_dir, os.path.join(args.out_dir, f"ours-{size}-{vocab}"), env))
                theirs.append(run_trainer(args, size, tok_dir, env))
                print(f"  {size} vocab {vocab} repeat {r}: ours {ours[-1]:,.0f} tok/s, Trainer {theirs[-1]:,.0f} "
                      f"tok/s, ratio {ours[-1] / theirs[-1]:.2f}", flush=True)
            ratios = [a / b for a, b in zip(ours, theirs, strict=True)]
            results.append({"size": size, "vocab": vocab, "ours": ours, "trainer": theirs, "ratios": ratios})
            rows.append(f"| {size} | {vocab} | {spread(ours)} | {spread(theirs)} | {statistics.median(ratios):.2f} "
                        f"[{min(ratios):.2f}-{max(ratios):.2f}] |")
    with open(os.path.join(args.out_dir, "results.json"), "w") as f:
        json.dump({"args": vars(args), "results": results}, f, indent=1)
    print("\n| size | vocab | ours tok/s median [min-max] | Trainer tok/s median [min-max] | ratio median [min-max] |")
    print("| --- | --- | --- | --- | --- |")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
