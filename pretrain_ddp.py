"""
Pretrain a BERT from scratch with DistributedDataParallel, on one CPU, one GPU or many.

    python pretrain_ddp.py                                   # tiny BERT on the builtin corpus
    torchrun --nproc_per_node 4 pretrain_ddp.py --amp        # 4 GPUs (or 4 CPU processes)
    torchrun --nnodes 2 --node_rank 0 --nproc_per_node 8 \\
        --rdzv-backend c10d --rdzv-endpoint host0:29500 pretrain_ddp.py --amp   # two nodes
    tensorboard --logdir runs

One loop, top to bottom: config, distributed set-up, data, model, optimizer, train, report.
The choices that matter for speed and robustness are commented where they are made.
"""

import argparse
import contextlib
import hashlib
import json
import math
import os
import pickle
import random
import shutil
import signal
import sys
import time

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader

import data_stream

# BERT sizes of Turc et al. 2019 (tiny..medium) and of the BERT paper (base, large):
# (layers, hidden, attention heads); the feed-forward width is 4 x hidden.
MODEL_SIZES = {"tiny": (2, 128, 2), "mini": (4, 256, 4), "small": (4, 512, 8),
               "medium": (8, 512, 8), "base": (12, 768, 12), "large": (24, 1024, 16)}
