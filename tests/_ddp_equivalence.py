"""Run under torchrun: N ranks x A micro-batches must give the same weights as 1 process with
one batch of N*A*B (the loss normalisation and no_sync() of pretrain_ddp.train_step), without
clipping (any constant scale of the gradient shows) and with it (clipping on the global norm)."""
import contextlib
import copy
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import model as M  # noqa: E402
import pretrain_ddp as P  # noqa: E402

ACCUM, BATCH, WIDTH, VOCAB, STEPS = int(sys.argv[1]), 3, 24, 120, 3


def global_batches(step, count):
    """count micro-batches of the whole step, each with a different share of masked tokens."""
    g = torch.Generator().manual_seed(step)
    out = []
    for i in range(count):
        ids = torch.randint(5, VOCAB, (BATCH, WIDTH), generator=g)
        lengths = torch.randint(WIDTH // 2, WIDTH + 1, (BATCH,), generator=g)
        attention = (torch.arange(WIDTH)[None] < lengths[:, None]).long()
        ids = ids * attention
        chosen = (torch.rand(BATCH, WIDTH, generator=g) < 0.05 + 0.1 * i) & attention.bool()
        labels = torch.where(chosen, ids, -100)
        out.append({"input_ids": ids, "token_type_ids": (torch.arange(WIDTH)[None] > lengths[:, None] // 2).long(),
                    "attention_mask": attention, "labels": labels,
                    "next_sentence_label": torch.randint(0, 2, (BATCH,), generator=g)})
    return out


def run(model, world_size, windows_of_step, clip):
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    scaler = torch.amp.GradScaler("cpu", enabled=False)
    for step in range(STEPS):
        everything = global_batches(step, ACCUM * dist.get_world_size())
        g_masked = sum(int((b["labels"] != -100).sum()) for b in everything)
        g_samples = sum(len(b["input_ids"]) for b in everything)
        window = [M.prepare(M.sparse_targets(dict(b)), torch.device("cpu"))[0] for b in windows_of_step(everything)]
        trainer = P.Trainer(model, model, opt, scaler, contextlib.nullcontext())
        P.train_step(trainer, window, (g_masked, g_samples), world_size, clip=clip, lr=0.5)


dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
for clip in (0.0, 0.5):
    torch.manual_seed(0)
    model = M.Pretraining(M.model_from(M.new_architecture("tiny", VOCAB, WIDTH, 0), "nsp", 0.0))
    reference, initial = copy.deepcopy(model), copy.deepcopy(model)
    ddp = P.wrap_ddp(model, torch.device("cpu"))  # the trainer's DDP settings
    run(ddp, world, lambda everything: everything[rank * ACCUM:(rank + 1) * ACCUM], clip)
    if rank == 0:
        def one_batch(everything):
            return [{k: torch.cat([b[k] for b in everything]) for k in everything[0]}]
        run(reference, 1, one_batch, clip)
        diff = max((a - b).abs().max().item() for a, b in zip(model.parameters(), reference.parameters(), strict=True))
        moved = max((a - b).abs().max().item() for a, b in zip(model.parameters(), initial.parameters(), strict=True))
        print(f"RESULT clip={clip} max_diff={diff:.3e} moved={moved:.3e}", flush=True)
dist.destroy_process_group()
