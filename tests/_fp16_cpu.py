"""pretrain_ddp.py with fp16 autocast and a GradScaler on the CPU (for users fp16 is CUDA's: a CPU
takes bf16 or fp32). Usage: python tests/_fp16_cpu.py INIT_SCALE [pretrain_ddp.py flags]; a large
INIT_SCALE makes the first steps overflow, as fp16 training does at its start."""
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import pretrain_ddp as P  # noqa: E402

if __name__ == "__main__":  # DataLoader workers start from a forkserver, which runs this file again
    init_scale, GradScaler = float(sys.argv[1]), torch.amp.GradScaler
    P.choose_amp_dtype = lambda args, device: torch.float16
    torch.amp.GradScaler = lambda device, enabled: GradScaler(device, init_scale=init_scale, enabled=enabled)
    P.main(sys.argv[2:])