EVAL_SEED = 12345  # the eval set is masked the same way in every run, so numbers compare


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].strip(),
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    data_stream.add_data_args(p)
    p.add_argument("--eval-corpus", default=None,
                   help="held-out corpus for evaluation; default: builtin's held-out split for --corpus builtin, "
                        "else none; 'none' turns eval off")
    p.add_argument("--out-dir", default=None, help="where logs and summary.json go; default runs/<date-time>")
    p.add_argument("--model-size", default="tiny", choices=MODEL_SIZES, help="BERT size (Turc et al. 2019 / BERT)")
    p.add_argument("--dropout", type=float, default=0.1, help="hidden and attention dropout")
    p.add_argument("--batch-size", type=int, default=32, help="micro-batch per rank")
    p.add_argument("--accum-steps", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--epochs", type=int, default=3, help="passes over the corpus, reshuffled each time")
    p.add_argument("--max-steps", type=int, default=None,
                   help="stop after this many optimizer steps; default: the whole --epochs (estimated)")
    p.add_argument("--lr", type=float, default=1e-3, help="peak learning rate")
    p.add_argument("--warmup", type=float, default=0.06, help="fraction of the planned steps with linear warmup")
    p.add_argument("--weight-decay", type=float, default=0.01, help="AdamW decay (not on biases and LayerNorm)")
    p.add_argument("--clip", type=float, default=1.0, help="gradient norm clipping; 0 turns it off")
    p.add_argument("--amp", action="store_true", help="mixed precision: bf16 where supported, else fp16 + GradScaler")
    p.add_argument("--amp-dtype", default="auto", choices=["auto", "bf16", "fp16"],
                   help="with --amp: force a dtype. auto on a CPU: bf16 with avx512_bf16/AMX, else fp32 "
                        "(bf16 without them is ~28x slower)")
    p.add_argument("--num-workers", type=int, default=1, help="DataLoader worker processes per rank")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the model (pays on GPUs; on CPUs it measured no gain for a long compile)")
    p.add_argument("--eval-every", type=int, default=200, help="evaluate every N optimizer steps (and at the end)")
    p.add_argument("--log-every", type=int, default=20, help="log training scalars every N optimizer steps")
    p.add_argument("--log-to", default="stdout,tensorboard", help="comma list of stdout, tensorboard, mlflow")
    p.add_argument("--save-every", type=int, default=500,
                   help="checkpoint every N optimizer steps (also at the end and on SIGTERM/SIGINT)")
    p.add_argument("--keep-last", type=int, default=3, help="complete checkpoints kept")
    p.add_argument("--resume", default="auto",
                   help="auto: continue from the newest complete checkpoint in --out-dir, if any; none: start "
                        "afresh; or a checkpoint folder")
    p.add_argument("--overwrite", action="store_true", help="with --resume none: delete the out dir's checkpoints")
    p.add_argument("--export-every", type=int, default=0,
                   help="also write the Hugging Face folder <out>/hf every N steps (it is always written at the end)")
    args = p.parse_args(argv)
    return args


def fail(message):
    """A user mistake: one line on stderr (rank 0 only, the others say it too), exit code 2."""
    if int(os.environ.get("RANK", "0")) == 0:
        print(f"pretrain_ddp.py: error: {message}", file=sys.stderr)
    sys.exit(2)


def cpu_has_native_bf16():
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def choose_amp_dtype(args, device):
    """None (fp32), torch.bfloat16 or torch.float16, with the one-line reasons for the choice."""
    if not args.amp:
        return None
    if device.type == "cuda":
        if args.amp_dtype == "fp16" or (args.amp_dtype == "auto" and not torch.cuda.is_bf16_supported()):
            return torch.float16
        return torch.bfloat16
    if args.amp_dtype == "fp16":
        fail("--amp-dtype fp16 needs a CUDA GPU; on a CPU use --amp-dtype bf16 or no --amp")
    if args.amp_dtype == "auto" and not cpu_has_native_bf16():
        # Measured here: without avx512_bf16/AMX a BERT step in bf16 autocast is ~28x slower.
        if int(os.environ.get("RANK", "0")) == 0:
            print("warning: --amp on a CPU without native bf16 would be much slower; training in fp32 "
                  "(--amp-dtype bf16 forces it)", file=sys.stderr)
        return None
    return torch.bfloat16


def validate(args):
    """Everything that can be checked before any process group exists: no rank waits on a dead one."""
    for name in ("batch_size", "accum_steps", "epochs", "eval_every", "log_every", "save_every", "keep_last"):
        if getattr(args, name) < 1:
            fail(f"--{name.replace('_', '-')} must be at least 1, not {getattr(args, name)}")
    if args.max_steps is not None and args.max_steps < 1:
        fail(f"--max-steps must be at least 1, not {args.max_steps}")
    if args.export_every < 0:
        fail(f"--export-every must be 0 (off) or more, not {args.export_every}")
    if args.resume not in ("auto", "none") and not os.path.isdir(args.resume):
        fail(f"--resume {args.resume} is not a checkpoint folder (or auto, none)")
    if args.num_workers < 0:
        fail(f"--num-workers must be 0 or more, not {args.num_workers}")
    if args.max_seq_len < (5 if args.objective == "nsp" else 3):
        fail(f"--max-seq-len {args.max_seq_len} is too small for an {args.objective} sample "
             f"(at least {5 if args.objective == 'nsp' else 3})")
    bad = set(args.log_to.split(",")) - {"stdout", "tensorboard", "mlflow"}
    if bad:
        fail(f"--log-to takes stdout, tensorboard, mlflow; not {', '.join(sorted(bad))}")
    if "mlflow" in args.log_to.split(","):
        try:
            import mlflow  # noqa: F401
        except ImportError:
            fail("--log-to mlflow needs the mlflow package: pip install mlflow (or drop mlflow from --log-to)")
    if args.out_dir and os.path.exists(args.out_dir) and not os.path.isdir(args.out_dir):
        fail(f"--out-dir {args.out_dir} is a file; give a directory")


# ----------------------------------------------------------------------------- model

class Pretraining(torch.nn.Module):
    """A Hugging Face BERT whose MLM head runs only at masked positions.

    The vocabulary projection is most of a small BERT's FLOPs and its logits tensor is huge;
    at 15% masking, gathering the masked rows first saves ~85% of both. The module tree is
    the Hugging Face model's, so `self.hf.save_pretrained` output loads anywhere unchanged.
    Returns per-batch sums: (mlm loss, mlm correct, nsp loss, nsp correct).
    """

    def __init__(self, hf_model):
        super().__init__()
        self.hf = hf_model

    def forward(self, input_ids, token_type_ids, attention_mask, masked_pos, masked_targets,
                next_sentence_label=None):
        out = self.hf.bert(input_ids=input_ids, token_type_ids=token_type_ids, attention_mask=attention_mask)
        hidden = out.last_hidden_state.flatten(0, 1).index_select(0, masked_pos)
        logits = self.hf.cls.predictions(hidden).float()
        mlm_loss = F.cross_entropy(logits, masked_targets, reduction="sum")
        mlm_correct = (logits.argmax(-1) == masked_targets).sum()
        if next_sentence_label is None:
            zero = mlm_loss.new_zeros(())
            return torch.stack([mlm_loss, mlm_correct.float(), zero, zero])
        nsp_logits = self.hf.cls.seq_relationship(out.pooler_output).float()
        nsp_loss = F.cross_entropy(nsp_logits, next_sentence_label, reduction="sum")
        nsp_correct = (nsp_logits.argmax(-1) == next_sentence_label).sum()
        return torch.stack([mlm_loss, mlm_correct.float(), nsp_loss, nsp_correct.float()])


def build_model(model_size, objective, vocab_size, max_seq_len, dropout, pad_id):
    from transformers import BertConfig, BertForMaskedLM, BertForPreTraining
    layers, hidden, heads = MODEL_SIZES[model_size]
    config = BertConfig(vocab_size=vocab_size, hidden_size=hidden, num_hidden_layers=layers,
                        num_attention_heads=heads, intermediate_size=4 * hidden,
                        max_position_embeddings=max(512, max_seq_len), hidden_dropout_prob=dropout,
                        attention_probs_dropout_prob=dropout, pad_token_id=pad_id)
    return (BertForPreTraining if objective == "nsp" else BertForMaskedLM)(config)


def train_flops(config, batch):
    """Training FLOPs of one micro-batch (forward + backward = 3x forward), counted from shapes."""
    layers, hidden, vocab = config.num_hidden_layers, config.hidden_size, config.vocab_size
    rows, width = batch["input_ids"].shape
    per_token = 2 * layers * (4 * hidden * hidden + 2 * hidden * config.intermediate_size)
    attention = 2 * layers * 2 * width * hidden  # QK^T and AV, per token
    head = 2 * (hidden * hidden + hidden * vocab) * len(batch["masked_pos"])
    return 3 * (rows * width * (per_token + attention) + head)


def peak_flops(device, amp_dtype):
    """Dense peak of the device, for MFU: a table for GPUs, a measured fp32 matmul on CPUs."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        half = {"H200": 989e12, "H100": 989e12, "A100": 312e12, "A10": 125e12, "L4": 121e12, "L40": 181e12,
                "4090": 165e12, "3090": 71e12, "V100": 125e12, "T4": 65e12}
        single = {"H200": 67e12, "H100": 67e12, "A100": 19.5e12, "V100": 15.7e12, "T4": 8.1e12}
        table = half if amp_dtype is not None else single
        return next((v for k, v in table.items() if k in name), None)
    a = torch.randn(2048, 2048, generator=torch.Generator())  # leaves the global RNG (dropout) alone
    best = float("inf")
    for _ in range(6):  # the best of a few: other processes on the machine only slow it down
        t0 = time.perf_counter()
        torch.mm(a, a)
        best = min(best, time.perf_counter() - t0)
    return 2 * 2048**3 / best


# ----------------------------------------------------------------------------- data

def prepare(batch, device):
    """Host-side work for one batch: masked positions found on the CPU (no device sync later)."""
    labels = batch.pop("labels").flatten()
    masked_pos = (labels != -100).nonzero().squeeze(1)
    batch["masked_pos"], batch["masked_targets"] = masked_pos, labels[masked_pos]
    num_tokens = int(batch["attention_mask"].sum())
    on_device = {k: v.to(device, non_blocking=True) for k, v in batch.items() if k != "cursor"}
    return on_device, len(masked_pos), num_tokens


def quiet_worker(worker_id):
    """Ctrl-C and torchrun's SIGTERM go to a whole process group: a worker leaves it, so the trainer
    decides when to stop (the DataLoader still ends its workers, and they exit if the trainer dies)."""
    os.setpgrp()


def make_loader(stream, num_workers, device):
    # Batches are built inside the workers (batch_size=None): one IPC message per batch.
    # Its own generator: a loader started mid-epoch after a resume must not shift the global RNG.
    return DataLoader(stream, batch_size=None, num_workers=num_workers, pin_memory=device.type == "cuda",
                      prefetch_factor=4 if num_workers else None, worker_init_fn=quiet_worker,
                      generator=torch.Generator())


def planned_steps(args, stream, world_size):
    """The number of optimizer steps the LR schedule plans for: --max-steps, or the estimate."""
    import estimate_steps
    est = estimate_steps.estimate(stream, world_size, args.num_workers, args.batch_size, args.accum_steps,
                                  args.epochs)
    total = est["total_steps"] if args.max_steps is None else min(args.max_steps, est["total_steps"] or 1)
    return total, est


# ----------------------------------------------------------------------------- logging

def make_logger(log_to, out_dir, config):
    """A function log(scalars, step) writing to each chosen sink, and a close() for the end."""
    sinks, closers = [], []
    if "stdout" in log_to:
        sinks.append(lambda s, step: print(f"step {step}: " + ", ".join(
            f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in s.items()), flush=True))
    if "tensorboard" in log_to:
        from torch.utils.tensorboard import SummaryWriter
        writer = SummaryWriter(out_dir)
        writer.add_text("config", json.dumps(config, indent=1))
        sinks.append(lambda s, step: [writer.add_scalar(k, v, step) for k, v in s.items()])
        closers.append(writer.close)
    if "mlflow" in log_to:
        import mlflow
        mlflow.set_tracking_uri(f"file:{os.path.abspath('mlruns')}")
        mlflow.start_run(run_name=os.path.basename(out_dir))
        mlflow.log_params({k: str(v) for k, v in config.items()})
        sinks.append(lambda s, step: mlflow.log_metrics(s, step=step))
        closers.append(mlflow.end_run)

    def log(scalars, step):
        for sink in sinks:
            sink(scalars, step)

    return log, lambda: [close() for close in closers]


# ----------------------------------------------------------------------------- checkpoints
# Layout: <out>/checkpoints/step_000400/{trainer.pt, ranks.pt, manifest.json} and <out>/checkpoints/latest.
# A checkpoint is written into a hidden temporary folder, every file fsynced, its manifest (with
# each file's sha256) last, then renamed into place: a crash at any instant leaves the previous
# complete checkpoint usable, and a damaged one is recognised by its checksums. Nothing is ever
# unpickled as code: torch.load(weights_only=True) reads tensors and plain containers only.
# Fields that a resumed run must share with the checkpoint (the rest may change):
RESUME_MUST_MATCH = ("model_size", "objective", "max_seq_len", "vocab", "corpus", "seed")


def _fsync_dir(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write(path, write):
    with open(path, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())


def _sha256(path):
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def save_checkpoint(root, step, files, meta, keep_last):
    """Write {name: object} atomically as root/step_<step>; keep the newest keep_last complete ones."""
    name = f"step_{step:06d}"
    tmp, final = os.path.join(root, f".tmp-{name}"), os.path.join(root, name)
    os.makedirs(root, exist_ok=True)
    shutil.rmtree(tmp, ignore_errors=True)  # a leftover of a crash during an earlier save
    os.makedirs(tmp)
    for file_name, obj in files.items():
        _write(os.path.join(tmp, file_name), lambda f, obj=obj: torch.save(obj, f))
    manifest = {"meta": meta, "sha256": {f: _sha256(os.path.join(tmp, f)) for f in files}}
    _write(os.path.join(tmp, "manifest.json"), lambda f: f.write(json.dumps(manifest, indent=1).encode()))
    _fsync_dir(tmp)
    if os.path.exists(final):  # the same step saved twice (e.g. a resumed run's final save)
        old = os.path.join(root, f".old-{name}")
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old)
    else:
        os.rename(tmp, final)
    _fsync_dir(root)
    pointer = os.path.join(root, "latest")
    _write(pointer + ".tmp", lambda f: f.write(name.encode()))
    os.replace(pointer + ".tmp", pointer)
    for old in sorted((d for d in os.listdir(root) if d.startswith("step_")), key=lambda d: int(d[5:]))[:-keep_last]:
        shutil.rmtree(os.path.join(root, old), ignore_errors=True)
    return final


def read_checkpoint(path):
    """The checkpoint's meta and files, or a one-line reason why it cannot be used."""
    try:
        with open(os.path.join(path, "manifest.json")) as f:
            manifest = json.load(f)
        for file_name, digest in manifest["sha256"].items():
            if _sha256(os.path.join(path, file_name)) != digest:
                return None, f"{file_name} does not match its checksum"
        files = {f: torch.load(os.path.join(path, f), map_location="cpu", weights_only=True)
                 for f in manifest["sha256"]}
    except (OSError, ValueError, KeyError, RuntimeError, pickle.UnpicklingError) as e:
        return None, str(e).splitlines()[0] if str(e) else type(e).__name__
    return {"meta": manifest["meta"], **files}, None


def find_checkpoint(root):
    """The newest complete checkpoint under root, skipping (and reporting) damaged ones."""
    names = [d for d in os.listdir(root) if d.startswith("step_")] if os.path.isdir(root) else []
    names.sort(key=lambda d: int(d[5:]) if d[5:].isdigit() else -1, reverse=True)
    for name in names:
        loaded, problem = read_checkpoint(os.path.join(root, name))
        if loaded is not None:
            return os.path.join(root, name), loaded
        if int(os.environ.get("RANK", "0")) == 0:
            print(f"warning: checkpoint {os.path.join(root, name)} is damaged ({problem}); trying an older one",
                  file=sys.stderr)
    return None, None


def rng_states(device):
    """This rank's RNG states, as tensors and plain lists (loadable with weights_only=True)."""
    np_state = np.random.get_state()
    return {"python": json.dumps(random.getstate()), "torch": torch.get_rng_state(),
            "numpy": [np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *np_state[2:]],
            "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None}


def set_rng_states(states, device):
    version, internal, gauss = json.loads(states["python"])
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(states["torch"])
    kind, keys, *rest = states["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), *rest))
    if device.type == "cuda" and states["cuda"] is not None:
        torch.cuda.set_rng_state(states["cuda"], device)


def export_hf(hf_model, tokenizer, out_dir):
    """A Hugging Face folder (safetensors + tokenizer), written aside and renamed into place."""
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()
    final, tmp = os.path.join(out_dir, "hf"), os.path.join(out_dir, ".tmp-hf")
    shutil.rmtree(tmp, ignore_errors=True)
    hf_model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    shutil.rmtree(final, ignore_errors=True)
    os.rename(tmp, final)


# ----------------------------------------------------------------------------- training

def train_step(model, optimizer, scheduler, scaler, window, global_masked, global_samples, world_size,
               amp_ctx, clip):
    """One optimizer step over a window of micro-batches, returning (loss sums, grad norm) on device.

    Each micro-batch's loss is its sum of token losses over the *global* masked-token count
    (x world_size, since DDP averages gradients over ranks): the gradient is then exactly that
    of one big batch, however the masked tokens fall across ranks and micro-batches.
    """
    sums = None
    for i, batch in enumerate(window):
        last = i == len(window) - 1
        sync = contextlib.nullcontext() if last or not isinstance(model, DDP) else model.no_sync()
        with sync:  # all-reduce gradients only once per window, on its last backward
            with amp_ctx:
                out = model(**batch)
            loss = (out[0] / max(global_masked, 1) + out[2] / max(global_samples, 1)) * world_size
            scaler.scale(loss).backward()
        sums = out.detach() if sums is None else sums + out.detach()
    scaler.unscale_(optimizer)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    grad_norm = torch.nn.utils.clip_grad_norm_(params, clip if clip > 0 else float("inf"))
    scaler.step(optimizer)  # skips the step when fp16 gradients overflowed
    scaler.update()
    optimizer.zero_grad(set_to_none=True)
    scheduler.step()
    return sums, grad_norm


@torch.no_grad()
def evaluate(model, loader, device, amp_ctx, world_size, nsp):
    """MLM loss / perplexity / accuracy and NSP accuracy over the whole (sharded) eval set."""
    model.eval()
    sums = torch.zeros(6, dtype=torch.float64, device=device)
    for batch in loader:
        batch, num_masked, _ = prepare(batch, device)
        with amp_ctx:
            out = model(**batch).double()
        sums += torch.stack([out[0], out[1], out.new_tensor(num_masked), out[2], out[3],
                             out.new_tensor(len(batch["input_ids"]))])
    if world_size > 1:
        dist.all_reduce(sums)
    model.train()
    mlm_loss, mlm_correct, masked, nsp_loss, nsp_correct, samples = sums.tolist()
    if masked == 0:
        return {}
    metrics = {"eval/mlm_loss": mlm_loss / masked, "eval/perplexity": math.exp(min(mlm_loss / masked, 50)),
               "eval/mlm_accuracy": mlm_correct / masked}
    if nsp:
        metrics.update({"eval/nsp_loss": nsp_loss / samples, "eval/nsp_accuracy": nsp_correct / samples})
    return metrics


def main(argv=None):
    args = parse_args(argv)
    validate(args)

    # --- distributed set-up: torchrun sets RANK/WORLD_SIZE/LOCAL_RANK; plain python is rank 0 of 1
    world_size, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
        if "OMP_NUM_THREADS" not in os.environ:  # share the cores between the ranks of this machine
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    amp_dtype = choose_amp_dtype(args, device)
    if world_size > 1:
        # torchrun's restarts (--max-restarts) reuse its store, and a restarted rank could read the
        # dead group's addresses and fail to connect (seen with torch 2.13): keep attempts apart.
        store = dist.PrefixStore(f"attempt-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}",
                                 next(dist.rendezvous("env://"))[0])
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=store, rank=rank,
                                world_size=world_size, device_id=device if device.type == "cuda" else None)
    # The per-step control all_reduce runs on the CPU (gloo) even under nccl: reading its result
    # then never waits for the GPU, which keeps queueing kernels ahead of the host.
    ctrl_group = dist.new_group(backend="gloo") if world_size > 1 and device.type == "cuda" else None
    master = rank == 0

    def from_rank0(obj):
        """Rank 0's obj on every rank (small Python objects: plans, names, error messages)."""
        box = [obj]
        if world_size > 1:
            dist.broadcast_object_list(box, src=0, group=ctrl_group)
        return box[0]

    def rank0_first(fn):
        """Run fn on rank 0 first (it builds caches: corpus, tokenizer), then on the others.
        A user error on rank 0 reaches every rank, so none waits in a collective for ever."""
        result, error = None, None
        for turn in (0, 1):
            if (turn == 0) == master:
                try:
                    result = fn()
                except data_stream.CorpusError as e:
                    error = str(e)
            if turn == 0:
                error = from_rank0(error)
            if error:
                fail(error)
        return result

    # --- data: the training stream, the eval stream, the planned number of steps
    torch.manual_seed(args.seed + rank)  # dropout differs per rank; the init is rank 0's (DDP broadcasts it)
    tokenizer = rank0_first(lambda: data_stream.get_tokenizer(
        args.tokenizer, data_stream.resolve_corpus(args.corpus), args.vocab_size))

    def make_stream(corpus, split, seed, shuffle):
        return data_stream.BertPretrainStream(
            corpus, tokenizer, split=split, objective=args.objective, max_seq_len=args.max_seq_len,
            batch_size=args.batch_size, mask_prob=args.mask_prob, short_seq_prob=args.short_seq_prob,
            seed=seed, rank=rank, world_size=world_size, shuffle=shuffle)

    stream = rank0_first(lambda: make_stream(args.corpus, "train", args.seed, True))
    eval_corpus = args.eval_corpus or ("builtin" if args.corpus == "builtin" else "none")
    eval_stream = None
    if eval_corpus != "none":
        try:
            eval_stream = make_stream(eval_corpus, "eval", EVAL_SEED, False)
        except data_stream.CorpusError as e:
            if master:
                print(f"warning: no evaluation: --eval-corpus {eval_corpus}: {e}", file=sys.stderr)
    elif master and args.eval_corpus is None:
        print("warning: no evaluation: give --eval-corpus for a held-out set", file=sys.stderr)
    total_steps, estimate = from_rank0(planned_steps(args, stream, world_size) if master else None)

    # --- the out dir and the checkpoint to resume from
    out_dir = args.out_dir
    if out_dir is None:
        # torchrun's restarts (--max-restarts) keep the run id, so they find the same out dir and resume.
        run_id = os.environ.get("TORCHELASTIC_RUN_ID", "none")
        out_dir = from_rank0(f"runs/run-{run_id}" if run_id != "none" else time.strftime("runs/%Y%m%d-%H%M%S"))
    ckpt_root = os.path.join(out_dir, "checkpoints")
    resumed = None
    if args.resume == "none":
        if os.path.isdir(ckpt_root) and any(d.startswith("step_") for d in os.listdir(ckpt_root)) \
                and not args.overwrite:
            fail(f"--out-dir {out_dir} holds checkpoints: --resume auto continues from them, "
                 "--overwrite deletes them, or choose another --out-dir")
    else:
        path, resumed = find_checkpoint(ckpt_root) if args.resume == "auto" else (args.resume, None)
        if args.resume != "auto":
            resumed, problem = read_checkpoint(path)
            if resumed is None:
                fail(f"--resume {path} cannot be used: {problem}")
    config = {**vars(args), "out_dir": out_dir, "world_size": world_size, "device": str(device),
              "vocab": len(tokenizer), "tokenizer_path": tokenizer.name_or_path,
              "amp_dtype": str(amp_dtype).replace("torch.", "") if amp_dtype else "fp32",
              "effective_batch": args.batch_size * args.accum_steps * world_size, "planned_steps": total_steps}
    if resumed is not None:
        before = resumed["meta"]["config"]
        changed = [f"{k} (checkpoint {before.get(k)!r}, now {config[k]!r})" for k in RESUME_MUST_MATCH
                   if before.get(k) != config[k]]
        if changed:
            fail(f"cannot resume from {path}: {'; '.join(changed)} differ; use another --out-dir, "
                 "or --resume none --overwrite")

    # --- model and optimizer
    hf_model = build_model(args.model_size, args.objective, len(tokenizer), args.max_seq_len, args.dropout,
                           tokenizer.pad_token_id)
    raw_model = Pretraining(hf_model).to(device)
    # Checkpoints and exports read raw_model.hf, so they never carry the compile wrapper's prefix.
    compiled = torch.compile(raw_model) if args.compile else raw_model
    model = DDP(compiled, device_ids=[local_rank] if device.type == "cuda" else None) if world_size > 1 \
        else compiled
    decay = [p for n, p in raw_model.named_parameters() if p.ndim >= 2 and "LayerNorm" not in n]
    no_decay = [p for n, p in raw_model.named_parameters() if p.ndim < 2 or "LayerNorm" in n]
    # fused: one kernel for all parameters (measured 6.6x faster than the for-loop on this CPU too)
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.98),
                                  eps=1e-6, fused=True)
    warmup_steps = max(1, round(args.warmup * total_steps)) if args.warmup > 0 else 0

    def lr_factor(step):  # linear warmup, then linear decay to zero at the planned last step
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        return max(0.0, (total_steps - step) / max(1, total_steps - warmup_steps))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
    scaler = torch.amp.GradScaler(device.type, enabled=amp_dtype == torch.float16)
    amp_ctx = torch.autocast(device.type, dtype=amp_dtype) if amp_dtype else contextlib.nullcontext()

    # --- logging and the signals that stop every rank at the same step
    log, close_log = (lambda s, step: None), (lambda: None)
    if master:
        if args.resume == "none" and args.overwrite:
            shutil.rmtree(ckpt_root, ignore_errors=True)
        os.makedirs(out_dir, exist_ok=True)
        log, close_log = make_logger(args.log_to.split(","), out_dir, config)
        n_params = sum(p.numel() for p in raw_model.parameters())
        print(f"config: {json.dumps(config)}")
        print(f"model: BERT-{args.model_size} {args.objective}, {n_params / 1e6:.2f}M parameters; world size "
              f"{world_size} on {device.type}; effective batch {config['effective_batch']} "
              f"({args.batch_size} x {world_size} ranks x {args.accum_steps} accum)")
        print(f"planned {total_steps} steps (estimate, {estimate['mode']}: {estimate['total_steps']} steps for "
              f"{args.epochs} epoch(s)" + (f", capped by --max-steps {args.max_steps})" if args.max_steps else ")"),
              flush=True)
    stop_signal = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: stop_signal.append(signum))

    def all_reduce_ctrl(values):
        t = torch.tensor(values, dtype=torch.float64)
        if world_size > 1:
            dist.all_reduce(t, group=ctrl_group)
        return t.tolist()

    interval = {}

    def log_interval(step, epoch, grad_norm):
        """Log the scalars of the steps since the last call; returns the train loss over them."""
        loss_sums = interval["sums"].double()
        if world_size > 1:
            dist.all_reduce(loss_sums)  # the loss of all ranks, not rank 0's: one sync per log
        mlm_loss, _, nsp_loss, _ = loss_sums.tolist()
        elapsed = time.perf_counter() - interval["t0"]
        mlm_loss, nsp_loss = mlm_loss / max(interval["masked"], 1), nsp_loss / max(interval["samples"], 1)
        scalars = {"train/loss": mlm_loss + nsp_loss, "train/mlm_loss": mlm_loss,
                   "train/lr": scheduler.get_last_lr()[0], "train/grad_norm": float(grad_norm),
                   "train/tokens_per_sec": interval["tokens"] / elapsed,
                   "train/samples_per_sec": interval["samples"] / elapsed,
                   "train/data_wait": interval["wait"] / elapsed, "train/epoch": epoch}
        if args.objective == "nsp":
            scalars["train/nsp_loss"] = nsp_loss
        if scaler.is_enabled():
            scalars["train/loss_scale"] = scaler.get_scale()
        if peak:
            scalars["train/mfu"] = interval["flops"] / elapsed / (peak * world_size)
        log(scalars, step)
        interval.update(sums=None, masked=0, samples=0, tokens=0, flops=0.0, wait=0.0, t0=time.perf_counter())
        return mlm_loss + nsp_loss

    # --- the loop
    peak = peak_flops(device, amp_dtype)
    # epoch counts the epochs whose data ran out: a run stopped by --max-steps or a signal is inside it
    step, epoch, samples_seen, tokens_seen, flops_done = 0, 0, 0, 0, 0.0
    interval.update(sums=None, masked=0, samples=0, tokens=0, flops=0.0, wait=0.0, t0=time.perf_counter())
    unused_per_epoch, eval_metrics, train_loss, grad_norm = [], {}, float("nan"), None
    resume_data = None
    if resumed is not None:
        meta, trainer, ranks = resumed["meta"], resumed["trainer.pt"], resumed["ranks.pt"]
        raw_model.hf.load_state_dict(trainer["model"])
        optimizer.load_state_dict(trainer["optimizer"])
        scheduler.load_state_dict(trainer["scheduler"])
        scaler.load_state_dict(trainer["scaler"])
        step, epoch = meta["step"], meta["epoch"]
        samples_seen, tokens_seen, flops_done = meta["samples_seen"], meta["tokens_seen"], meta["flops_done"]
        unused_per_epoch = meta["unused_per_epoch"]
        if meta["world_size"] == world_size and meta["num_workers"] == args.num_workers:
            set_rng_states(ranks[rank]["rng"], device)
            resume_data = ranks[rank]["data"]
        else:
            if master:
                print(f"warning: resuming {meta['world_size']} ranks x {meta['num_workers']} workers as "
                      f"{world_size} x {args.num_workers}: the data order is no longer bit-exact (the rest "
                      "of the epoch is re-sharded; no document is repeated)", file=sys.stderr)
            positions = {k: v for r in ranks for k, v in r["data"]["positions"].items()}
            resume_data = {**ranks[0]["data"], "positions": positions, "last_shard": None}
        if master:
            print(f"resumed from {path} at step {step}, epoch {epoch}", flush=True)

    saved_at = []

    def checkpoint():
        """Every rank's RNG and data cursor go to rank 0, which writes the checkpoint atomically."""
        if saved_at == [step, epoch]:
            return
        saved_at[:] = [step, epoch]
        mine = {"rng": rng_states(device), "data": stream.state_dict()}
        gathered = [None] * world_size if master else None
        if world_size > 1:
            dist.gather_object(mine, gathered, dst=0, group=ctrl_group)
        else:
            gathered = [mine]
        if master:
            meta = {"step": step, "epoch": epoch, "samples_seen": samples_seen,
                    "tokens_seen": tokens_seen, "flops_done": flops_done, "unused_per_epoch": unused_per_epoch,
                    "world_size": world_size, "num_workers": args.num_workers, "config": config}
            trainer = {"model": raw_model.hf.state_dict(), "optimizer": optimizer.state_dict(),
                       "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict()}
            path = save_checkpoint(ckpt_root, step, {"trainer.pt": trainer, "ranks.pt": gathered}, meta,
                                   args.keep_last)
            print(f"saved {path}", flush=True)
    t_start, start = time.perf_counter(), (step, tokens_seen, flops_done)  # rates count this run only
    stopped, last_eval_step = False, None
    step_limit = args.max_steps or math.inf  # else the epochs end the run (the plan is an estimate)
    while epoch < args.epochs and step < step_limit and not stopped:
        if resume_data is not None and resume_data["epoch"] == epoch:
            stream.load_state_dict(resume_data)
        else:
            stream.set_epoch(epoch)
        resume_data = None
        batches = iter(make_loader(stream, args.num_workers, device))
        data_ended = False
        while step < step_limit:
            t_wait = time.perf_counter()
            window, masked, samples, tokens, flops = [], 0, 0, 0, 0.0
            cursors = []
            for raw in batches:
                cursors.append(raw.pop("cursor"))
                batch, n_masked, n_tokens = prepare(raw, device)
                window.append(batch)
                masked, samples = masked + n_masked, samples + len(batch["input_ids"])
                tokens, flops = tokens + n_tokens, flops + train_flops(hf_model.config, batch)
                if len(window) == args.accum_steps:
                    break
            interval["wait"] += time.perf_counter() - t_wait
            # The one collective per step: does every rank hold a full window? (SUM of 0/1),
            # global masked tokens and samples (to normalise the loss exactly), a stop request.
            full, g_masked, g_samples, g_tokens, g_flops, g_stop = all_reduce_ctrl(
                [len(window) == args.accum_steps, masked, samples, tokens, flops, len(stop_signal)])
            if full < world_size or g_stop:
                stopped, data_ended = bool(g_stop), not g_stop
                break
            for cursor in cursors:
                stream.consumed(cursor)
            sums, grad_norm = train_step(model, optimizer, scheduler, scaler, window, g_masked, g_samples,
                                         world_size, amp_ctx, args.clip)
            step += 1
            samples_seen, tokens_seen, flops_done = samples_seen + g_samples, tokens_seen + g_tokens, \
                flops_done + g_flops
            interval["sums"] = sums if interval["sums"] is None else interval["sums"] + sums
            for key, value in (("masked", g_masked), ("samples", g_samples), ("tokens", g_tokens),
                               ("flops", g_flops)):
                interval[key] += value
            if step % args.log_every == 0 or step == total_steps:
                train_loss = log_interval(step, epoch, grad_norm)
            if step % args.save_every == 0:
                checkpoint()
            if args.export_every and step % args.export_every == 0 and master:
                export_hf(raw_model.hf, tokenizer, out_dir)
            if eval_stream is not None and step % args.eval_every == 0:
                eval_metrics = evaluate(raw_model, make_loader(eval_stream, args.num_workers, device), device,
                                        amp_ctx, world_size, args.objective == "nsp")
                log(eval_metrics, step)
                last_eval_step = step
        if data_ended:
            # The epoch ended for all ranks at the same step; count what each rank had to leave.
            left = sum(len(b["input_ids"]) for b in window) + sum(len(b["input_ids"]) for b in batches)
            unused = all_reduce_ctrl([left if r == rank else 0 for r in range(world_size)])
            unused_per_epoch.append([int(u) for u in unused])
            if master:
                print(f"epoch {epoch} ended at step {step}; samples left unused per rank: "
                      f"{unused_per_epoch[-1]}", flush=True)
            epoch += 1
        del batches  # end the workers now, not at interpreter exit

    # --- final eval, the report, summary.json
    elapsed = time.perf_counter() - t_start
    if interval["sums"] is not None:  # steps since the last log (the epochs ended before the plan)
        train_loss = log_interval(step, epoch, grad_norm)
    if stopped and master:
        print(f"stopped by signal at step {step} on every rank", flush=True)
    checkpoint()
    if eval_stream is not None and last_eval_step != step:
        eval_metrics = evaluate(raw_model, make_loader(eval_stream, args.num_workers, device), device, amp_ctx,
                                world_size, args.objective == "nsp")
        log(eval_metrics, step)
        if not eval_metrics and master:
            print("warning: the eval set produced no masked tokens; eval skipped", file=sys.stderr)
    if master:
        steps_run, tokens_run, flops_run = step - start[0], tokens_seen - start[1], flops_done - start[2]
        steps_per_hour = steps_run / max(elapsed, 1e-9) * 3600
        eta_h = total_steps / steps_per_hour if steps_per_hour else float("nan")
        effective = config["effective_batch"]
        print(f"per-rank batch {args.batch_size} x {world_size} ranks, accumulation {args.accum_steps}, "
              f"effective batch {effective}, max seq len {args.max_seq_len}")
        print(f"iterations {steps_run}, time taken {elapsed:.1f} s, micro-batches/hour "
              f"{steps_per_hour * args.accum_steps:,.0f} => effective batches/hour {steps_per_hour:,.0f}")
        print(f"ran {step} steps (planned {total_steps}); estimated total time for the planned steps: "
              f"{eta_h:.2f} h; {tokens_run / max(elapsed, 1e-9):,.0f} tokens/s"
              + (f", MFU {flops_run / max(elapsed, 1e-9) / (peak * world_size):.1%}" if peak else ""))
        summary = {"steps": step, "planned_steps": total_steps, "epochs_done": epoch,
                   "train_loss": None if math.isnan(train_loss) else train_loss, "eval": eval_metrics,
                   "samples_seen": samples_seen,
                   "tokens_seen": tokens_seen, "tokens_per_sec": tokens_run / max(elapsed, 1e-9),
                   "world_size": world_size, "effective_batch": effective, "time_s": elapsed,
                   "steps_per_hour": steps_per_hour, "unused_samples_per_epoch": unused_per_epoch,
                   "stopped_by_signal": stopped, "estimate": estimate}
        with open(os.path.join(out_dir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=1)
        export_hf(raw_model.hf, tokenizer, out_dir)
        close_log()
    if world_size > 1:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
