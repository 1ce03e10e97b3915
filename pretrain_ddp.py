"""
Pretrain a BERT from scratch with DistributedDataParallel, on one CPU, one GPU or many.

    python pretrain_ddp.py                                   # tiny BERT on the builtin corpus
    torchrun --nproc_per_node 4 pretrain_ddp.py --amp        # 4 GPUs (or 4 CPU processes)
    torchrun --nnodes 2 --nproc_per_node 8 --rdzv-backend c10d --rdzv-endpoint host0:29500 \\
        --rdzv-id bert1 --max-restarts 3 pretrain_ddp.py --amp   # on each of two nodes
    tensorboard --logdir runs

Top to bottom: the flags, the model, a training step and an evaluation, then main(), the run as a story
(decide the run, build or restore, the loop, finish); after it, in sections, the machinery main() calls.
"""

import argparse
import contextlib
import ctypes
import fcntl
import functools
import gc
import hashlib
import importlib
import inspect
import json
import math
import os
import pickle
import re
import shutil
import signal
import socket
import sys
import tempfile
import time
import uuid
from datetime import timedelta

# The process that started this one (torchrun's agent, a shell), read before the seconds that importing torch
# takes: an agent that dies meanwhile is seen by die_with_launcher
LAUNCHER_PID = os.getppid()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

import data_stream  # noqa: E402
import estimate_steps  # noqa: E402
from model import (  # noqa: E402
    MODEL_SIZES,
    Pretraining,
    model_from,
    new_architecture,
    new_optimizer,
    prepare,
    size_name,
    sparse_targets,
    train_flops,
)

EVAL_SEED = 12345  # the eval set is masked the same way in every run, so numbers compare


