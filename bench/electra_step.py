"""
What an ELECTRA step costs against an mlm step of the same model (issue 50: at most 1.35x), in one process on the
same batches, in turns (BENCHMARKS.md section 24).

    python bench/electra_step.py                          # tiny and mini, 32 x 128, one thread
    python bench/electra_step.py --sizes tiny --rounds 2 --steps 2    # a smoke run

Each arm is pretrain_ddp.train_step (forward, backward, clipping, fused AdamW) on the stream's packed mlm batches
of the builtin corpus (15% masked): `mlm` the BertForMaskedLM, `electra` the ElectraPair whose discriminator has
mlm's shape (its generator --generator-size of the width). The arms take turns, --steps each a round, the order
alternating; the ratio is the median over the rounds of electra's step time over mlm's (noisy machines: a round
sees one machine), tokens/s the medians' too.
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
    p.add_argument("--sizes", default="tiny,mini", help="model sizes, comma-separated")
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
    print(f"batch {args.batch_size} x {args.max_seq_len}, vocab {len(tokenizer)}, {args.threads} thread(s), "
          f"generator {args.generator_size} of the width; {args.rounds} rounds of {args.steps} steps an arm\n")
    print("| size | mlm step (ms) | electra step (ms) | mlm tokens/s | electra tokens/s | electra / mlm (step time) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for size in args.sizes.split(","):
        arms = {}
        for objective in ("mlm", "electra"):
            torch.manual_seed(0)
            architecture = M.new_architecture(size, len(tokenizer), args.max_seq_len, tokenizer.pad_token_id,
                                              args.generator_size if objective == "electra" else None)
            net = M.Pretraining(M.model_from(architecture, objective, 0.0))
            trainer = P.Trainer(net, net, M.new_optimizer(net, 1e-4, 0.01), torch.amp.GradScaler("cpu", enabled=False),
                                contextlib.nullcontext())
            arms[objective] = (trainer, objective)
        times = {objective: [] for objective in arms}
        for r in range(args.rounds):
            for objective in (("mlm", "electra") if r % 2 == 0 else ("electra", "mlm")):
                trainer, _ = arms[objective]

                def step(batch, counts, trainer=trainer, objective=objective):
                    totals = [counts["num_masked"], counts["num_samples"], counts["num_tokens"]]
                    P.train_step(trainer, [batch], P.loss_divisors(objective, totals), 1, 1.0, 1e-4)
                step(*batches[0])  # untimed: the other arm ran last
                t0 = time.perf_counter()
                for batch, counts in batches[1:]:
                    step(batch, counts)
                times[objective].append((time.perf_counter() - t0) / args.steps)
        ratio = statistics.median(e / m for e, m in zip(times["electra"], times["mlm"], strict=True))
        mlm_s, electra_s = statistics.median(times["mlm"]), statistics.median(times["electra"])
        print(f"| {size} | {mlm_s * 1000:.0f} | {electra_s * 1000:.0f} | {tokens / args.steps / mlm_s:,.0f} | "
              f"{tokens / args.steps / electra_s:,.0f} | **{ratio:.2f}x** |", flush=True)


if __name__ == "__main__":
    main()
