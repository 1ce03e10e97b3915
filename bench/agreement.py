"""What "rank 0 decides, every rank verifies" costs at start-up, on 2 gloo ranks (BENCHMARKS.md section 9).

    torchrun --standalone --nproc_per_node 2 bench/agreement.py --model-size small   # and --model-size mini
    torchrun --standalone --nproc_per_node 2 bench/agreement.py --model-size tiny --repeats 1   # a smoke run

- join_group: torchrun's store -> the nonce handshake -> init_process_group (once).
- a resumed checkpoint (weights + AdamW state) sent by rank 0 over the process group
  (from_rank0, what pretrain_ddp.py does) vs every rank reading it from a (shared) disk, alternated.
- the weights checksum that every rank compares after loading.
"""
import argparse
import os
import sys
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import model as M  # noqa: E402
import pretrain_ddp as P  # noqa: E402

p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
p.add_argument("--model-size", default="small", choices=M.MODEL_SIZES)
p.add_argument("--repeats", type=int, default=3)
args = p.parse_args()

t0 = time.perf_counter()
P.join_group(torch.device("cpu"), timedelta(minutes=5), -1)
join_s = time.perf_counter() - t0
rank = P.GROUP.rank

torch.manual_seed(0)
model = M.Pretraining(M.model_from(M.new_architecture(args.model_size, 30522, 128, 0), "nsp", 0.1))
optimizer = torch.optim.AdamW(model.parameters(), fused=True)
for p_ in model.parameters():
    p_.grad = torch.zeros_like(p_)
optimizer.step()  # creates the AdamW state: 2 more tensors per parameter
state = {"model": model.hf.state_dict(), "optimizer": optimizer.state_dict()}
path = os.path.join(tempfile.gettempdir(), f"bench_agreement_{args.model_size}.pt")
if rank == 0:
    torch.save(state, path)
dist.barrier()
size_mb = os.path.getsize(path) / 1e6

disk, wire = [], []
for _ in range(args.repeats):
    dist.barrier()
    t0 = time.perf_counter()
    torch.load(path, map_location="cpu", weights_only=True)
    dist.barrier()
    disk.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    got = P.from_rank0(torch.load(path, map_location="cpu", weights_only=True) if rank == 0 else None)
    dist.barrier()
    wire.append(time.perf_counter() - t0)
t0 = time.perf_counter()
P.weights_checksum(model.state_dict())
checksum_s = time.perf_counter() - t0
if rank == 0:
    n_params = sum(p_.numel() for p_ in model.parameters())
    print(f"BERT-{args.model_size} (vocab 30522, {n_params / 1e6:.1f}M parameters), checkpoint {size_mb:.0f} MB")
    print(f"join_group (handshake + init_process_group): {join_s:.3f} s")
    print(f"every rank loads from disk: {min(disk):.2f} s (best of {args.repeats}); rank 0 loads and sends: "
          f"{min(wire):.2f} s; ratio {min(wire) / min(disk):.2f}")
    print(f"weights checksum: {checksum_s:.3f} s")
    os.remove(path)
dist.destroy_process_group()