def parse_args(argv=None):
    number = data_stream.number  # one table of ranges for the three scripts: a bad value fails in one line
    p = data_stream.Parser(prog="pretrain_ddp.py", description=__doc__.split("\n\n")[0].strip(),
                           formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    data = data_stream.add_data_args(p)
    data.add_argument("--eval-corpus", default=None,
                      help="held-out corpus for evaluation; default: builtin's held-out split for --corpus builtin, "
                           "else none; 'none' turns eval off")
    data.add_argument("--num-workers", type=number(int, 0), default=None,
                      help="DataLoader worker processes per rank; default 1 on a CPU, on a GPU enough to feed it "
                           "(up to 4, within the cores per rank)")

    model = p.add_argument_group("model")
    model.add_argument("--model-size", default=None, choices=MODEL_SIZES,
                       help="BERT size (Turc et al. 2019 / BERT); default tiny, or the size of --init-from's model")
    model.add_argument("--init-from", default=None, metavar="PATH",
                       help="start from these weights (new optimizer, LR plan, step 0): a checkpoint folder, a "
                            "run's out dir (its latest checkpoint) or a Hugging Face BERT folder (config.json + "
                            "weights); its tokenizer too, unless --tokenizer. For BERT's phase 2 (e.g. 128 -> 512 "
                            "tokens) and continued pretraining. A run that has checkpoints of its own resumes those")
    model.add_argument("--dropout", type=number(float, 0, 1, high_open=True), default=0.1,
                       help="hidden and attention dropout")
    model.add_argument("--compile", action="store_true",
                       help="torch.compile the model (pays on GPUs; on CPUs it measured no gain for a long compile)")

    optim = p.add_argument_group("optimization")
    # The defaults (batch 16, lr 2e-3, 5 epochs) take tiny on builtin off the frequent-token plateau in ~3 min
    # on 2 CPU cores (15% eval MLM accuracy; batch 32, lr 1e-3, 3 epochs: 9.3%). Bigger models want a lower lr.
    optim.add_argument("--batch-size", type=number(int, 1), default=16, help="micro-batch per rank")
    optim.add_argument("--accum-steps", type=number(int, 1), default=1, help="micro-batches per optimizer step")
    optim.add_argument("--lr", type=number(float, 0), default=2e-3,
                       help="peak learning rate, for the default tiny model (BERT-base: 1e-4 at batch 256); 0 "
                            "trains nothing: the weights stay, e.g. to evaluate")
    optim.add_argument("--warmup", type=number(float, 0, 1), default=estimate_steps.WARMUP,
                       help="fraction of the planned steps with linear warmup")
    optim.add_argument("--schedule", default="linear", choices=["linear", "cosine", "wsd"],
                       help="the LR after warmup: linear (BERT's) or cosine decay to 0 at the end of the plan, or "
                            "wsd, warmup-stable-decay: the peak LR until the last --decay of the plan, then linear "
                            "to 0; a wsd run still in its stable phase can be extended by resuming it with more "
                            "--epochs, --max-steps or --budget")
    optim.add_argument("--decay", type=number(float, 0, 1, low_open=True), default=estimate_steps.DECAY,
                       help="wsd: the fraction of the plan over which the LR decays to 0")
    optim.add_argument("--weight-decay", type=number(float, 0), default=0.01,
                       help="AdamW decay (not on biases and LayerNorm)")
    optim.add_argument("--clip", type=number(float, 0), default=1.0, help="gradient norm clipping; 0 turns it off")
    optim.add_argument("--rollback-after", type=number(int, 1), default=10, metavar="N",
                       help="a step whose gradient is inf or NaN is skipped on every rank; after N such steps in a "
                            "row (read every N and every --log-every steps) every rank rolls back to the newest "
                            "checkpoint and goes on with the data after them; if that does not help, the run stops")
    optim.add_argument("--amp", action="store_true",
                       help="mixed precision: bf16 where the GPU computes it natively (Ampere and later), else "
                            "fp16 + GradScaler")
    optim.add_argument("--amp-dtype", default="auto", choices=["auto", "bf16", "fp16"],
                       help="with --amp: force a dtype. auto on a CPU: bf16 with avx512_bf16/AMX, else fp32 "
                            "(bf16 without them is ~28x slower)")
    optim.add_argument("--tf32", action=argparse.BooleanOptionalAction, default=True,
                       help="CUDA: fp32 matmuls (without --amp, and fp32 parts with it) on TF32 tensor cores, "
                            "~8x faster on Ampere and later with a 10-bit mantissa; --no-tf32 for full precision")

    length = p.add_argument_group("run length")
    length.add_argument("--epochs", type=number(int, 1), default=5, help="passes over the corpus, reshuffled each time")
    length.add_argument("--max-steps", type=number(int, 1), default=None,
                        help="stop after this many optimizer steps; default: the whole --epochs (estimated)")
    length.add_argument("--budget", type=estimate_steps.duration, default=None, metavar="TIME",
                        help="train for this long (6h, 90m, 45s): before step 1 rank 0 times a few steps, an eval "
                             "and a save, and plans the steps that fit (never more than --epochs and --max-steps "
                             "allow); the LR reaches 0 at the last one, and a resume continues the stored plan")

    ckpt = p.add_argument_group("checkpoints and outputs")
    ckpt.add_argument("--out-dir", default=None,
                      help="where checkpoints, the run's tokenizer, logs and summary.json go (written by rank 0 "
                           "only: other nodes need no access); default runs/<date-time>")
    ckpt.add_argument("--save-every", type=number(int, 1), default=500,
                      help="checkpoint every N optimizer steps (also at the end and on SIGTERM/SIGINT)")
    ckpt.add_argument("--keep-last", type=number(int, 1), default=3, help="complete checkpoints kept")
    ckpt.add_argument("--resume", default="auto",
                      help="auto: continue from the newest complete checkpoint in --out-dir, if any; none: start "
                           "afresh; or a checkpoint folder")
    ckpt.add_argument("--overwrite", action="store_true",
                      help="with --resume none: delete the out dir's checkpoints and tokenizer")
    ckpt.add_argument("--allow-corpus-change", action="store_true",
                      help="resume although the corpus changed (files added or edited): the current epoch "
                           "restarts on the new corpus; without it such a resume is an error")
    ckpt.add_argument("--export-every", type=number(int, 0), default=0,
                      help="also write the Hugging Face folder <out>/hf every N steps (it is always written at "
                           "the end)")

    distributed = p.add_argument_group("distributed")
    distributed.add_argument("--dist-timeout", type=number(float, 0, low_open=True), default=30,
                             help="minutes a rank waits for the others in a collective, or for a batch from its "
                                  "DataLoader, before all stop with one line (rank 0's preparation, e.g. training "
                                  "the tokenizer, has its own 24-hour wait)")

    logging = p.add_argument_group("logging and evaluation")
    logging.add_argument("--eval-every", type=number(int, 1), default=200,
                         help="evaluate every N optimizer steps (and at the end)")
    logging.add_argument("--log-every", type=number(int, 1), default=20,
                         help="log training scalars every N optimizer steps")
    logging.add_argument("--log-to", default="stdout,tensorboard",
                         help="comma list of stdout, tensorboard, mlflow (to $MLFLOW_TRACKING_URI, else "
                              "./mlflow.db), wandb (set by the WANDB_* variables; WANDB_MODE=offline needs no "
                              "network)")
    return p.parse_args(argv)


def validate(args):
    """What no single flag's range says (those are argparse types), checked before any process group
    exists: every rank finds the same."""
    if args.max_seq_len < (5 if args.objective == "nsp" else 3):
        fail(f"--max-seq-len {args.max_seq_len} is too small for an {args.objective} sample "
             f"(at least {5 if args.objective == 'nsp' else 3})")
    bad = set(args.log_to.split(",")) - {"stdout", "tensorboard", "mlflow", "wandb"}
    if bad:
        fail(f"--log-to takes stdout, tensorboard, mlflow, wandb; not {', '.join(sorted(bad))}")
    for tracker in ("mlflow", "wandb"):
        if tracker in args.log_to.split(","):
            try:
                importlib.import_module(tracker)
            except ImportError:
                fail(f"--log-to {tracker} needs the {tracker} package: pip install {tracker} (or drop {tracker} "
                     "from --log-to)")


# ----------------------------------------------------------------------------- model

# torch 2.13 renamed DDP's broadcast_buffers to forward_sync_buffers (the old name warns there; older: only it)
NO_BUFFER_SYNC = {"forward_sync_buffers" if "forward_sync_buffers" in inspect.signature(DDP.__init__).parameters
                  else "broadcast_buffers": False}


def wrap_ddp(model, device):
    """DDP without the per-forward sync of buffers (BERT's are constant position and token-type
    ids, synced once at the start) and with gradients kept in the all_reduce buckets (no copy)."""
    return DDP(model, device_ids=[device.index] if device.type == "cuda" else None, gradient_as_bucket_view=True,
               **NO_BUFFER_SYNC)


# ----------------------------------------------------------------------------- training: a step, an eval, main()

def train_step(model, optimizer, scaler, window, global_masked, global_samples, world_size, amp_ctx, clip, lr):
    """One optimizer step at learning rate lr over a window of micro-batches. Returns, as device tensors
    (no host sync): the loss sums, the grad norm, 1 if the step was skipped for an inf/NaN gradient (it
    still counts as a step, as in the Trainer and nanoGPT: knowing it on the host would cost a sync).
    Each micro-batch's loss is its sum of token losses over the *global* masked-token count (x world_size:
    DDP averages over ranks), so the gradient is one big batch's, however the tokens fall."""
    for group in optimizer.param_groups:
        group["lr"] = lr
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
    # An inf/NaN gradient is never applied (it would poison AdamW). All ranks hold the same all-reduced ones:
    # all skip alike. GradScaler skips fp16's; else the fused AdamW skips on the device (found_inf).
    skipped = (~torch.isfinite(grad_norm)).float()
    if scaler.is_enabled():
        scaler.step(optimizer)
        scaler.update()
    elif optimizer.defaults.get("fused"):
        optimizer.found_inf = skipped
        optimizer.step()
        del optimizer.found_inf
    elif not skipped:  # an optimizer that takes no found_inf: a host read (the trainer's AdamW is fused)
        optimizer.step()
    # DDP's gradients are views into its buckets (gradient_as_bucket_view): zeroed, not set to None
    optimizer.zero_grad(set_to_none=not isinstance(model, DDP))
    return sums, grad_norm, skipped


@torch.no_grad()
def evaluate(model, loader, device, amp_ctx, world_size, nsp):
    """MLM loss / perplexity / accuracy and NSP accuracy over the whole (sharded) eval set."""
    model.eval()
    sums, masked, samples = torch.zeros(4, dtype=torch.float64, device=device), 0, 0
    for batch in loader:
        batch, counts = prepare(batch, device)
        with amp_ctx:
            sums += model(**batch).double()
        masked, samples = masked + counts["num_masked"], samples + counts["num_samples"]  # host counts: no copy
    sums = torch.cat([sums, torch.tensor([masked, samples], dtype=torch.float64, device=device)])
    if world_size > 1:
        dist.all_reduce(sums)
    model.train()
    mlm_loss, mlm_correct, nsp_loss, nsp_correct, masked, samples = sums.tolist()
    if masked == 0:
        return {}
    metrics = {"eval/mlm_loss": mlm_loss / masked, "eval/perplexity": math.exp(min(mlm_loss / masked, 50)),
               "eval/mlm_accuracy": mlm_correct / masked}
    if nsp:
        metrics.update({"eval/nsp_loss": nsp_loss / samples, "eval/nsp_accuracy": nsp_correct / samples})
    return metrics


def main(argv=None):
    # --- decide the run: rank 0 decides (out dir, checkpoint, tokenizer, LR plan); every rank verifies it
    args = parse_args(argv)
    validate(args)
    device, amp_dtype = setup_device(args)
    join_group(device, timedelta(minutes=args.dist_timeout), newest_local_step(args))
    rank, world_size, master = GROUP["rank"], GROUP["world_size"], GROUP["rank"] == 0
    verify("the command line", vars(args))
    if args.num_workers is None:  # rank 0's machine decides: every rank must shard the data alike
        args.num_workers = from_rank0(default_num_workers(device))
    rank0_only = {}
    run = rank0_prepares(lambda: plan_run(args, world_size, device, amp_dtype, rank0_only))
    tokenizer, stream, eval_stream = load_run(args, run, rank0_only)
    out_dir, config, plan = run["out_dir"], run["config"], run["plan"]

    # --- build or restore: model, optimizer, the resumed state (loaded before the DDP wrap, verified on every rank)
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    hf_model = model_from(config["architecture"], args.objective, args.dropout)
    if run["init"]:  # --init-from: the source's weights, as rank 0 loaded them
        source = [run["init"][k] for k in ("kind", "folder", "objective", "seed")]
        hf_model.load_state_dict(fetch(rank0_only.get("init_weights"), source[1], lambda: load_init(*source)[0],
                                       lambda weights: weights_checksum(weights) == run["init"]["checksum"]))
    raw_model = Pretraining(hf_model).to(device)
    optimizer = new_optimizer(raw_model, args.lr, args.weight_decay)
    scaler = torch.amp.GradScaler(device.type, enabled=amp_dtype == torch.float16)
    amp_ctx = torch.autocast(device.type, dtype=amp_dtype) if amp_dtype else contextlib.nullcontext()
    torch.manual_seed(args.seed + rank)  # dropout differs per rank (a same-size resume restores its RNG)
    resumed = run["path"] and fetch(rank0_only.get("resumed"), run["path"], lambda: read_checkpoint(run["path"])[0],
                                    lambda loaded: loaded["sha256"] == run["sha256"])
    progress, resume_data = restore(resumed, run["corpus_changed"], raw_model, optimizer, scaler, device,
                                    args.num_workers)
    verify("the step and weights", (progress["step"], weights_checksum(raw_model.state_dict())))
    # Checkpoints and exports read raw_model.hf, so they never carry the compile wrapper's prefix.
    compiled = torch.compile(raw_model) if args.compile else raw_model
    model = wrap_ddp(compiled, device) if world_size > 1 else compiled
    trainer = (raw_model, optimizer, scaler)
    step_in_plan = config["effective_batch"] / plan["batch"]  # 1 unless resumed on another world size
    log = Logger(args.log_to.split(",") if master else [], out_dir, config,
                 resumed["meta"].get("tracker_runs", {}) if resumed else {})
    if master:
        announce(args, run, raw_model, device, progress)
    stop_signal = []  # SIGTERM/SIGINT: every rank stops at the same step (the per-step all_reduce says it)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: stop_signal.append(signum))

    # --- the loop; epoch counts the epochs whose data ran out: a run stopped by --max-steps or a signal is inside it
    timeout_s, step_limit = args.dist_timeout * 60, args.max_steps or math.inf  # else the epochs end the run
    # One eval loader for the whole run: its workers start once, not at every eval
    eval_loader = make_loader(eval_stream, args.num_workers, device, timeout_s, persistent=True) \
        if eval_stream is not None else None
    meter = new_meter(device, amp_dtype, progress)
    if args.budget and not run["path"]:  # a resume continues the stored plan
        plan = plan_budget(args, run, model, trainer, stream, eval_loader, device, amp_ctx, meter)
    if plan.get("budget"):  # the plan's steps end a --budget run, not the epochs
        step_limit = min(step_limit, progress["step"] + round((plan["total"] - run["plan_pos"]) / step_in_plan))
    eval_metrics, train_loss, grad_norm, stopped, last_eval_step = {}, float("nan"), None, False, None
    sums = None  # the loss sums of the last step
    while progress["epoch"] < args.epochs and progress["step"] < step_limit and not stopped:
        start_epoch(stream, progress["epoch"], resume_data, args.num_workers)
        resume_data = None
        # A new loader per epoch: its workers get this epoch's order (from the forkserver: ~0.1 s)
        batches = iter(make_loader(stream, args.num_workers, device, timeout_s))
        data_ended = False
        while progress["step"] < step_limit:
            window, cursors, counts = next_window(batches, args, device, hf_model.config, meter)
            # The one collective per step: every rank's full window? (SUM of 0/1), the global counts, a stop
            full, *totals, g_stop = all_reduce_ctrl([len(window) == args.accum_steps, *counts, len(stop_signal)])
            if full < world_size or g_stop:
                stopped, data_ended = bool(g_stop), not g_stop
                break
            for cursor in cursors:
                stream.consumed(cursor)
            lr = args.lr * lr_factor(plan, run["plan_pos"])
            sums, grad_norm, skipped = train_step(model, optimizer, scaler, [b for b, _ in window], totals[0],
                                                  totals[1], world_size, amp_ctx, args.clip, lr)
            count_step(meter, progress, sums, skipped, lr, totals)
            run["plan_pos"] += step_in_plan
            step = progress["step"]
            if step % args.log_every == 0:
                train_loss = log_interval(log, meter, progress, grad_norm, scaler, args.objective)
            if step % args.log_every == 0 or step % args.rollback_after == 0:
                if (most := most_skipped_in_a_row(meter)) >= args.rollback_after:
                    rollback(run, progress, trainer, meter, sums, most)
            mark(meter, progress, device, run)
            save, export = step % args.save_every == 0, args.export_every and step % args.export_every == 0
            eval_now = eval_loader is not None and step % args.eval_every == 0
            if save or export or eval_now:  # time outside training: left out of the steady rates
                t_pause = clock(device)
                # Weights that just gave a non-finite loss (the step was skipped: they are the ones that gave
                # it) are neither saved nor exported: a rollback to them could not help
                usable = not (save or export) or last_loss_finite(sums)
                if save:
                    checkpoint(args, run, progress, trainer, stream, device, log.runs, usable)
                if export and usable and master and (failed := export_hf(raw_model.hf, tokenizer, out_dir)):
                    warn(f"warning: {failed}; training goes on")
                if eval_now:
                    eval_metrics, last_eval_step = run_eval(raw_model, eval_loader, amp_ctx, args, log, step), step
                meter["paused"] += clock(device) - t_pause
        if data_ended:
            end_epoch(progress, window, batches)
        del batches  # end the workers now, not at interpreter exit

    # --- finish: the last log, checkpoint and eval; the report, summary.json and the Hugging Face folder
    end = clock(device)
    if meter["interval"]["sums"] is not None:  # steps since the last log
        train_loss = log_interval(log, meter, progress, grad_norm, scaler, args.objective)
    if stopped and master:
        say(f"stopped by signal at step {progress['step']} on every rank")
    # A run never ends well on weights whose loss is not finite: they are neither kept nor exported
    end_finite(run, progress, sums is None or last_loss_finite(sums), "training")
    checkpoint(args, run, progress, trainer, stream, device, log.runs)
    if eval_loader is not None and last_eval_step != progress["step"]:
        eval_metrics = run_eval(raw_model, eval_loader, amp_ctx, args, log, progress["step"])
        if not eval_metrics and master:
            warn("warning: the eval set produced no masked tokens; eval skipped")
    end_finite(run, progress, math.isfinite(eval_metrics.get("eval/mlm_loss", 0.0)), "eval")
    eval_loader, failed = None, []  # its persistent workers end here, before the process group does
    if master:
        failed = [e for e in (report(args, run, progress, meter, end, train_loss, eval_metrics, stopped, scaler),
                              export_hf(raw_model.hf, tokenizer, out_dir)) if e]
        log.close()
    leave_group()
    if failed:
        fail(f"{'; '.join(failed)}; the checkpoint holds the weights: free space and run the same command again")


# ----------------------------------------------------------------------------- device

def setup_device(args):
    """This rank's device and autocast dtype (None: fp32). torchrun sets LOCAL_RANK."""
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        # fp32 matmuls on TF32 tensor cores (Ampere and later): torch's default is full precision
        torch.set_float32_matmul_precision("high" if args.tf32 else "highest")
    else:
        device = torch.device("cpu")
        if "OMP_NUM_THREADS" not in os.environ:  # share the cores between the ranks of this machine
            torch.set_num_threads(cores_per_rank())
    return device, choose_amp_dtype(args, device)


def cores_per_rank():
    return max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def default_num_workers(device):
    """--num-workers when not given. One worker streams ~0.4-0.5M tokens/s and BERT-base on an
    H100-class GPU takes ~0.8-1M: a GPU rank gets up to 4, leaving a core for the rank itself. On a
    CPU the model is the bottleneck and a worker takes cores from it: one."""
    return min(4, max(1, cores_per_rank() - 1)) if device.type == "cuda" else 1


def cpu_has_native_bf16():
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        return any(flag in f.read() for flag in ("avx512_bf16", "amx_bf16"))
    return False


def choose_amp_dtype(args, device):
    """The autocast dtype for --amp on this device: None (fp32), torch.bfloat16 or torch.float16."""
    if not args.amp:
        return None
    if device.type == "cuda":
        # bf16 only where tensor cores compute it (is_bf16_supported() says yes on V100/T4, emulating it)
        if args.amp_dtype == "fp16" or (args.amp_dtype == "auto" and
                                        not torch.cuda.is_bf16_supported(including_emulation=False)):
            return torch.float16
        return torch.bfloat16
    if args.amp_dtype == "fp16":
        fail("--amp-dtype fp16 needs a CUDA GPU; on a CPU use --amp-dtype bf16 or no --amp")
    if args.amp_dtype == "auto" and not cpu_has_native_bf16():
        # Measured here: without avx512_bf16/AMX a BERT step in bf16 autocast is ~28x slower.
        if int(os.environ.get("RANK", "0")) == 0:  # before the group exists: RANK is all there is
            warn("warning: --amp on a CPU without native bf16 would be much slower; training in fp32 "
                 "(--amp-dtype bf16 forces it)")
        return None
    return torch.bfloat16


def clock(device):
    """time.perf_counter() once the device has run what was queued: CUDA kernels run behind the host,
    and a clock read before they finish would credit their time to what comes after."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


# Dense peak FLOP/s from the data sheets: (bf16/fp16 tensor cores, TF32, fp32; V100 and T4: no TF32). A key
# matches whole words of the name, the longest first ("H100 PCIe" before "H100"; "T400" is no T4): an unknown
# GPU gets no MFU rather than a wrong one.
GPU_PEAKS = {"GB200": (2500e12, 1250e12, 80e12), "B200": (2250e12, 1100e12, 75e12),
             "H200 NVL": (835e12, 418e12, 60e12), "H200": (989e12, 494e12, 67e12), "GH200": (989e12, 494e12, 67e12),
             "H100 PCIe": (756e12, 378e12, 51e12), "H100 NVL": (835e12, 418e12, 60e12),
             "H100": (989e12, 494e12, 67e12), "A100": (312e12, 156e12, 19.5e12), "A10G": (70e12, 35e12, 31.2e12),
             "A10": (125e12, 62.5e12, 31.2e12), "L40S": (362e12, 183e12, 91.6e12), "L40": (181e12, 90.5e12, 90.5e12),
             "L4": (121e12, 60e12, 30.3e12), "RTX 4090": (165e12, 82.6e12, 82.6e12),
             "RTX 3090": (71e12, 35.6e12, 35.6e12), "V100 PCIe": (112e12, 14e12, 14e12),
             "V100": (125e12, 15.7e12, 15.7e12), "T4": (65e12, 8.1e12, 8.1e12)}


def gpu_peak(name, amp_dtype, tf32):
    """The dense peak of the GPU called `name` for the math the run does, or None when unknown."""
    words = " " + " ".join(re.split(r"[\s_-]+", name.upper())) + " "
    for key in sorted(GPU_PEAKS, key=len, reverse=True):
        if f" {key.upper()} " in words:
            return GPU_PEAKS[key][0 if amp_dtype is not None else 1 if tf32 else 2]
    return None


def peak_flops(device, amp_dtype):
    """Dense peak of the device, for MFU: a table for GPUs, a measured fp32 matmul on CPUs."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        peak = gpu_peak(name, amp_dtype, torch.get_float32_matmul_precision() != "highest")
        if peak is None and GROUP["rank"] == 0:
            warn(f"note: no peak FLOP/s known for {name}: MFU is n/a (add it to GPU_PEAKS)")
        return peak
    # Timed once per machine and thread count and cached (~2.4 s on a core); delete cpu_peak.json to redo it
    path, key = os.path.join(data_stream.CACHE_DIR, "cpu_peak.json"), f"{HOST} {torch.get_num_threads()} threads"
    try:
        with open(path) as f:
            known = json.load(f)
    except (OSError, ValueError):
        known = {}
    if key in known:
        return known[key]
    a = torch.randn(2048, 2048, generator=torch.Generator())  # leaves the global RNG (dropout) alone
    best = float("inf")
    for _ in range(6):  # the best of a few: other processes on the machine only slow it down
        t0 = time.perf_counter()
        torch.mm(a, a)
        best = min(best, time.perf_counter() - t0)
    known[key] = 2 * 2048**3 / best
    with contextlib.suppress(OSError):  # a read-only cache: time it again next launch
        os.makedirs(data_stream.CACHE_DIR, exist_ok=True)
        data_stream.atomic_write(path, lambda f: json.dump(known, f), mode="w")
    return known[key]


# ----------------------------------------------------------------------------- agreement between ranks
# Rank 0 decides, every rank verifies, a rank that disagrees stops every rank with one line naming itself.
# What rank 0 decided travels over the process group (no shared file system), and every yes/no that gates
# a collective is agreed on by all ranks first: no rank waits in a collective the others skipped.
HOST = socket.gethostname()
PREPARE_TIMEOUT = timedelta(hours=24)  # rank 0 may train a tokenizer and count a corpus meanwhile
GROUP = {"rank": 0, "world_size": 1, "store": None, "ctrl": None}
OUT_DIR_LOCK = {}  # rank 0's open lock file of each out dir it runs in (lock_out_dir)


class UserError(Exception):
    """A user mistake: the rank that finds it says it in one line; every rank exits with code 2."""


USER_ERRORS = (UserError, data_stream.CorpusError)


def fail(message):
    raise UserError(message)


def say_error(message):
    where = f"rank {GROUP['rank']} on {HOST}: " if GROUP["world_size"] > 1 else ""
    warn(f"pretrain_ddp.py: error: {where}{message}")


def join_group(device, timeout, newest_step):
    """Create the process group in a namespace every rank of this launch agrees on. torchrun's restarts
    keep the dead group's store, and each agent counts its own restarts (PyTorch issue 135712), so
    neither tells a restarted rank which keys are current: torchrun's rank 0 names a fresh namespace;
    every other rank posts a random nonce and waits for the name under it (only a live rank 0 answers).
    There, rank 0 becomes a process that sees the newest checkpoint (newest_step, in its own out dir):
    a restart that moved torchrun's rank 0 to another node still resumes."""
    rank, world_size = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    GROUP.update(rank=rank, world_size=world_size)
    if world_size == 1:
        return
    store = next(dist.rendezvous("env://", timeout=timeout))[0]
    base = f"bert_ddp/{os.environ.get('TORCHELASTIC_RUN_ID', 'none')}"
    if rank == 0:
        name, answered, deadline = uuid.uuid4().hex, set(), time.monotonic() + timeout.total_seconds()
        store.append(f"{base}/{name}/members", f"{rank}:{newest_step} ")
        store.add(f"{base}/{name}/joined", 1)
        while store.add(f"{base}/{name}/joined", 0) < world_size:
            if store.check([f"{base}/hello"]):
                for nonce in set(store.get(f"{base}/hello").decode().split()) - answered:
                    store.set(f"{base}/welcome/{nonce}", name)  # stale nonces of dead ranks too: harmless
                    answered.add(nonce)
            if time.monotonic() > deadline:
                raise dist.DistStoreError(f"only {store.add(f'{base}/{name}/joined', 0)} of {world_size} ranks "
                                          "joined rank 0 within --dist-timeout")
            time.sleep(0.02)
        store.set(f"{base}/{name}/complete", "1")
    else:
        nonce = uuid.uuid4().hex
        store.append(f"{base}/hello", nonce + " ")
        store.wait([f"{base}/welcome/{nonce}"], timeout)
        name = store.get(f"{base}/welcome/{nonce}").decode()
        store.append(f"{base}/{name}/members", f"{rank}:{newest_step} ")
        store.add(f"{base}/{name}/joined", 1)
        store.wait([f"{base}/{name}/complete"], timeout)
    members = [tuple(map(int, m.split(":"))) for m in store.get(f"{base}/{name}/members").decode().split()]
    order = sorted(members, key=lambda m: (-m[1], m[0]))  # the newest checkpoint first, then torchrun's order
    GROUP["rank"] = rank = [m[0] for m in order].index(rank)
    GROUP["store"] = dist.PrefixStore(f"{base}/{name}", store)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=GROUP["store"], rank=rank,
                            world_size=world_size, timeout=timeout,
                            device_id=device if device.type == "cuda" else None)
    # Control traffic (flags, decisions, the per-step all_reduce) runs on the CPU (gloo) even under
    # nccl: reading its result never waits for the GPU, which keeps queueing kernels ahead.
    GROUP["ctrl"] = dist.new_group(backend="gloo", timeout=timeout) if device.type == "cuda" else None


