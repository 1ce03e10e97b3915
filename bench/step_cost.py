"""
What a step of another objective or block costs against BERT's mlm step of the same size, in one process on the
same batches, in turns: ELECTRA (issue 50: at most 1.35x; BENCHMARKS.md section 24) or ModernBERT's block
(issue 51: tokens/s at least 0.85x BERT's; section 26).

    python bench/step_cost.py                             # electra: tiny and mini, 32 x 128, one thread
    python bench/step_cost.py --versus modernbert --sizes mini --max-seq-len 512 --batch-size 8
    python bench/step_cost.py --sizes tiny --rounds 2 --steps 2    # a smoke run

Each arm is pretrain_ddp.train_step (forward, backward, clipping, fused AdamW) on the stream's packed mlm batches
of the builtin corpus (15% masked): `mlm` the BertForMaskedLM; `electra` the ElectraPair whose discriminator has
mlm's shape (its generator --generator-size of the width), or `modernbert` the ModernBertForMaskedLM of the same
size (--arch modernbert). The arms take turns, --steps each a round, the order alternating; the ratio is the
median over the rounds of the other arm's step time over mlm's (noisy machines: a round sees one machine),
tokens/s the medians' too.
"""
import argparse
import contextlib
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
from profile_step import builtin_batches  # noqa: E402

import model as M  # noqa: E402
import pretrain_ddp as P  # noqa: E402


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[1].strip().split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--versus", default="electra", choices=["electra", "modernbert"], help="the arm against mlm")
    p.add_argument("--sizes", default="tiny,mini", help="model sizes, comma-separated")
    p.add_argument("--dropout", type=float, default=0.0, help="both arms' (the hour's recipe: 0)")
    p.add_argument("--generator-size", type=float, default=M.GENERATOR_SIZE)
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--max-seq-len", type=int, default=128)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=7, help="turns of each arm")
    p.add_argument("--steps", type=int, default=6, help="timed steps of an arm in a round (after one untimed)")
    return p.parse_args()


def main():
    args = parse_args()
    torch.set_num_threads(args.threads)
    tokenizer, batches = builtin_batches(args.vocab_size, args.max_seq_len, args.batch_size, args.steps + 1)
    tokens = sum(counts["num_tokens"] for _, counts in batches[1:])
    other = args.versus
    generator = f"generator {args.generator_size} of the width; " if other == "electra" else ""
    print(f"batch {args.batch_size} x {args.max_seq_len}, vocab {len(tokenizer)}, {args.threads} thread(s), dropout "
          f"{args.dropout}, {generator}{args.rounds} rounds of {args.steps} steps an arm\n")
    print(f"| size | mlm step (ms) | {other} step (ms) | mlm tokens/s | {other} tokens/s | {other} / mlm (step time) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for size in args.sizes.split(","):
        arms = {}
        for name in ("mlm", other):
            torch.manual_seed(0)
            architecture = M.new_architecture(size, len(tokenizer), args.max_seq_len, tokenizer.pad_token_id,
                                              args.generator_size if name == "electra" else None,
                                              "modernbert" if name == "modernbert" else "bert")
            objective = "electra" if name == "electra" else "mlm"
            net = M.Pretraining(M.model_from(architecture, objective, args.dropout))
            trainer = P.Trainer(net, net, M.new_optimizer(net, 1e-4, 0.01), torch.amp.GradScaler("cpu", enabled=False),
                                contextlib.nullcontext())
            arms[name] = (trainer, objective)
        times = {name: [] for name in arms}
        for r in range(args.rounds):
            for name in (("mlm", other) if r % 2 == 0 else (other, "mlm")):
                trainer, objective = arms[name]

                def step(batch, counts, trainer=trainer, objective=objective):
                    totals = [counts["num_masked"], counts["num_samples"], counts["num_tokens"]]
                    P.train_step(trainer, [batch], P.loss_divisors(objective, totals), 1, 1.0, 1e-4)
                step(*batches[0])  # untimed: the other arm ran last
                t0 = time.perf_counter()
                for batch, counts in batches[1:]:
                    step(batch, counts)
                times[name].append((time.perf_counter() - t0) / args.steps)
        ratio = statistics.median(e / m for e, m in zip(times[other], times["mlm"], strict=True))
        mlm_s, other_s = statistics.median(times["mlm"]), statistics.median(times[other])
        print(f"| {size} | {mlm_s * 1000:.0f} | {other_s * 1000:.0f} | {tokens / args.steps / mlm_s:,.0f} | "
              f"{tokens / args.steps / other_s:,.0f} | **{ratio:.2f}x** |", flush=True)


if __name__ == "__main__":
    main()
