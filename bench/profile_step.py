"""
Where a training step's CPU time goes, by kind of operator, and how close it runs to the hardware (BENCHMARKS.md
section 12).

    python bench/profile_step.py                        # BERT-mini mlm, vocab 8192, 32 x 128, 2 threads
    python bench/profile_step.py --model-size tiny --threads 1 --steps 2 --profile-steps 1   # a smoke run

One pretrain_ddp.train_step (forward, backward, clipping, fused AdamW) on packed mlm batches built
by the stream (15% masked, no padding: the model gets no attention mask), timed over --steps after
--warmup, then one more --profile-steps under torch.profiler. Each profiled CPU operator is put in
one kind (attention, softmax, GELU, LayerNorm, dropout, linear layers, embedding backward, the MLM
loss, optimizer, other) by its name; self time, so nothing is counted twice. Throughput: the step's
FLOPs (pretrain_ddp.train_flops, the MFU count) per second against the best of a few 2048^3 fp32
matmuls on the same threads (pretrain_ddp.peak_flops).
"""

import argparse
import collections
import contextlib
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
import data_stream  # noqa: E402
import model as M  # noqa: E402
import pretrain_ddp as P  # noqa: E402

# The first matching substring names an operator's kind (aten names, forward and backward).
KINDS = [("attention", ("scaled_dot_product", "flash_attention", "_efficient_attention", "bmm", "baddbmm")),
         ("softmax", ("softmax",)), ("GELU", ("gelu",)), ("LayerNorm", ("layer_norm",)),
         ("dropout", ("dropout", "bernoulli", "native_dropout")),
         ("embedding backward", ("embedding_dense_backward", "embedding_backward", "index_add", "index_put")),
         ("MLM loss", ("cross_entropy", "nll_loss", "log_softmax")),
         ("optimizer", ("adam", "_foreach", "clip_grad", "norm")),
         ("linear layers", ("addmm", "aten::mm", "aten::linear", "matmul")),
         ("copies, views, elementwise", ("copy_", "add", "mul", "clone", "contiguous", "view", "reshape",
                                         "transpose", "permute", "cat", "fill_", "zero_", "to", "empty"))]


def kind_of(name):
    for kind, keys in KINDS:
        if any(k in name for k in keys):
            return kind
    return "other"


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[1].strip().split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model-size", default="mini", choices=M.MODEL_SIZES)
    p.add_argument("--vocab-size", type=int, default=8192)
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--max-seq-len", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    p.add_argument("--steps", type=int, default=10, help="timed steps")
    p.add_argument("--profile-steps", type=int, default=3, help="steps under torch.profiler (after the timed ones)")
    p.add_argument("--dropout", type=float, default=0.1)
    p.add_argument("--arch", default="bert", choices=["bert", "modernbert"], help="pretrain_ddp.py --arch")
    return p.parse_args()


def builtin_batches(vocab_size, max_seq_len, batch_size, count):
    """(tokenizer, the first `count` packed mlm batches of builtin as the trainer's step reads them, with counts)."""
    tokenizer = data_stream.get_tokenizer(None, data_stream.open_corpus("builtin", "train", "mlm"), vocab_size)
    settings = data_stream.StreamSettings(max_seq_len=max_seq_len, batch_size=batch_size, objective="mlm")
    stream = data_stream.BertPretrainStream("builtin", tokenizer, settings, rank=0, world_size=1)
    batches = []
    for raw in stream:
        raw.pop("cursor")
        batches.append(M.prepare(M.sparse_targets(raw), torch.device("cpu")))
        if len(batches) == count:
            break
    return tokenizer, batches


def main():
    args = parse_args()
    torch.set_num_threads(args.threads)
    tokenizer, batches = builtin_batches(args.vocab_size, args.max_seq_len, args.batch_size,
                                         args.warmup + args.steps + args.profile_steps)
    cpu = torch.device("cpu")
    torch.manual_seed(0)
    architecture = M.new_architecture(args.model_size, args.vocab_size, args.max_seq_len, tokenizer.pad_token_id,
                                      arch=args.arch)
    model = M.Pretraining(M.model_from(architecture, "mlm", args.dropout))
    trainer = P.Trainer(model, model, M.new_optimizer(model, 1e-4, 0.01), torch.amp.GradScaler("cpu", enabled=False),
                        contextlib.nullcontext())

    def step(batch, counts):
        P.train_step(trainer, [batch], (max(counts["num_masked"], 1), counts["num_samples"]), 1, 1.0, 1e-4)

    for batch, counts in batches[:args.warmup]:
        step(batch, counts)
    timed = batches[args.warmup:args.warmup + args.steps]
    flops = sum(M.train_flops(model.hf, counts) for _, counts in timed)
    t0 = time.perf_counter()
    for batch, counts in timed:
        step(batch, counts)
    seconds = time.perf_counter() - t0
    peak = P.peak_flops(cpu, None)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        for batch, counts in batches[args.warmup + args.steps:]:
            step(batch, counts)
    by_kind, by_op = collections.Counter(), collections.Counter()
    for event in prof.key_averages():
        by_kind[kind_of(event.key)] += event.self_cpu_time_total
        by_op[event.key] += event.self_cpu_time_total
    total = sum(by_kind.values())
    n_params = sum(p.numel() for p in model.parameters())
    print(f"{M.family_name(architecture)}-{args.model_size} mlm ({n_params / 1e6:.1f}M parameters, vocab "
          f"{args.vocab_size}), batch {args.batch_size} x {args.max_seq_len}, {args.threads} threads, dropout "
          f"{args.dropout}")
    print(f"step {seconds / args.steps * 1000:.0f} ms, {flops / seconds / 1e9:.1f} GFLOP/s of a measured fp32 matmul "
          f"peak {peak / 1e9:.1f} GFLOP/s: {flops / seconds / peak:.1%} of peak "
          f"({args.batch_size * args.max_seq_len * args.steps / seconds:,.0f} tokens/s)")
    print("\n| kind | share of CPU self time |\n|---|---|")
    for kind, us in by_kind.most_common():
        print(f"| {kind} | {us / total:.1%} |")
    print("\ntop operators:")
    for op, us in by_op.most_common(12):
        print(f"  {us / total:6.1%}  {op}")


if __name__ == "__main__":
    main()