def newest_local_step(args):
    """The step of the newest checkpoint this process sees in its own out dir, -1 if none."""
    latest = read_latest(os.path.join(args.out_dir or default_out_dir(), "checkpoints"))
    return int(latest[5:]) if latest and args.resume == "auto" else -1


def default_out_dir():
    # torchrun's restarts keep the run id, so they find the same out dir and resume
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "none")
    return f"runs/run-{run_id}" if run_id != "none" else time.strftime("runs/%Y%m%d-%H%M%S")


def gather(value):
    """[(host, value) of rank 0, (host, value) of rank 1, ...] on every rank."""
    items = [(HOST, value)] * GROUP["world_size"]
    if GROUP["world_size"] > 1:
        dist.all_gather_object(items, (HOST, value), group=GROUP["ctrl"])
    return items


def from_rank0(obj):
    """Rank 0's obj on every rank (picklable: plans, names, a checkpoint's tensors)."""
    box = [obj]
    if GROUP["world_size"] > 1:
        dist.broadcast_object_list(box, src=0, group=GROUP["ctrl"])
    return box[0]


def unless_local(mine):
    """Collective: `mine` (None: this rank could not read it) where every rank has it, else rank 0's
    on every rank (rank 0 always has it): sent over the process group only when needed."""
    if any(lacking for _, lacking in gather(mine is None)):
        sent = from_rank0(mine if GROUP["rank"] == 0 else None)
        mine = mine if mine is not None else sent
    return mine


def agree(error):
    """Collective: if any rank has an error (a string), the ranks that found it say it, all exit 2."""
    errors = [e for _, e in gather(error)]
    if any(errors):
        if error and (GROUP["rank"] == 0 or error != errors[0]):  # not a copy of rank 0's line
            say_error(error)
        raise SystemExit(2)


def verify(what, mine):
    """Collective: every rank's `mine` must equal rank 0's; the ranks that differ say how, all exit 2."""
    values = gather(mine)
    host0, theirs = values[0]
    if all(v == theirs for _, v in values):
        return
    if mine != theirs:
        if isinstance(mine, dict):  # name only what differs
            keys = sorted(k for k in set(mine) | set(theirs) if mine.get(k) != theirs.get(k))
            mine, theirs = {k: mine.get(k) for k in keys}, {k: theirs.get(k) for k in keys}
        say_error(f"{what} is not rank 0's: {mine} here, {theirs} on rank 0 ({host0})")
    raise SystemExit(2)


def rank0_prepares(prepare):
    """prepare() on rank 0, its result on every rank. The others wait on the store with a long
    timeout meanwhile (training a tokenizer on a big corpus can take hours), not in a collective
    bounded by --dist-timeout; a user error on rank 0 reaches every rank."""
    result, error = None, None
    if GROUP["rank"] == 0:
        try:
            result = prepare()
        except USER_ERRORS as e:
            error = str(e)
        finally:
            if GROUP["store"] is not None:
                GROUP["store"].set("prepared", "1")
    elif GROUP["store"] is not None:
        GROUP["store"].wait(["prepared"], PREPARE_TIMEOUT)
    agree(error)
    return from_rank0(result)


def all_reduce_ctrl(values):
    """Collective: the elementwise SUM of every rank's values (floats, on the control group)."""
    t = torch.tensor(values, dtype=torch.float64)
    if GROUP["world_size"] > 1:
        dist.all_reduce(t, group=GROUP["ctrl"])
    return t.tolist()


