"""
Speed (BENCHMARKS.md section 1): pretrain_ddp.py's training loop vs transformers.Trainer on run_mlm's recipe,
tokens/s.

    python bench/vs_trainer.py                              # tiny + mini, vocab 30522 and 8192, 3 repeats
    python bench/vs_trainer.py --sizes small --repeats 2 --steps 6
    python bench/vs_trainer.py --sizes tiny --vocabs 8192 --repeats 1 --steps 5 --threads 1   # a smoke run
    python bench/vs_trainer.py --arch modernbert --sizes mini --vocabs 8192      # issue 51: + our BERT beside it

Ours: `pretrain_ddp.py --objective mlm` in a subprocess (its real loop: DataLoader worker, prepare, train_step,
the MLM head on masked rows only), its steady tokens/s from summary.json (after pretrain_ddp.STEADY_AFTER steps).
The Trainer: bench/common.py's worker (run_mlm's blocks, DataCollatorForLanguageModeling, the same model, AdamW
and LR plan), timed by a TrainerCallback over the same steps. Each run is STEADY_AFTER + --steps steps; both count
non-pad tokens, use the same OpenMP threads and dropout 0.1. The sides alternate, one fresh process each,
--repeats times; the ratio is taken per repeat. --arch modernbert: both sides train ModernBERT (the Trainer
transformers' ModernBertForMaskedLM, sdpa, padded rows, the band a dense mask), and a third side, our BERT mlm of
the same size, gives ModernBERT's tokens/s against BERT's, in the same turns.
For vocab 30522 the builtin WordPiece (~11.7k pieces) is padded
with never-matching [unusedN] entries: the model has the full 30522-row embedding and output layer.
"""
import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import common  # noqa: E402

from pretrain_ddp import STEADY_AFTER  # noqa: E402  the steps its steady rates leave out


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.strip().split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--sizes", default="tiny,mini", help="comma list of model.MODEL_SIZES")
    p.add_argument("--vocabs", default="30522,8192", help="comma list of model vocabulary sizes")
    p.add_argument("--repeats", type=int, default=3, help="alternating A/B pairs per configuration")
    p.add_argument("--steps", type=int, default=8, help=f"timed optimizer steps per run (after {STEADY_AFTER})")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--max-seq-len", type=int, default=128)
    p.add_argument("--arch", default="bert", choices=["bert", "modernbert"], help="pretrain_ddp.py --arch")
    p.add_argument("--mask-prob", type=float, default=0.15, help="the masking rate of both sides")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="OpenMP threads on both sides")
    p.add_argument("--num-workers", type=int, default=1, help="pretrain_ddp.py --num-workers (its default: 1)")
    p.add_argument("--out-dir", default="/tmp/bert_ddp_bench/vs_trainer", help="run folders and results.json")
    return p.parse_args()


def main():
    args = parse_args()
    assert args.steps >= STEADY_AFTER, f"--steps {args.steps}: at least {STEADY_AFTER} (the steady rates' rule)"
    os.makedirs(args.out_dir, exist_ok=True)
    total = STEADY_AFTER + args.steps
    print(f"batch {args.batch_size} x seq {args.max_seq_len}, fp32, {args.threads} threads, {STEADY_AFTER} untimed + "
          f"{args.steps} timed steps per run, {args.repeats} alternating repeats; ours --num-workers "
          f"{args.num_workers}", flush=True)
    rows, results = [], []
    for size in args.sizes.split(","):
        for vocab in map(int, args.vocabs.split(",")):
            tok_dir = common.padded_tokenizer(vocab)
            spec = {"tokenizer": tok_dir, "size": size, "seed": 0, "batch_size": args.batch_size,
                    "max_seq_len": args.max_seq_len, "lr": 1e-3, "warmup": 0.06, "weight_decay": 0.01,
                    "dropout": 0.1, "steps": total, "timed_after": STEADY_AFTER, "arch": args.arch,
                    "mask_prob": args.mask_prob}
            ours, theirs, bert = [], [], []
            sides = ["ours", "trainer"] + (["bert"] if args.arch == "modernbert" else [])
            for r in range(args.repeats):
                for side in sides if r % 2 == 0 else sides[::-1]:
                    run_dir = os.path.join(args.out_dir, f"{side}-{args.arch}-{size}-{vocab}")
                    if side in ("ours", "bert"):
                        flags = ["--objective", "mlm", "--model-size", size, "--tokenizer", tok_dir, "--batch-size",
                                 str(args.batch_size), "--max-seq-len", str(args.max_seq_len), "--max-steps",
                                 str(total), "--num-workers", str(args.num_workers), "--log-every", str(total),
                                 "--mask-prob", str(args.mask_prob), "--arch", args.arch if side == "ours" else "bert"]
                        rate = common.pretrain(flags, run_dir, threads=args.threads).summary["tokens_per_sec"]
                        (ours if side == "ours" else bert).append(rate)
                    else:
                        env = common.environment(args.threads)
                        theirs.append(common.trainer_run(spec, run_dir, env)["tokens_per_sec"])
                versus_bert = f", our BERT {bert[-1]:,.0f} tok/s ({ours[-1] / bert[-1]:.2f}x)" if bert else ""
                print(f"  {size} vocab {vocab} repeat {r}: ours {ours[-1]:,.0f} tok/s, Trainer {theirs[-1]:,.0f} "
                      f"tok/s, ratio {ours[-1] / theirs[-1]:.2f}{versus_bert}", flush=True)
            ratios = [a / b for a, b in zip(ours, theirs, strict=True)]
            to_bert = [a / b for a, b in zip(ours, bert, strict=True)]
            results.append({"size": size, "vocab": vocab, "arch": args.arch, "ours": ours, "trainer": theirs,
                            "ratios": ratios, "our_bert": bert, "to_our_bert": to_bert})
            rows.append(f"| {args.arch} | {size} | {vocab} | {common.spread(ours)} | {common.spread(theirs)} | "
                        f"**{common.spread(ratios, '{:.2f}')}** |"
                        + (f" {common.spread(bert)} | **{common.spread(to_bert, '{:.2f}')}** |" if bert else ""))
    with open(os.path.join(args.out_dir, "results.json"), "w") as f:
        json.dump({"args": vars(args), "results": results}, f, indent=1)
    more = " our BERT tok/s | ours / our BERT |" if args.arch == "modernbert" else ""
    print("\n| arch | size | vocab | ours tok/s median [min-max] | Trainer tok/s median [min-max] | "
          f"ratio median [min-max] |{more}")
    print("| --- " * (6 + 2 * bool(more)) + "|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