def leave_group():
    """Every rank leaves together (rank 0's writes done, the DataLoader workers ended): one barrier, then
    every group destroyed before teardown. A rank that left while a peer used the group, or a group left
    to teardown, could abort on a gloo thread, and torchrun would report (and restart) a finished job."""
    if dist.is_initialized():
        dist.barrier(group=GROUP["ctrl"])
        dist.destroy_process_group()


# ----------------------------------------------------------------------------- the run: rank 0 decides, all verify

def plan_run(args, world_size, device, amp_dtype, rank0_only):
    """Rank 0 decides the run: out dir, checkpoint, tokenizer, corpus, LR plan. Returns what every
    rank needs (sent over the process group); rank 0's tokenizer, stream, checkpoint and --init-from
    weights go to rank0_only."""
    out_dir = args.out_dir or default_out_dir()
    lock_out_dir(out_dir)
    path, resumed = choose_checkpoint(args, os.path.join(out_dir, "checkpoints"))
    if args.resume == "none" and args.overwrite:
        for old in ("checkpoints", "tokenizer"):
            shutil.rmtree(os.path.join(out_dir, old), ignore_errors=True)
    init, source = None, f"--model-size {args.model_size}"
    if args.init_from and resumed is not None:
        warn(f"note: {out_dir} has checkpoints of its own: resuming them, not --init-from {args.init_from}")
    elif args.init_from:
        kind, folder, init_tokenizer = init_source(args.init_from)
        if init_tokenizer is None and not args.tokenizer:
            fail(f"--init-from {folder} has no tokenizer: give the one its model was trained with (--tokenizer DIR)")
        weights, architecture, notes = load_init(kind, folder, args.objective, args.seed)
        init = {"kind": kind, "folder": folder, "objective": args.objective, "seed": args.seed,
                "checksum": weights_checksum(weights), "tokenizer": init_tokenizer}
        source = f"--init-from {folder}"
        rank0_only["init_weights"] = weights
    tokenizer = run_tokenizer(args, out_dir, resumed, path, init and init["tokenizer"])
    if resumed is not None:
        before, source = resumed["meta"]["config"], f"the checkpoint {path}"
        architecture = before["architecture"]
    elif init is None:
        architecture = new_architecture(args.model_size or "tiny", len(tokenizer), args.max_seq_len,
                                        tokenizer.pad_token_id)
    model_size = size_name(architecture)
    if args.model_size not in (None, model_size):
        fail(f"--model-size {args.model_size} differs from {source}: BERT-{model_size} "
             f"({architecture['num_hidden_layers']} layers, {architecture['hidden_size']} hidden); drop --model-size")
    if args.max_seq_len > architecture["max_position_embeddings"]:
        fail(f"--max-seq-len {args.max_seq_len} exceeds the {architecture['max_position_embeddings']} positions of "
             f"{source}'s model")
    if len(tokenizer) > architecture["vocab_size"]:
        fail(f"the tokenizer has {len(tokenizer)} tokens, the model of {source} embeds {architecture['vocab_size']}")
    if init and notes:
        warn(f"note: {source}: {'; '.join(notes)}")
    stream = make_stream(args, args.corpus, "train", tokenizer, args.seed, True)
    effective_batch = args.batch_size * args.accum_steps * world_size
    config = {**vars(args), "out_dir": out_dir, "world_size": world_size, "device": str(device),
              "model_size": model_size, "architecture": architecture,
              "vocab": len(tokenizer), "tokenizer_path": os.path.join(out_dir, "tokenizer"),
              "amp_dtype": str(amp_dtype).replace("torch.", "") if amp_dtype else "fp32",
              "effective_batch": effective_batch}
    run = {"out_dir": out_dir, "path": path, "sha256": resumed and resumed["sha256"], "corpus_changed": False,
           "fingerprint": stream.fingerprint(), "tokenizer_hash": data_stream.tokenizer_hash(tokenizer), "init": init}
    if resumed is None:
        plan, estimate = new_lr_plan(args, stream, world_size)
        run.update(plan=plan, plan_pos=0.0, estimate=estimate)
    else:
        meta = resumed["meta"]
        changed = [f"{k} (checkpoint {before.get(k, old)!r}, now {config[k]!r})"
                   for k, old in RESUME_MUST_MATCH.items() if before.get(k, old) != config[k]]
        if changed:
            fail(f"cannot resume from {path}: {'; '.join(changed)} differ; use another --out-dir, "
                 "or --resume none --overwrite")
        if meta["fingerprint"] != run["fingerprint"]:
            if not args.allow_corpus_change:
                fail(f"cannot resume from {path}: the corpus changed (checkpoint {meta['fingerprint']}, now "
                     f"{run['fingerprint']}); --allow-corpus-change restarts the epoch on it, or use another --out-dir")
            warn(f"warning: the corpus changed since {path}; epoch {meta['epoch']} restarts on the new corpus")
            run["corpus_changed"] = True
        plan, pos = meta["plan"], meta["plan_pos"]
        if args.budget and not plan.get("budget"):
            fail(f"cannot resume {path} with --budget: its plan counts steps, not time; extend it with --epochs "
                 "or --max-steps, or drop --budget")
        lengths = [(f"--{k.replace('_', '-')}", before.get(k), getattr(args, k)) for k in ("epochs", "max_steps",
                                                                                          "budget")]
        if any(old != new for _, old, new in lengths):
            new = replan(plan, pos, meta["step"], args, effective_batch)
            if lr_factor(new, pos) == 0 and new["total"] > pos:
                fail(f"cannot extend {path}: its LR had decayed to 0, so more steps would not train; start a new "
                     f"plan from its weights: --init-from {out_dir} --out-dir ANOTHER_DIR")
            warn(f"warning: {', '.join(f'{flag} {old} -> {new}' for flag, old, new in lengths if old != new)}: the "
                 f"LR plan now ends after {new['total']:.0f} planned steps, not {plan['total']:.0f}, and goes on "
                 f"from today's LR (never up)")
            plan = new
        if (meta["world_size"], meta["num_workers"]) != (world_size, args.num_workers):
            warn(f"warning: resuming {meta['world_size']} ranks x {meta['num_workers']} workers as {world_size} x "
                 f"{args.num_workers}: the data order is no longer bit-exact (the rest of the epoch is re-sharded; "
                 f"no document is repeated); the LR plan continues, a step now counts as "
                 f"{effective_batch / plan['batch']:.3g} planned steps")
        run.update(plan=plan, plan_pos=pos, estimate=meta["estimate"])
    config["planned_steps"] = run["plan"]["total"]
    kept = os.path.join(out_dir, "tokenizer")
    run.update(config=config, tokenizer_files={})
    for name in os.listdir(kept):
        with open(os.path.join(kept, name), "rb") as f:
            run["tokenizer_files"][name] = f.read()
    rank0_only.update(tokenizer=tokenizer, stream=stream, resumed=resumed)
    return run


def lock_out_dir(out_dir):
    """Rank 0 holds an exclusive flock on <out>/.lock while it lives: a second job into the out dir (a Slurm
    requeue beside the running job) stops before it resumes anything. The kernel drops the lock when the
    process dies, SIGKILL included: never stale (NFSv4 has flock; where it fails, a warning)."""
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        fail(f"--out-dir {out_dir} is a file; give a directory")
    os.makedirs(out_dir, exist_ok=True)
    if os.path.realpath(out_dir) in OUT_DIR_LOCK:  # main() run again by this process (tests)
        return
    f = open(os.path.join(out_dir, ".lock"), "a+")  # kept open (OUT_DIR_LOCK): closing it would unlock
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        fail(f"--out-dir {out_dir} is in use by another job ({f.read().strip() or 'holder unknown'}): let it "
             "finish or stop it, or give another --out-dir")
    except OSError as e:
        warn(f"warning: --out-dir {out_dir} cannot be locked ({e.strerror}): nothing stops a second job from "
             "writing into it")
    f.truncate(0)
    f.write(f"held by host {HOST}, pid {os.getpid()}, since {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
    f.flush()
    OUT_DIR_LOCK[os.path.realpath(out_dir)] = f


def run_tokenizer(args, out_dir, resumed, path, init_tokenizer):
    """Rank 0: the run's tokenizer, kept as <out>/tokenizer. WordPiece training differs from one
    process to the next, so it happens once per run, here; a resume loads the kept one, an
    --init-from run the source's."""
    kept, hash_of = os.path.join(out_dir, "tokenizer"), data_stream.tokenizer_hash
    if args.tokenizer:
        tokenizer, source = data_stream.get_tokenizer(args.tokenizer), f"--tokenizer {args.tokenizer}"
        if init_tokenizer and hash_of(data_stream.get_tokenizer(init_tokenizer)) != hash_of(tokenizer):
            fail(f"--tokenizer {args.tokenizer} is not the tokenizer of --init-from {args.init_from} "
                 f"({init_tokenizer}), whose embeddings are that one's: drop --tokenizer")
    elif init_tokenizer:
        tokenizer, source = data_stream.get_tokenizer(init_tokenizer), f"--init-from's {init_tokenizer}"
    elif os.path.isdir(kept):
        tokenizer, source = data_stream.get_tokenizer(kept), kept
    else:
        corpus = data_stream.open_corpus(args.corpus, "train", args.objective, args.text_field, args.max_doc_bytes,
                                         args.language)
        tokenizer = data_stream.get_tokenizer(None, corpus, args.vocab_size, args.tokenizer_sample_mb)
        source = f"trained on --corpus {args.corpus}"
    before = resumed["meta"]["tokenizer_hash"] if resumed else None
    if before not in (None, hash_of(tokenizer)):
        fail(f"cannot resume from {path}: it trained with tokenizer {before}, this run's ({source}) is "
             f"{hash_of(tokenizer)}; give the run's own (--tokenizer {kept}) or another --out-dir")
    if not os.path.isdir(kept) or hash_of(data_stream.get_tokenizer(kept)) != hash_of(tokenizer):
        replace_folder(kept, tokenizer.save_pretrained)
    return data_stream.get_tokenizer(kept)


def load_run(args, run, rank0_only):
    """Every rank: the tokenizer and streams of rank 0's run, verified equal on every rank.
    Returns (tokenizer, train stream, eval stream or None)."""
    tokenizer, stream, error = rank0_only.get("tokenizer"), rank0_only.get("stream"), None
    if stream is None:  # not rank 0: its tokenizer came over the process group, the corpus is local
        try:
            with tempfile.TemporaryDirectory() as tmp:
                for name, data in run["tokenizer_files"].items():
                    with open(os.path.join(tmp, name), "wb") as f:
                        f.write(data)
                tokenizer = data_stream.get_tokenizer(tmp)
            stream = make_stream(args, args.corpus, "train", tokenizer, args.seed, True)
        except USER_ERRORS as e:
            error = str(e)
    agree(error)
    verify("the tokenizer", data_stream.tokenizer_hash(tokenizer))
    verify(f"the corpus of --corpus {args.corpus}", stream.fingerprint())
    eval_corpus = args.eval_corpus or ("builtin" if args.corpus == "builtin" else "none")
    eval_stream, eval_state = None, None
    if eval_corpus != "none":
        try:
            eval_stream = make_stream(args, eval_corpus, "eval", tokenizer, EVAL_SEED, False)
            eval_state = eval_stream.fingerprint()
        except data_stream.CorpusError as e:
            eval_state = str(e)
    elif GROUP["rank"] == 0 and args.eval_corpus is None:
        warn("warning: no evaluation: give --eval-corpus for a held-out set")
    states = [state for _, state in gather(eval_state)]
    if eval_corpus != "none" and all(isinstance(state, str) for state in states):
        if GROUP["rank"] == 0:
            warn(f"warning: no evaluation: --eval-corpus {eval_corpus}: {states[0]}")
        return tokenizer, stream, None
    agree(f"--eval-corpus {eval_corpus}: {eval_state} (rank 0 has it; every rank needs the same eval set)"
          if isinstance(eval_state, str) else None)
    verify(f"the eval corpus of --eval-corpus {eval_corpus}", eval_state)
    return tokenizer, stream, eval_stream


def fetch(mine, path, read, same):
    """Collective: what rank 0 read from path (mine; None elsewhere) on every rank. A rank that can read the
    same files (same() compares with rank 0's checksums) reads them itself, ~15x faster than receiving
    them pickled over gloo (BENCHMARKS.md); if any rank cannot, rank 0 sends them to all."""
    if mine is None and os.path.exists(path):
        try:
            mine = read()
        except USER_ERRORS:
            mine = None
        if mine is not None and not same(mine):
            mine = None  # another checkpoint or model under the same name (node-local out dirs)
    return unless_local(mine)


# ----------------------------------------------------------------------------- --init-from: weights only
# BERT's phase 2 and continued pretraining start from trained weights with a new optimizer, LR plan and
# step 0, in the source's shape; a head the source lacks starts fresh, seeded (the same on every rank).
HEADS = ("cls.", "bert.pooler.")


def init_source(path):
    """(kind, folder, its tokenizer folder or None) named by --init-from PATH; kind: checkpoint or hf."""
    latest = read_latest(os.path.join(path, "checkpoints"))
    if latest:  # a run's out dir
        path = os.path.join(path, "checkpoints", latest)
    elif os.path.isfile(os.path.join(path, "hf", "config.json")):  # a run's out dir without checkpoints
        path = os.path.join(path, "hf")
    if os.path.isfile(os.path.join(path, "manifest.json")):
        tokenizer = os.path.join(os.path.dirname(os.path.dirname(os.path.normpath(path))), "tokenizer")
        return "checkpoint", path, tokenizer if os.path.isdir(tokenizer) else None
    if os.path.isfile(os.path.join(path, "config.json")):
        try:
            with open(os.path.join(path, "config.json")) as f:
                model_type = json.load(f).get("model_type")
        except (OSError, ValueError, AttributeError) as e:
            fail(f"--init-from {path}: its config.json cannot be read ({e})")
        if model_type != "bert":
            fail(f"--init-from {path} holds a {model_type} model; this script trains BERT (model_type bert)")
        has_tokenizer = any(os.path.isfile(os.path.join(path, n)) for n in ("tokenizer.json", "vocab.txt"))
        return "hf", path, path if has_tokenizer else None
    fail(f"--init-from {path} is not a checkpoint folder, a run's out dir or a Hugging Face BERT folder "
         "(config.json + weights)")


def load_init(kind, folder, objective, seed):
    """The source's weights as this run's model holds them: (state_dict, architecture, notes)."""
    from transformers import BertForMaskedLM, BertForPreTraining
    from transformers.utils import logging as hf_logging
    torch.manual_seed(seed)  # fresh heads: the same on every rank
    if kind == "checkpoint":
        loaded, problem = read_checkpoint(folder)
        if loaded is None:
            fail(f"--init-from {folder} cannot be used: {problem}")
        architecture = loaded["meta"]["config"]["architecture"]
        model = model_from(architecture, objective, 0.0)
        missing, unexpected = model.load_state_dict(loaded["trainer.pt"]["model"], strict=False)
    else:
        verbosity = hf_logging.get_verbosity()
        hf_logging.set_verbosity_error()  # its load report: the notes below say what matters, in one line
        hf_logging.disable_progress_bar()
        try:
            model, info = (BertForPreTraining if objective == "nsp" else BertForMaskedLM).from_pretrained(
                folder, dtype=torch.float32, output_loading_info=True)
        except (OSError, ValueError) as e:
            fail(f"--init-from {folder} cannot be loaded: {str(e).strip().splitlines()[0]}")
        finally:
            hf_logging.set_verbosity(verbosity)
        missing, unexpected = info["missing_keys"], info["unexpected_keys"]
        keep = set(new_architecture("tiny", 1, 1, 0)) | {"hidden_act", "type_vocab_size", "layer_norm_eps",
                                                          "initializer_range", "position_embedding_type"}
        architecture = {k: v for k, v in model.config.to_dict().items() if k in keep}
    body = sorted(k for k in missing if not k.startswith(HEADS))
    if body:
        fail(f"--init-from {folder} lacks {len(body)} weights of the BERT body (e.g. {body[0]}); is it a BERT model?")
    notes = []
    if any(k.startswith("cls.predictions.transform") for k in missing):
        notes.append("the MLM head starts fresh (the source has none)")
    if any(k.startswith(("cls.seq_relationship", "bert.pooler")) for k in missing):
        notes.append("the NSP head starts fresh (the source trained without NSP)")
    if any(k.startswith(("cls.seq_relationship", "pooler", "bert.pooler")) for k in unexpected):
        notes.append("its NSP head is left out (--objective mlm)")
    return model.state_dict(), architecture, notes


# ----------------------------------------------------------------------------- the learning-rate plan
# Planned once (from the estimate, or --budget's calibration), stored in every checkpoint. Positions count
# steps at the planned effective batch: on another world size a step advances by its share of it.

def new_lr_plan(args, stream, world_size):
    settings = (stream, world_size, args.num_workers, args.batch_size, args.accum_steps)
    epochs = args.epochs
    if args.max_steps is not None:  # estimate only the epochs --max-steps can reach (not e.g. --epochs 100000)
        first = estimate_steps.estimate(*settings, 1)
        epochs = min(epochs, math.ceil(args.max_steps / max(first["total_steps"], 1)) + 1)
    est = estimate_steps.estimate(*settings, epochs, warmup=args.warmup, schedule=args.schedule, decay=args.decay)
    total = est["total_steps"] if args.max_steps is None else min(args.max_steps, est["total_steps"] or 1)
    return plan_of(args, total, est["total_steps"] / epochs, args.batch_size * args.accum_steps * world_size), est


def plan_of(args, total, steps_per_epoch, batch):
    """The plan of `total` steps: warmup, then from decay_from = [position, factor] down to 0 at the total."""
    warmup = estimate_steps.warmup_steps(args.warmup, total)
    return {"total": total, "warmup": warmup, "batch": batch, "steps_per_epoch": steps_per_epoch,
            "schedule": args.schedule, "decay": args.decay,
            "decay_from": [estimate_steps.decay_start(args.schedule, args.decay, warmup, total), 1.0]}


def lr_factor(plan, pos):
    """Linear warmup to 1; the factor of decay_from = [position, factor] until that position (wsd's stable
    phase), then down to 0 at the total: linear, or cosine. Plans from before --schedule are linear."""
    if pos < plan["warmup"]:
        return (pos + 1) / plan["warmup"]
    start, factor = plan["decay_from"]
    done = min(max(pos - start, 0) / max(plan["total"] - start, 1), 1.0)
    return factor * (0.5 * (1 + math.cos(math.pi * done)) if plan.get("schedule") == "cosine" else 1 - done)


def replan(plan, pos, step, args, batch):
    """--epochs, --max-steps or --budget changed on resume: the plan ends elsewhere, and the LR never jumps:
    a wsd plan in its stable phase keeps its peak and decays over the new end's --decay; a decaying plan
    decays from today's LR; a plan in its warmup keeps it."""
    total = args.epochs * plan["steps_per_epoch"]
    if args.max_steps is not None:
        total = min(total, pos + (args.max_steps - step) * batch / plan["batch"])
    if plan.get("budget") and args.budget:  # the stored step time: a resume never measures again
        total = min(total, plan["total"] + (args.budget - plan["budget"]["seconds"]) / plan["budget"]["step_s"])
    if plan.get("schedule") == "wsd" and pos < plan["decay_from"][0]:  # stable (or warming up): peak, then decay
        decay_from = [max(pos, estimate_steps.decay_start("wsd", plan["decay"], plan["warmup"], total)), 1.0]
    else:  # in its warmup a linear/cosine plan keeps the decay's start; a decaying plan goes on from today's LR
        decay_from = plan["decay_from"] if pos < plan["warmup"] else [pos, lr_factor(plan, pos)]
    return {**plan, "total": total, "decay_from": decay_from}


CALIBRATION = (3, 10)  # --budget: steps before the timed ones (worker start, allocator, compile), steps timed


def plan_budget(args, run, model, trainer, stream, eval_loader, device, amp_ctx, meter):
    """Collective, --budget: every rank runs real steps (3 untimed) and an eval, rank 0 a save; rank 0
    times them and plans the steps that fit (the calibration counted, eval and saves by their share),
    capped by --epochs and --max-steps. Weights, optimizer, loss scale, RNG and data are then as
    before: step 1 runs on the final plan, which every checkpoint carries (a resume never measures)."""
    raw_model, optimizer, scaler = trainer
    before = [{k: v.to("cpu", copy=True) for k, v in raw_model.state_dict().items()}, scaler.state_dict(),
              rng_states(device)]  # and the optimizer's state: none yet
    times = [clock(device)]
    start_epoch(stream, 0, None, args.num_workers)
    batches = iter(make_loader(stream, args.num_workers, device, args.dist_timeout * 60))
    while len(times) <= sum(CALIBRATION):
        window, _, counts = next_window(batches, args, device, raw_model.hf.config, meter)
        full, *totals, _ = all_reduce_ctrl([len(window) == args.accum_steps, *counts, 0])
        if full < GROUP["world_size"]:
            break
        train_step(model, optimizer, scaler, [b for b, _ in window], totals[0], totals[1], GROUP["world_size"],
                   amp_ctx, args.clip, args.lr * lr_factor(run["plan"], 0))
        times.append(clock(device))
    del batches
    warm = min(CALIBRATION[0], len(times) - 2) if len(times) > 1 else 0
    step_s = (times[-1] - times[warm]) / max(len(times) - 1 - warm, 1) if len(times) > 1 else math.inf
    if eval_loader is not None:
        evaluate(raw_model, eval_loader, device, amp_ctx, GROUP["world_size"], args.objective == "nsp")
    marks, tmp = [clock(device)], os.path.join(run["out_dir"], ".budget-calibration")
    if GROUP["rank"] == 0:  # a checkpoint's write, deleted (an export, a third of it, is counted as one)
        state = {"model": raw_model.hf.state_dict(), "optimizer": optimizer.state_dict()}
        save_checkpoint(tmp, 0, {"trainer.pt": state}, {}, 1)
        shutil.rmtree(tmp)
    marks.append(clock(device))
    raw_model.load_state_dict(before[0])
    optimizer.state.clear()
    scaler.load_state_dict(before[1])
    set_rng_states(before[2], device)
    meter.update(interval=new_interval(), data_wait=0.0)
    spent = marks[-1] - times[0]
    per_step = step_s + (marks[0] - times[-1]) / args.eval_every + (marks[1] - marks[0]) * \
        (1 / args.save_every + (1 / args.export_every if args.export_every else 0))
    fit = int(max(args.budget - spent, 0) // per_step)
    budget = {"seconds": args.budget, "step_s": per_step, "train_step_s": step_s, "calibration_s": spent,
              "steps_fit": fit, "limit": "budget" if fit < run["plan"]["total"] else "epochs"}
    plan = from_rank0({**plan_of(args, min(fit, run["plan"]["total"]), run["plan"]["steps_per_epoch"],
                                 run["plan"]["batch"]), "budget": budget})
    agree(f"--budget {estimate_steps.hours(args.budget)} holds no step: the calibration took {spent:.1f} s and a "
          f"step takes {per_step:.3g} s here" if plan["total"] < 1 and GROUP["rank"] == 0 else None)
    run["plan"], run["config"]["planned_steps"] = plan, plan["total"]
    if GROUP["rank"] == 0:
        announce_budget(run)
    return plan


# ----------------------------------------------------------------------------- checkpoints
# <out>/checkpoints/step_000400/{trainer.pt, ranks.pt, manifest.json} and <out>/checkpoints/latest. Written
# into a hidden folder, every file fsynced, the manifest (sha256s) last, then renamed into place: a crash
# leaves the previous one usable, a damaged one fails its checksums. Loads are torch.load(weights_only=True).
# Fields a resume must share with the checkpoint (the corpus: its fingerprint; the tokenizer: its hash):
RESUME_MUST_MATCH = {"model_size": None, "objective": None, "max_seq_len": None, "vocab": None, "seed": None,
                     "schedule": "linear"}  # (what a checkpoint without the field had)


def save_checkpoint(root, step, files, meta, keep_last):
    """Write {name: object} atomically as root/step_<step>; keep the newest keep_last complete ones."""
    name = f"step_{step:06d}"
    tmp, final = os.path.join(root, f".tmp-{name}"), os.path.join(root, name)
    os.makedirs(root, exist_ok=True)
    shutil.rmtree(tmp, ignore_errors=True)  # a leftover of a crash during an earlier save
    os.makedirs(tmp)
    try:
        for file_name, obj in files.items():
            _write(os.path.join(tmp, file_name), lambda f, obj=obj: torch.save(obj, f))
        manifest = {"meta": meta, "sha256": {f: _sha256(os.path.join(tmp, f)) for f in files}}
        _write(os.path.join(tmp, "manifest.json"), lambda f: f.write(json.dumps(manifest, indent=1).encode()))
        _fsync_dir(tmp)
    except BaseException:  # e.g. the disk is full: no half-written folder stays
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    # The pointer moves first: a crash before the rename leaves it naming a missing step, and --resume auto
    # takes the newest complete one below it (moved after, the new checkpoint would look abandoned)
    point_latest(root, name)
    if os.path.exists(final):  # the same step saved twice (e.g. a resumed run's final save)
        old = os.path.join(root, f".old-{name}")
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)  # a crash before the next rename leaves only .old-: choose_checkpoint restores it
        os.rename(tmp, final)
        shutil.rmtree(old)
    else:
        os.rename(tmp, final)
    _fsync_dir(root)
    for old in sorted((d for d in os.listdir(root) if d.startswith("step_")), key=lambda d: int(d[5:]))[:-keep_last]:
        shutil.rmtree(os.path.join(root, old), ignore_errors=True)
    return final


def _write(path, write):
    with open(path, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256(path):
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def point_latest(root, name):
    data_stream.atomic_write(os.path.join(root, "latest"), lambda f: f.write(name.encode()))


def read_latest(root):
    """The name of the checkpoint that root/latest points to ('step_000400'), None if none."""
    try:
        with open(os.path.join(root, "latest")) as f:
            name = f.read().strip()
    except OSError:
        return None
    return name if name.startswith("step_") and name[5:].isdigit() else None


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
    return {"meta": manifest["meta"], "sha256": manifest["sha256"], **files}, None


def choose_checkpoint(args, root):
    """Rank 0's choice: (path, checkpoint) to resume, or (None, None). `latest` names the timeline: a
    step_* newer than the checkpoint resumed (abandoned by a rollback to an older step, or damaged) goes
    to checkpoints/abandoned/ with a warning, never resumed nor counted by --keep-last."""
    for d in os.listdir(root) if os.path.isdir(root) else []:
        if d.startswith(".old-step_"):  # a re-save crashed between its renames (save_checkpoint)
            if os.path.isdir(os.path.join(root, d[5:])):
                shutil.rmtree(os.path.join(root, d))
            else:
                os.rename(os.path.join(root, d), os.path.join(root, d[5:]))
    steps = {int(d[5:]): d for d in (os.listdir(root) if os.path.isdir(root) else [])
             if d.startswith("step_") and d[5:].isdigit()}
    if args.resume == "none":
        if steps and not args.overwrite:
            fail(f"--out-dir {os.path.dirname(root)} holds checkpoints: --resume auto continues from them, "
                 "--overwrite deletes them, or choose another --out-dir")
        return None, None
    path, loaded = None, None
    if args.resume == "auto":
        latest = read_latest(root)
        newest = int(latest[5:]) if latest else None
        for s in sorted((s for s in steps if newest is None or s <= newest), reverse=True):
            loaded, problem = read_checkpoint(os.path.join(root, steps[s]))
            if loaded is not None:
                path = os.path.join(root, steps[s])
                break
            warn(f"warning: checkpoint {os.path.join(root, steps[s])} is damaged ({problem}); trying an older one")
        newest = loaded["meta"]["step"] if loaded else newest
    else:
        path = args.resume
        if not os.path.isdir(path):
            fail(f"--resume {path} is not a checkpoint folder (or auto, none)")
        loaded, problem = read_checkpoint(path)
        if loaded is None:
            fail(f"--resume {path} cannot be used: {problem}")
        newest = loaded["meta"]["step"]
    abandoned = sorted(s for s in steps if newest is not None and s > newest)
    for s in abandoned:
        aside = os.path.join(root, "abandoned", steps[s])
        shutil.rmtree(aside, ignore_errors=True)
        os.makedirs(os.path.dirname(aside), exist_ok=True)
        os.rename(os.path.join(root, steps[s]), aside)
    if abandoned:
        warn(f"warning: checkpoint(s) of step {', '.join(map(str, abandoned))} are newer than the timeline "
             f"resumed here (step {newest}); moved to {os.path.join(root, 'abandoned')}")
    if path is not None and os.path.realpath(os.path.dirname(path)) == os.path.realpath(root):
        point_latest(root, os.path.basename(os.path.normpath(path)))
    return path, loaded


def checkpoint(args, run, progress, trainer, stream, device, tracker_runs, loss_finite=True):
    """Collective: every rank's RNG and data cursor go to rank 0, which writes the checkpoint
    atomically. A step saved already is not saved again (the final save after a save at that step), nor
    weights that gave a non-finite loss (loss_finite false: no rollback target)."""
    if run.get("saved_at") == [progress["step"], progress["epoch"]]:
        return
    run["saved_at"] = [progress["step"], progress["epoch"]]
    mine = {"rng": rng_states(device), "data": stream.state_dict()}
    gathered = [None] * GROUP["world_size"] if GROUP["rank"] == 0 else None
    if GROUP["world_size"] > 1:
        dist.gather_object(mine, gathered, dst=0, group=GROUP["ctrl"])
    else:
        gathered = [mine]
    error, root = None, os.path.join(run["out_dir"], "checkpoints")
    if GROUP["rank"] == 0:
        meta = {**progress, "world_size": GROUP["world_size"], "num_workers": args.num_workers,
                "config": run["config"], "plan": run["plan"], "plan_pos": run["plan_pos"],
                "estimate": run["estimate"], "tokenizer_hash": run["tokenizer_hash"],
                "fingerprint": run["fingerprint"], "tracker_runs": tracker_runs}
        raw_model, optimizer, scaler = trainer
        state = {"model": raw_model.hf.state_dict(), "optimizer": optimizer.state_dict(),
                 "scaler": scaler.state_dict()}
        latest, step = read_latest(root), progress["step"]
        kept = f"{os.path.join(root, latest)} is the newest complete checkpoint" if latest else "no checkpoint yet"
        save = functools.partial(save_checkpoint, root, step, {"trainer.pt": state, "ranks.pt": gathered}, meta,
                                 args.keep_last)
        if not torch.stack([torch.isfinite(p).all() for p in raw_model.parameters()]).all():
            error = f"the weights at step {step} are not finite: not saved; {kept}"
        elif not loss_finite:
            say(f"not saved at step {step}: the weights gave a non-finite loss in the last step; {kept}")
        elif error := data_stream.try_write(lambda: say(f"saved {save()}"), f"checkpoint step_{step:06d} into {root}",
                                            root, nbytes(state)):
            error += f"; {kept}: free space and run the same command again to resume there"
    agree(error)  # one line from rank 0, every rank stops


def restore(resumed, corpus_changed, raw_model, optimizer, scaler, device, num_workers):
    """Load the resumed checkpoint into this rank, before the DDP wrap: DDP's start-up broadcast
    would hide a rank that loaded something else. Returns the progress counters and this rank's
    data cursor (None: the epoch starts from its beginning)."""
    progress = {"step": 0, "epoch": 0, "samples_seen": 0, "tokens_seen": 0, "flops_done": 0.0,
                "unused_per_epoch": [], "train_seconds": 0.0, "rollbacks": 0}
    if resumed is None:
        return progress, None
    meta, ranks = resumed["meta"], resumed["ranks.pt"]
    load_trainer(resumed["trainer.pt"], raw_model, optimizer, scaler)
    progress.update({k: meta.get(k, progress[k]) for k in progress})
    if corpus_changed:
        return progress, None
    if (meta["world_size"], meta["num_workers"]) == (GROUP["world_size"], num_workers):
        set_rng_states(ranks[GROUP["rank"]]["rng"], device)
        return progress, ranks[GROUP["rank"]]["data"]
    return progress, data_stream.BertPretrainStream.merge_states([r["data"] for r in ranks])


def load_trainer(state, raw_model, optimizer, scaler):
    raw_model.hf.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    if scaler.is_enabled() and state["scaler"]:
        scaler.load_state_dict(state["scaler"])
    elif scaler.is_enabled() and GROUP["rank"] == 0:
        warn("note: the checkpoint trained without fp16: a fresh GradScaler starts")


def most_skipped_in_a_row(meter):
    """Collective: the most steps skipped in a row since the last call. Every rank skipped the same steps
    (their all-reduced gradients are the same); agreed all the same, since it decides a collective."""
    skips = meter["skips"]
    most = all_reduce_ctrl([float(skips[2])])[0] / GROUP["world_size"]
    skips[2] = skips[1]
    return most


def last_loss_finite(sums):
    """Collective: did the last step give a finite loss on every rank? A step whose loss was not finite was
    skipped, so the weights now are the ones that gave it."""
    return all_reduce_ctrl([float(not torch.isfinite(sums[0] + sums[2]))])[0] == 0


def rollback(run, progress, trainer, meter, sums, most):
    """Collective: --rollback-after steps in a row had an inf/NaN gradient (skipped). Every rank loads the
    newest checkpoint's weights, optimizer and loss scale, and goes on with the data after those steps (not
    replayed), the step count and LR plan too. No checkpoint is saved while the loss is not finite, so a
    second rollback to the same one means the steps right after it failed again: it did not help. Then,
    or with no checkpoint, the run stops (that checkpoint moved aside: a re-run resumes the one before)."""
    root, step = os.path.join(run["out_dir"], "checkpoints"), progress["step"]
    path = from_rank0(read_latest(root) and os.path.join(root, read_latest(root)))
    what = "a non-finite loss" if not last_loss_finite(sums) else "an inf/NaN gradient"
    skipped = f"{most:.0f} steps in a row up to step {step} had {what} (skipped)"
    error = None
    if GROUP["rank"] == 0 and path is None:
        error = "there is no checkpoint to roll back to"
    elif GROUP["rank"] == 0 and run.get("rolled_back_to") == path:
        error = f"a rollback to {path} did not help (the steps after it were skipped again); " + abandon(root, path)
    agree(f"{skipped}, and {error}: lower --lr or --clip, raise --warmup, or look at the data of these steps"
          if error else None)
    mine = read_checkpoint(path)[0] if GROUP["rank"] == 0 else None
    sha = from_rank0(mine and mine["sha256"])
    loaded = fetch(mine, path, lambda: read_checkpoint(path)[0], lambda c: c["sha256"] == sha)
    load_trainer(loaded["trainer.pt"], *trainer)
    run["rolled_back_to"], progress["rollbacks"] = path, progress["rollbacks"] + 1
    run["saved_at"] = [step, progress["epoch"]]  # these are the weights of path: not saved again at this step
    meter["skips"][1:] = 0
    if GROUP["rank"] == 0:
        say(f"{skipped}: rolled the weights and optimizer back to {path}; the data goes on after step "
            f"{step} (the batches since step {loaded['meta']['step']} are not replayed)")


def end_finite(run, progress, finite, what):
    """Collective, at the end: a run whose last weights gave a non-finite loss stops with one line, its final
    checkpoint (if saved already) moved aside, no export."""
    root, step = os.path.join(run["out_dir"], "checkpoints"), progress["step"]
    error = None
    if GROUP["rank"] == 0 and not finite:
        saved = read_latest(root) == f"step_{step:06d}" and run.get("saved_at", [None])[0] == step
        error = (f"the {what} loss at the end (step {step}) is not finite: the model is not exported; "
                 + (abandon(root, os.path.join(root, f"step_{step:06d}")) if saved else "no checkpoint is saved")
                 + "; lower --lr or --clip, raise --warmup, or look at the data of the last steps")
    agree(error)


def abandon(root, path):
    """Rank 0: move a checkpoint whose weights failed aside (checkpoints/abandoned/), `latest` to the one
    before it; returns the line that says so."""
    aside = os.path.join(root, "abandoned", os.path.basename(path))
    shutil.rmtree(aside, ignore_errors=True)
    os.makedirs(os.path.dirname(aside), exist_ok=True)
    os.rename(path, aside)
    older = sorted((d for d in os.listdir(root) if d.startswith("step_") and d[5:].isdigit()), key=lambda d: int(d[5:]))
    if older:
        point_latest(root, older[-1])
    else:
        os.remove(os.path.join(root, "latest"))
    return f"it is moved to {aside}" + (f"; a re-run resumes {os.path.join(root, older[-1])}" if older else "")


def nbytes(obj):
    """Bytes of the tensors in a (nested) state dict: about what its checkpoint file takes."""
    if torch.is_tensor(obj):
        return obj.numel() * obj.element_size()
    values = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) else ()
    return sum(nbytes(v) for v in values)


def weights_checksum(state_dict):
    digest = hashlib.sha256()
    for tensor in state_dict.values():
        digest.update(tensor.detach().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()[:16]


def rng_states(device):
    """This rank's torch RNG states, which dropout draws from (nothing draws from Python's or
    NumPy's global RNG: the stream's masking and shuffling have generators of their own)."""
    return {"torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None}


def set_rng_states(states, device):
    torch.set_rng_state(states["torch"])
    if device.type == "cuda" and states["cuda"] is not None:
        torch.cuda.set_rng_state(states["cuda"], device)


def export_hf(hf_model, tokenizer, out_dir):
    """A Hugging Face folder (safetensors + tokenizer), written aside and renamed into place. Returns
    None, or the one line saying why it could not be written (a full disk: the old folder stays)."""
    from transformers.utils import logging as hf_logging
    hf_logging.disable_progress_bar()

    def write(folder):
        hf_model.save_pretrained(folder, safe_serialization=True)
        tokenizer.save_pretrained(folder)
    final = os.path.join(out_dir, "hf")
    return data_stream.try_write(lambda: replace_folder(final, write), f"the Hugging Face export {final}", out_dir,
                                 nbytes(hf_model.state_dict()))


def replace_folder(final, write):
    """write(folder) into a temporary folder beside final, then put in its place: never a half-written
    folder (for an instant, none: a checkpoint's save has its own steps for that)."""
    tmp = os.path.join(os.path.dirname(final), ".tmp-" + os.path.basename(final))
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        write(tmp)
    except BaseException:  # e.g. a full disk: the old folder stays, no half-written one
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(final, ignore_errors=True)
    os.rename(tmp, final)


# ----------------------------------------------------------------------------- meter and logging

STEADY_AFTER = 5  # steps at the start of a run that the steady rates leave out (workers, first batches, compile)


def new_meter(device, amp_dtype, progress):
    """What logs and report measure: the interval since the last log; for the steady rates the training
    clock (without eval, saves and exports: "paused") at marks after 1 and STEADY_AFTER steps."""
    return {"interval": new_interval(), "peak": peak_flops(device, amp_dtype), "t_start": time.perf_counter(),
            "start": (progress["step"], progress["tokens_seen"], progress["flops_done"]), "marks": {},
            "paused": 0.0, "data_wait": 0.0, "computed": 0, "train_base": progress["train_seconds"],
            # skipped steps (non-finite gradients): in all, in a row now, the most in a row since the last check
            "skips": torch.zeros(3, device=device)}


def new_interval():
    return {"sums": None, "samples": 0, "tokens": 0, "flops": 0.0, "wait": 0.0,
            "t0": time.perf_counter(), "lr": None}  # count_step sets it


def count_step(meter, progress, sums, skipped, lr, totals):
    """Count a step done: totals are its global (masked, samples, tokens, flops, positions computed);
    sums its loss sums."""
    masked, samples, tokens, flops, computed = totals
    meter["computed"] += computed
    skips = meter["skips"]  # on the device: read at log steps
    skips[0] += skipped
    skips[1] = (skips[1] + skipped) * skipped
    skips[2] = torch.maximum(skips[2], skips[1])
    progress["step"] += 1
    progress["samples_seen"] += samples
    progress["tokens_seen"] += tokens
    progress["flops_done"] += flops
    progress["train_seconds"] = meter["train_base"] + time.perf_counter() - meter["t_start"]
    interval = meter["interval"]
    # the loss sums and counts of the steps applied, on the device (a skipped step's loss may be NaN)
    sums = torch.where(skipped > 0, 0.0, torch.cat([sums, torch.stack([skipped * 0 + masked, skipped * 0 + samples])]))
    interval["sums"] = sums if interval["sums"] is None else interval["sums"] + sums
    for key, value in (("samples", samples), ("tokens", tokens), ("flops", flops)):
        interval[key] += value
    interval["lr"] = lr


def rates(seconds, steps, tokens, flops, peak, world_size):
    seconds = max(seconds, 1e-9)
    return {"tokens_per_sec": tokens / seconds, "steps_per_hour": steps / seconds * 3600,
            "mfu": flops / seconds / (peak * world_size) if peak else None}


def log_interval(log, meter, progress, grad_norm, scaler, objective):
    """Log the scalars of the steps since the last call; returns the train loss over them (the steps
    skipped for an inf/NaN gradient left out)."""
    interval, world_size, skips = meter["interval"], GROUP["world_size"], meter["skips"]
    loss_sums = torch.cat([interval["sums"], skips[:1]]).double()
    if world_size > 1:
        dist.all_reduce(loss_sums)  # the loss of all ranks, not rank 0's: one sync per log
    mlm_loss, _, nsp_loss, _, masked, samples, skipped = loss_sums.tolist()
    masked, samples = masked / world_size, samples / world_size  # the global counts, on every rank
    elapsed = time.perf_counter() - interval["t0"]
    speed = rates(elapsed, 0, interval["tokens"], interval["flops"], meter["peak"], world_size)
    mlm_loss = mlm_loss / masked if masked else float("nan")  # nan: every step of the interval was skipped
    nsp_loss = nsp_loss / samples if samples else float("nan")
    scalars = {"train/loss": mlm_loss + nsp_loss, "train/mlm_loss": mlm_loss, "train/lr": interval["lr"],
               "train/grad_norm": float(grad_norm), "train/tokens_per_sec": speed["tokens_per_sec"],
               "train/samples_per_sec": interval["samples"] / elapsed,
               "train/data_wait": interval["wait"] / elapsed, "train/epoch": progress["epoch"]}
    if objective == "nsp":
        scalars["train/nsp_loss"] = nsp_loss
    if scaler.is_enabled():
        scalars["train/loss_scale"] = scaler.get_scale()
    if skipped:
        scalars["train/skipped_steps"] = skipped / world_size  # this run's, in all
    if speed["mfu"] is not None:
        scalars["train/mfu"] = speed["mfu"]
    log(scalars, progress["step"])
    meter["interval"] = new_interval()
    return mlm_loss + nsp_loss


def run_eval(raw_model, eval_loader, amp_ctx, args, log, step):
    metrics = evaluate(raw_model, eval_loader, next(raw_model.parameters()).device, amp_ctx,
                       GROUP["world_size"], args.objective == "nsp")
    log(metrics, step)
    return metrics


def announce(args, run, raw_model, device, progress):
    """Rank 0's first lines: the config, the model, the plan, where the weights came from."""
    config, plan, estimate = run["config"], run["plan"], run["estimate"]
    n_params = sum(p.numel() for p in raw_model.parameters())
    say(f"config: {json.dumps(config)}")
    say(f"model: BERT-{config['model_size']} {args.objective}, {n_params / 1e6:.2f}M parameters; world size "
        f"{config['world_size']} on {device.type}; effective batch {config['effective_batch']} "
        f"({args.batch_size} x {config['world_size']} ranks x {args.accum_steps} accum)")
    say(f"planned {plan['total']:.0f} steps (estimate, {estimate['mode']}: {estimate['total_steps']} steps for "
        f"{estimate['epochs']} epoch(s)" + (f", capped by --max-steps {args.max_steps})" if args.max_steps else ")")
        + f"; {plan.get('schedule', 'linear')} LR, warmup {plan['warmup']} steps, decay from "
        f"{plan['decay_from'][0]:.0f}")
    if run["path"] and plan.get("budget"):
        announce_budget(run)
    if run["path"]:
        say(f"resumed from {run['path']} at step {progress['step']}, epoch {progress['epoch']}")
    elif run["init"]:
        say(f"initialised from {run['init']['folder']} (weights only: new optimizer and LR plan, step 0)")


def announce_budget(run):
    plan = run["plan"]
    budget, epochs = plan["budget"], plan["total"] / max(plan["steps_per_epoch"], 1)
    say(f"--budget {estimate_steps.hours(budget['seconds'])}: a step takes {budget['train_step_s']:.3g} s here, "
        f"{budget['step_s']:.3g} s with eval, checkpoints and exports by their share; the calibration took "
        f"{budget['calibration_s']:.1f} s: planned {plan['total']:,} steps ({epochs:.2f} epochs), LR decay from step "
        f"{plan['decay_from'][0]:.0f}" + ("" if budget["limit"] == "budget" else f"; {budget['steps_fit']:,} steps "
                                          "would fit: the data of --epochs / --max-steps ends the run first"))


def mark(meter, progress, device, run):
    """The steady rates' marks after 1 and STEADY_AFTER steps of this run. At the second, a --budget run
    says where its plan lands at this machine's speed (a resume on slower hardware keeps its plan)."""
    done, budget, plan = progress["step"] - meter["start"][0], run["plan"].get("budget"), run["plan"]
    if done in (1, STEADY_AFTER):
        meter["marks"][done] = (clock(device) - meter["paused"], progress["step"], progress["tokens_seen"],
                                progress["flops_done"])
    if done == STEADY_AFTER and budget and GROUP["rank"] == 0:
        step_s = (meter["marks"][done][0] - meter["marks"][1][0]) / (done - 1) + budget["step_s"] - budget[
            "train_step_s"]
        left = (plan["total"] - run["plan_pos"]) * plan["batch"] / run["config"]["effective_batch"]
        ends = progress["train_seconds"] + left * step_s
        say(f"--budget: {left:,.0f} steps left at {step_s:.3g} s a step here (planned at {budget['step_s']:.3g} s): "
            f"training ends after {estimate_steps.hours(ends)}, {ends / budget['seconds'] - 1:+.1%} off the budget")


def report(args, run, progress, meter, end, train_loss, eval_metrics, stopped, scaler):
    """Rank 0's end-of-run lines and summary.json."""
    step, tokens_seen, flops_done = progress["step"], progress["tokens_seen"], progress["flops_done"]
    start, peak, world_size, plan = meter["start"], meter["peak"], GROUP["world_size"], run["plan"]
    elapsed, train_clock = end - meter["t_start"], end - meter["paused"]
    total_steps, effective = round(plan["total"]), run["config"]["effective_batch"]
    overall = rates(elapsed, step - start[0], tokens_seen - start[1], flops_done - start[2], peak, world_size)
    # Steady: after STEADY_AFTER steps (1 in a run under 2 x STEADY_AFTER), without eval, saves and exports
    mark = meter["marks"].get(STEADY_AFTER if step - start[0] >= 2 * STEADY_AFTER else 1)
    steady = rates(train_clock - mark[0], step - mark[1], tokens_seen - mark[2], flops_done - mark[3], peak,
                   world_size) if mark and step > mark[1] else overall
    eta_h = total_steps / steady["steps_per_hour"] if steady["steps_per_hour"] else float("nan")
    wait_share = meter["data_wait"] / max(train_clock - meter["t_start"], 1e-9)
    padding = 1 - (tokens_seen - start[1]) / max(meter["computed"], 1)
    print(f"per-rank batch {args.batch_size} x {world_size} ranks, accumulation {args.accum_steps}, "
          f"effective batch {effective}, max seq len {args.max_seq_len}; padding {padding:.1%} of the positions "
          "computed" + (" (pairs packed into rows)" if args.objective == "nsp" and args.packing else ""))
    print(f"iterations {step - start[0]}, time taken {elapsed:.1f} s; steady rates "
          + (f"from step {mark[1]} on" if steady is not overall else "(too few steps: the overall ones)")
          + f", without eval and saves: micro-batches/hour {steady['steps_per_hour'] * args.accum_steps:,.0f} "
          f"=> effective batches/hour {steady['steps_per_hour']:,.0f}")
    mfu = f"{steady['mfu']:.1%}" if steady["mfu"] is not None else "n/a"
    print(f"ran {step} steps (planned {total_steps}); estimated total time for the planned steps: "
          f"{eta_h:.2f} h; {steady['tokens_per_sec']:,.0f} tokens/s, MFU {mfu} (both of the real tokens) "
          f"(overall, start-up included: {overall['tokens_per_sec']:,.0f} tokens/s)")
    print(f"data wait: {wait_share:.1%} of the training time on rank 0 (DataLoader workers per rank: "
          f"{args.num_workers}" + ("; the data is the bottleneck: more --num-workers, or --build-cache first)"
                                   if wait_share > 0.1 else ")"))
    skips, budget, trained = int(meter["skips"][0]), plan.get("budget"), progress["train_seconds"]
    if skips or progress["rollbacks"]:
        print(f"{skips} step(s) skipped for an inf/NaN gradient" + (f" (fp16 overflows: the loss scale is now "
              f"{scaler.get_scale():g})" if scaler.is_enabled() else "") + f"; rollbacks: {progress['rollbacks']}")
    if budget:
        print(f"--budget {estimate_steps.hours(budget['seconds'])}: trained {estimate_steps.hours(trained)} "
              f"({trained / budget['seconds'] - 1:+.1%}), the calibration included")
    summary = {"steps": step, "planned_steps": total_steps, "epochs_done": progress["epoch"],
               "train_loss": None if math.isnan(train_loss) else train_loss, "eval": eval_metrics,
               "samples_seen": progress["samples_seen"], "tokens_seen": tokens_seen,
               **steady, "steady_from_step": mark[1] if steady is not overall else None,
               **{f"{k}_overall": v for k, v in overall.items()}, "data_wait_share": wait_share,
               "padding_share": padding, "world_size": world_size, "effective_batch": effective, "time_s": elapsed,
               "unused_samples_per_epoch": progress["unused_per_epoch"], "stopped_by_signal": stopped,
               "skipped_steps": skips, "rollbacks": progress["rollbacks"],
               "train_seconds": trained, "budget": budget, "estimate": run["estimate"],
               "lr_plan": plan, "lr_plan_position": run["plan_pos"]}
    path = os.path.join(run["out_dir"], "summary.json")
    return data_stream.try_write(lambda: data_stream.atomic_write(path, lambda f: json.dump(summary, f, indent=1), "w"),
                                 path, run["out_dir"])


def say(line):
    print(line, flush=True)


def warn(line):
    print(line, file=sys.stderr, flush=True)


class Logger:
    """logger(scalars, step) writes to each sink of --log-to; close() at the end. runs: the
    experiment trackers' run ids (trackers.py), kept in the checkpoints: given the resumed
    checkpoint's, each tracker continues its run; one that fails is dropped with one warning line."""

    def __init__(self, log_to, out_dir, config, runs):
        self.stdout, self.writer, self.trackers, self.runs = "stdout" in log_to, None, None, dict(runs)
        if "tensorboard" in log_to:
            from torch.utils.tensorboard import SummaryWriter
            self.writer = SummaryWriter(out_dir)
            self.writer.add_text("config", json.dumps(config, indent=1))
        if {"mlflow", "wandb"} & set(log_to):
            import trackers  # only here: the core runs without the trackers' packages
            self.trackers = trackers.Trackers([n for n in log_to if n in trackers.STARTS], out_dir, config, self.runs,
                                              say, warn)

    def __call__(self, scalars, step):
        if self.stdout:
            say(f"step {step}: " + ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                                             for k, v in scalars.items()))
        if self.writer is not None:
            for k, v in scalars.items():
                self.writer.add_scalar(k, v, step)
        if self.trackers:
            self.trackers(scalars, step)

    def close(self):
        if self.writer is not None:
            self.writer.close()
        if self.trackers:
            self.trackers.close()


# ----------------------------------------------------------------------------- data loading

def make_stream(args, corpus, split, tokenizer, seed, shuffle):
    return data_stream.stream_from_args(args, corpus, split, tokenizer, seed, shuffle, GROUP["rank"],
                                        GROUP["world_size"])


def make_loader(stream, num_workers, device, timeout_s, persistent=False):
    return data_stream.make_loader(stream, num_workers, device.type == "cuda", timeout_s, sparse_targets, persistent)


def start_epoch(stream, epoch, resume_data, num_workers):
    """The stream at the start of the epoch, or where the resumed checkpoint left it."""
    if resume_data is not None and resume_data["epoch"] == epoch:
        stream.load_state_dict(resume_data, num_workers)
    else:
        stream.set_epoch(epoch)


def next_window(batches, args, device, hf_config, meter):
    """Up to --accum-steps micro-batches on the device: ([(batch, samples)], their cursors, this rank's
    [masked, samples, tokens, flops, positions computed]); the time waited goes to the meter."""
    t_wait = time.perf_counter()
    window, cursors, totals = [], [], [0, 0, 0, 0.0, 0]
    for raw in batches:
        cursors.append(raw.pop("cursor"))
        batch, counts = prepare(raw, device, dynamic=args.compile)
        window.append((batch, counts["num_samples"]))
        for i, value in enumerate((counts["num_masked"], counts["num_samples"], counts["num_tokens"],
                                   train_flops(hf_config, counts), counts["num_computed"])):
            totals[i] += value
        if len(window) == args.accum_steps:
            break
    waited = time.perf_counter() - t_wait
    meter["interval"]["wait"] += waited
    meter["data_wait"] += waited
    return window, cursors, totals


def end_epoch(progress, window, batches):
    """Collective: the epoch ended for all ranks at the same step; count what each rank had to leave."""
    left = sum(samples for _, samples in window) + sum(b["num_samples"] for b in batches)
    progress["unused_per_epoch"].append([unused for _, unused in gather(left)])
    if GROUP["rank"] == 0:
        say(f"epoch {progress['epoch']} ended at step {progress['step']}; samples left unused per rank: "
            f"{progress['unused_per_epoch'][-1]}")
    progress["epoch"] += 1


def exit_now(code):
    """End the process without the interpreter's teardown (its work done and said): teardown destroys C++
    objects in no set order, and a joinable std::thread destroyed there aborts a finished rank (1 of 9
    short 2-rank jobs under load, 0 of 50 with this exit: BENCHMARKS.md section 14)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def die_with_launcher():
    """torchrun starts every rank in a session of its own, so a SIGKILL to its agent (or to the agent's
    process group; the OOM killer) would leave the ranks training on as orphans, writing checkpoints. On
    Linux the kernel sends a rank SIGTERM when its agent dies: the graceful stop (every rank saves at the
    next step and exits). An agent that died before this call left the rank another parent. Plain
    python has no agent: it keeps running when its shell exits (nohup), as it should."""
    if "TORCHELASTIC_RUN_ID" not in os.environ or not sys.platform.startswith("linux"):
        return
    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)
    if os.getppid() != LAUNCHER_PID:
        say_error(f"its torchrun agent (pid {LAUNCHER_PID}) ended before this rank started")
        exit_now(1)


def release_frames(error):
    """main()'s frames, kept by the error that left them, go now, and with them their DataLoaders: the
    workers end, and the semaphores of their queues are unlinked (exit_now skips the finalizers that would:
    multiprocessing's resource_tracker then warns of "leaked semaphore objects" after our one line). A
    frame can also be held in a reference cycle (an exception kept in a local of a frame it passed
    through: try_write's), which only the collector frees."""
    error.__traceback__ = None
    gc.collect()


def cli(argv=None):
    """main() with its ends: each kind of failure in one line, a process that ends without teardown."""
    die_with_launcher()
    data_stream.check_versions("pretrain_ddp.py")
    try:
        main(argv)
    except USER_ERRORS as e:  # found before the ranks could agree (in the flags): each node says it once
        if GROUP["store"] is not None or int(os.environ.get("LOCAL_RANK", "0")) == 0:
            say_error(str(e))
        release_frames(e)
        exit_now(2)
    except SystemExit as e:  # the ranks agreed to stop (agree/verify): they leave together
        release_frames(e)
        if e.code == 2:
            leave_group()
        if e.code is not None and not isinstance(e.code, int):
            print(e.code, file=sys.stderr)
        exit_now(e.code if isinstance(e.code, int) else 1 if e.code is not None else 0)
    except RuntimeError as e:  # a peer died or timed out: which rank noticed, in one line
        message = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        if message.startswith("DataLoader timed out"):
            say_error(f"no batch from this rank's DataLoader workers within --dist-timeout ({message}); a worker "
                      "hung, or the corpus reads too slowly for that timeout")
            release_frames(e)
            exit_now(1)
        if not isinstance(e, dist.DistError) and "gloo" not in message and "NCCL" not in message:
            raise  # not the process group's: a bug, keep its traceback
        say_error(f"lost the other ranks ({message[:300]}); the first error above, from another rank or "
                  "from torchrun, says why")
        release_frames(e)
        exit_now(1)
    exit_now(0)


if __name__ == "__main__":
    cli()
