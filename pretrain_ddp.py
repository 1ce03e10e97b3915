"""
Pretrain a BERT from scratch with DistributedDataParallel, on one CPU, one GPU or many.

    python pretrain_ddp.py                                   # tiny BERT on the builtin corpus
    torchrun --nproc_per_node 4 pretrain_ddp.py --amp        # 4 GPUs (or 4 CPU processes)
    torchrun --nnodes 2 --nproc_per_node 8 --rdzv-backend c10d --rdzv-endpoint host0:29500 \\
        --rdzv-id bert1 --max-restarts 3 pretrain_ddp.py --amp   # on each of two nodes
    tensorboard --logdir runs

Top to bottom: the flags; the records of the run's state; main(), the run as a story (decide the run, build
or restore, the loop, finish); the pieces of one loop iteration, in the order it calls them; then, in sections,
the machinery main() calls (the device, agreement between ranks, the run's decision, the LR plan, checkpoints,
the report, the data, the process's ends). The model itself is model.py.
"""

import argparse
import contextlib
import ctypes
import dataclasses
import gc
import hashlib
import importlib
import inspect
import json
import math
import multiprocessing.util
import os
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import NamedTuple

# The process that started this one (torchrun's agent, a shell), read before the seconds that importing torch
# takes: an agent that dies meanwhile is seen by die_with_launcher


LAUNCHER_PID = os.getppid()

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

import data_stream  # noqa: E402
import estimate_steps  # noqa: E402
import trackers  # noqa: E402
import workers  # noqa: E402
from checkpoints import (  # noqa: E402
    CheckpointError,
    abandon,
    choose_checkpoint,
    export_hf,
    init_source,
    load_init,
    lock_out_dir,
    nbytes,
    read_checkpoint,
    read_latest,
    replace_folder,
    save_checkpoint,
    step_name,
    step_of,
)
from estimate_steps import Budget, LRPlan, lr_factor, plan_of  # noqa: E402
from model import (  # noqa: E402
    DISC_WEIGHT,
    GENERATOR_SIZE,
    MODEL_SIZES,
    ElectraPair,
    Pretraining,
    family_name,
    gpu_peak,
    model_from,
    new_architecture,
    new_optimizer,
    prepare,
    size_name,
    sparse_targets,
    train_flops,
)
from ranks import (  # noqa: E402
    GROUP,
    HOST,
    agree,
    all_reduce_ctrl,
    from_rank0,
    gather,
    join_group,
    leave_group,
    rank0_prepares,
    say_error,
    unless_local,
    verify,
)

EVAL_SEED = 12345  # the eval set is masked the same way in every run, so numbers compare
STEADY_AFTER = 5  # steps at the start of a run that the steady rates leave out (workers, first batches, compile)
CALIBRATION = (3, 10)  # --budget: steps before the timed ones (worker start, allocator, compile), steps timed


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
    model.add_argument("--arch", default=None, choices=["bert", "modernbert"],
                       help="bert: the 2018 block; modernbert: ModernBERT's (Warner et al. 2024: pre-LayerNorm, "
                            "no biases, GeGLU, RoPE, a 128-token band in two layers of three), --objective mlm only; "
                            "default bert, or --init-from's")
    model.add_argument("--model-size", default=None, choices=MODEL_SIZES,
                       help="BERT size (Turc et al. 2019 / BERT; modernbert: the same layers, width and heads, "
                            "about the same parameters); default tiny, or the size of --init-from's model")
    model.add_argument("--init-from", default=None, metavar="PATH",
                       help="start from these weights (new optimizer, LR plan, step 0): a checkpoint folder, a "
                            "run's out dir (its latest checkpoint) or a Hugging Face BERT folder (config.json + "
                            "weights); its tokenizer too, unless --tokenizer. For BERT's phase 2 (e.g. 128 -> 512 "
                            "tokens) and continued pretraining. A run that has checkpoints of its own resumes those")
    model.add_argument("--dropout", type=number(float, 0, 1, high_open=True), default=0.1,
                       help="hidden and attention dropout")
    model.add_argument("--generator-size", type=number(float, 0, low_open=True), default=None, metavar="FRACTION",
                       help=f"--objective electra: the generator's width as a fraction of the model's (at most 1; "
                            f"default {GENERATOR_SIZE}, the paper's best at 1/4 to 1/2)")
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
    if args.arch == "modernbert" and args.objective != "mlm":
        fail(f"--arch modernbert trains with --objective mlm, not {args.objective}"
             + (" (the default): ModernBERT has no segment embeddings and no pooler for NSP; add --objective mlm"
                if args.objective == "nsp" else ": ELECTRA here is transformers' BERT-shaped Electra pair"))
    if args.objective != "electra" and args.generator_size is not None:
        fail(f"--generator-size applies to --objective electra only, not {args.objective}: drop it")
    if args.objective == "electra":
        args.generator_size = args.generator_size or GENERATOR_SIZE  # a checkpoint keeps the value used
        if args.generator_size > 1:
            fail(f"--generator-size {args.generator_size} makes the generator wider than the model it trains; "
                 "ELECTRA's works best at 1/4 to 1/2: give at most 1")
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


# ----------------------------------------------------------------------------- the run's state, typed
# What lives across functions is one of these records, with its fields here. A checkpoint keeps Progress and
# the LR plan as plain values (dataclasses.asdict), under the names they always had: a checkpoint of an older
# version resumes, and one of this version reads without this file.

@dataclass(frozen=True)
class Run:
    """What rank 0 decided for the run (plan_run), sent to every rank, which verifies what it can."""
    out_dir: str
    config: dict            # the settings every checkpoint keeps (flags, architecture, world) and TensorBoard shows
    estimate: dict          # estimate_steps' answer that the LR plan was made from
    fingerprint: str        # the corpus's
    tokenizer_hash: str
    tokenizer_files: dict   # file name -> bytes: a rank that cannot read rank 0's out dir loads the tokenizer so
    resume_path: str | None = None      # the checkpoint resumed (None: a new run)
    resume_sha256: dict | None = None   # its files' checksums: a rank that reads it itself checks them
    corpus_changed: bool = False        # resumed with --allow-corpus-change: the epoch restarts
    init: dict | None = None            # --init-from: kind, folder, objective, seed, checksum, tokenizer


@dataclass
class Rank0Only:
    """What rank 0 read while deciding (plan_run); never sent: the other ranks read their own or receive it."""
    tokenizer: object = None
    stream: object = None
    resumed: dict | None = None       # the checkpoint resumed, read
    init_weights: dict | None = None  # --init-from's state dict


@dataclass
class Progress:
    """Where the run is. Every checkpoint's meta holds these fields; a resume restores them."""
    step: int = 0
    epoch: int = 0              # epochs whose data ran out: a run stopped by --max-steps or a signal is inside one
    samples_seen: int = 0
    tokens_seen: int = 0        # real tokens, not padding
    flops_done: float = 0.0
    unused_per_epoch: list = field(default_factory=list)  # per epoch: the samples each rank had to leave
    train_seconds: float = 0.0  # the training clock of the run, over all its processes
    rollbacks: int = 0
    plan_pos: float = 0.0       # the position in the LR plan

    @classmethod
    def from_meta(cls, meta):
        return cls(**{f.name: meta[f.name] for f in dataclasses.fields(cls) if f.name in meta})


@dataclass
class Trainer:
    """The model in its wrappers and what updates it, with this process's last save and rollback."""
    raw_model: Pretraining      # checkpoints and exports read raw_model.hf: never a wrapper's prefix
    model: torch.nn.Module      # raw_model, compiled (--compile), in DDP (more than one rank)
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler  # fp16's loss scale; disabled otherwise
    amp_ctx: contextlib.AbstractContextManager  # torch.autocast, or nothing
    saved_at: tuple | None = None       # (step, epoch) of this process's last save: a step is not saved twice
    rolled_back_to: str | None = None   # the checkpoint this process last rolled back to


class Mark(NamedTuple):
    """The training clock and the counters at a step: rates are taken between two marks."""
    clock: float
    step: int
    tokens: int
    flops: float


@dataclass
class Interval:
    """The steps since the last log: count_step adds to it, log_interval reads it and starts the next one."""
    sums: torch.Tensor | None = None  # on the device: loss sums, masked tokens and samples of the steps applied
    samples: int = 0
    tokens: int = 0
    flops: float = 0.0
    wait: float = 0.0                 # seconds waited for batches
    lr: float = 0.0
    t0: float = field(default_factory=time.perf_counter)


@dataclass
class Meter:
    """What the logs and the report measure. The steady rates read the training clock (eval, saves and exports
    left out: paused) at marks after 1 and STEADY_AFTER steps. Skipped steps are counted on the device, where
    the step learns it (knowing it on the host would cost a sync per step): read at log steps and every
    --rollback-after steps."""
    peak: float | None               # the device's dense peak FLOP/s (None: unknown, no MFU)
    start: Mark                      # where this process began (a resume begins mid-run)
    train_base: float                # the run's training clock before this process
    skipped: torch.Tensor            # steps skipped for an inf/NaN gradient, in all
    skipped_in_a_row: torch.Tensor   # ... in a row now
    most_in_a_row: torch.Tensor      # ... the most in a row since the last check
    interval: Interval = field(default_factory=Interval)
    marks: dict = field(default_factory=dict)  # steps done by this process -> Mark
    paused: float = 0.0              # seconds of eval, saves and exports
    data_wait: float = 0.0           # seconds waited for batches
    computed: int = 0                # positions computed: real tokens and padding


class UserError(Exception):
    """A user mistake: the rank that finds it says it in one line; every rank exits with code 2."""


USER_ERRORS = (UserError, data_stream.CorpusError, CheckpointError)


def fail(message):
    raise UserError(message)


def say(line):
    print(line, flush=True)


def warn(line):
    print(line, file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- main(): the run as a story

def main(argv=None):
    # --- decide the run: rank 0 decides (out dir, checkpoint, tokenizer, LR plan); every rank verifies it
    args = parse_args(argv)
    validate(args)
    device, amp_dtype = setup_device(args)
    join_group(device, timedelta(minutes=args.dist_timeout), newest_local_step(args))
    master = GROUP.rank == 0
    verify("the command line", vars(args))
    if args.num_workers is None:  # rank 0's machine decides: every rank must shard the data alike
        args.num_workers = from_rank0(default_num_workers(device))
    rank0_only = Rank0Only()
    run, plan = rank0_prepares(lambda: plan_run(args, device, amp_dtype, rank0_only), USER_ERRORS)
    tokenizer, stream, eval_stream = load_run(args, run, rank0_only)

    # --- build or restore: model, optimizer, the resumed state (loaded before the DDP wrap, verified on every rank)
    trainer = new_trainer(args, run, rank0_only, device, amp_dtype)
    progress, resume_data, tracker_runs = restore(run, rank0_only, trainer, device, args.num_workers)
    verify("the step and weights", (progress.step, weights_checksum(trainer.raw_model.state_dict())))
    if args.compile:
        trainer.model = torch.compile(trainer.model)
    if GROUP.world_size > 1:
        trainer.model = wrap_ddp(trainer.model, device)
    step_in_plan = run.config["effective_batch"] / plan.batch  # 1 unless resumed on another world size
    log = trackers.Logger(args.log_to.split(",") if master else [], run.out_dir, run.config, tracker_runs, say, warn)
    if master:
        announce(args, run, plan, trainer.raw_model, device, progress)
    stop_signal = []  # SIGTERM/SIGINT: every rank stops at the same step (the per-step all_reduce says it)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda signum, frame: stop_signal.append(signum))

    # --- the loop; it ends when the epochs' data, --max-steps or the budget's plan does, or at a signal
    timeout_s = args.dist_timeout * 60
    # One eval loader for the whole run: its workers start once, not at every eval
    eval_loader = make_loader(eval_stream, args.num_workers, device, timeout_s, persistent=True) \
        if eval_stream is not None else None
    meter = new_meter(device, amp_dtype, progress)
    if args.budget and not run.resume_path:  # a resume continues the stored plan
        plan = plan_budget(args, run, plan, trainer, stream, eval_loader, device, meter)
    step_limit = args.max_steps or math.inf
    if plan.budget:  # the plan's steps end a --budget run, not the epochs
        step_limit = min(step_limit, progress.step + round((plan.total - progress.plan_pos) / step_in_plan))
    eval_metrics = {}
    last_eval_step = None
    train_loss = float("nan")  # of the steps since the last log
    last_step = None  # the last step's (loss sums, grad norm, skipped), as device tensors
    stopped = False
    while progress.epoch < args.epochs and progress.step < step_limit and not stopped:
        start_epoch(stream, progress.epoch, resume_data, args.num_workers)
        resume_data = None
        # A new loader per epoch: its workers get this epoch's order (from the forkserver: ~0.1 s)
        batches = iter(make_loader(stream, args.num_workers, device, timeout_s))
        data_ended = False
        while progress.step < step_limit:
            window, cursors, counts = next_window(batches, args, device, trainer.raw_model.hf, meter)
            # The one collective per step: every rank's full window? (SUM of 0/1), the global counts, a stop
            full, *totals, stops = all_reduce_ctrl([len(window) == args.accum_steps, *counts, len(stop_signal)])
            if full < GROUP.world_size or stops:
                stopped = stops > 0
                data_ended = not stopped
                break
            for cursor in cursors:
                stream.consumed(cursor)
            lr = args.lr * lr_factor(plan, progress.plan_pos)
            last_step = train_step(trainer, [batch for batch, _ in window], loss_divisors(args.objective, totals),
                                   GROUP.world_size, args.clip, lr)
            count_step(meter, progress, last_step, lr, totals)
            progress.plan_pos += step_in_plan
            if progress.step % args.log_every == 0:
                train_loss = log_interval(log, meter, progress, last_step.grad_norm, trainer.scaler, args.objective)
            if progress.step % args.log_every == 0 or progress.step % args.rollback_after == 0:
                most_skipped = most_skipped_in_a_row(meter)
                if most_skipped >= args.rollback_after:
                    rollback(run, progress, trainer, meter, last_step, most_skipped)
            mark(meter, progress, device, run, plan)
            save = progress.step % args.save_every == 0
            export = args.export_every and progress.step % args.export_every == 0
            eval_now = eval_loader is not None and progress.step % args.eval_every == 0
            if save or export or eval_now:  # time outside training: left out of the steady rates
                t_pause = clock(device)
                # Weights that just gave a non-finite loss (the step was skipped: they are the ones that gave
                # it) are neither saved nor exported: a rollback to them could not help
                usable = not (save or export) or last_loss_finite(last_step)
                if save:
                    checkpoint(args, run, plan, progress, trainer, stream, device, log.runs, usable)
                if export and usable and master:
                    failed = export_hf(trainer.raw_model.hf, tokenizer, run.out_dir)
                    if failed:  # a full disk: the checkpoints and the run matter more than the export
                        warn(f"warning: {failed}; training goes on")
                if eval_now:
                    eval_metrics = run_eval(trainer, eval_loader, args, log, progress.step)
                    last_eval_step = progress.step
                meter.paused += clock(device) - t_pause
        if data_ended:
            end_epoch(progress, window, batches)
        del batches  # end the workers now, not at interpreter exit

    # --- finish: the last log, checkpoint and eval; the report, summary.json and the Hugging Face folder
    end = clock(device)
    if meter.interval.sums is not None:  # steps since the last log
        train_loss = log_interval(log, meter, progress, last_step.grad_norm, trainer.scaler, args.objective)
    if stopped and master:
        say(f"stopped by signal at step {progress.step} on every rank")
    # A run never ends well on weights whose loss is not finite: they are neither kept nor exported
    end_finite(run, progress, trainer, last_step is None or last_loss_finite(last_step), "training")
    checkpoint(args, run, plan, progress, trainer, stream, device, log.runs)
    if eval_loader is not None and last_eval_step != progress.step:
        eval_metrics = run_eval(trainer, eval_loader, args, log, progress.step)
        if not eval_metrics and master:
            warn("warning: the eval set produced no masked tokens; eval skipped")
    end_finite(run, progress, trainer, math.isfinite(eval_metrics.get("eval/mlm_loss", 0.0)), "eval")
    eval_loader = None  # its persistent workers end here, before the process group does
    errors = []  # of the writes at the end (a full disk): said once every rank has left
    if master:
        errors.append(report(args, run, plan, progress, meter, end, train_loss, eval_metrics, stopped, trainer))
        errors.append(export_hf(trainer.raw_model.hf, tokenizer, run.out_dir))
        log.close()
    leave_group()
    if any(errors):
        fail(f"{'; '.join(filter(None, errors))}; the checkpoint holds the weights: free space and run the same "
             "command again")


# ----------------------------------------------------------------------------- one iteration of the loop, in its order

def next_window(batches, args, device, hf_model, meter):
    """Up to --accum-steps micro-batches on the device: ([(batch, samples)], their cursors, this rank's
    [masked, samples, tokens, flops, positions computed]); the time waited goes to the meter."""
    t_wait = time.perf_counter()
    window = []
    cursors = []
    totals = [0, 0, 0, 0.0, 0]
    for raw in batches:
        cursors.append(raw.pop("cursor"))
        batch, counts = prepare(raw, device, dynamic=args.compile)
        window.append((batch, counts["num_samples"]))
        for i, value in enumerate((counts["num_masked"], counts["num_samples"], counts["num_tokens"],
                                   train_flops(hf_model, counts), counts["num_computed"])):
            totals[i] += value
        if len(window) == args.accum_steps:
            break
    waited = time.perf_counter() - t_wait
    meter.interval.wait += waited
    meter.data_wait += waited
    return window, cursors, totals


def loss_divisors(objective, totals):
    """What the forward's two loss sums are divided by, from a step's global (masked, samples, tokens, ...):
    mlm's by the masked tokens; nsp's by the pairs; electra's discriminator loss (over every real token) by
    the real tokens, weighed by DISC_WEIGHT (the paper's) in the sum that trains both models."""
    masked, samples, tokens = totals[:3]
    if objective == "electra":
        return max(masked, 1), max(tokens, 1) / DISC_WEIGHT
    return max(masked, 1), max(samples, 1)


class StepResult(NamedTuple):
    """What a step leaves, as device tensors (reading them on the host would wait for the device)."""
    sums: torch.Tensor       # (mlm loss, mlm correct, nsp loss, nsp correct), summed over the window; electra:
                             # (generator's mlm loss, its correct, discriminator's loss, its correct)
    grad_norm: torch.Tensor
    skipped: torch.Tensor    # 1.0: the gradient was inf or NaN, the step was not applied


def train_step(trainer, window, divisors, world_size, clip, lr):
    """One optimizer step at learning rate lr over a window of micro-batches. A skipped step (an inf/NaN
    gradient) still counts as a step, as in the Trainer and nanoGPT: knowing it on the host would cost a sync.
    Each micro-batch's loss is its sum of token losses over the *global* count that divisors give (the masked
    tokens for mlm: loss_divisors; x world_size: DDP averages over ranks), so the gradient is one big batch's,
    however the tokens fall."""
    model, optimizer, scaler = trainer.model, trainer.optimizer, trainer.scaler
    for group in optimizer.param_groups:
        group["lr"] = lr
    sums = None
    for i, batch in enumerate(window):
        last = i == len(window) - 1
        sync = contextlib.nullcontext() if last or not isinstance(model, DDP) else model.no_sync()
        with sync:  # all-reduce gradients only once per window, on its last backward
            with trainer.amp_ctx:
                out = model(**batch)
            loss = (out[0] / divisors[0] + out[2] / divisors[1]) * world_size
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
    # DDP's gradients are views into its buckets (gradient_as_bucket_view): zeroed, not set to None, which
    # would make DDP allocate new gradient tensors and copy them out of its buckets at every step
    optimizer.zero_grad(set_to_none=not isinstance(model, DDP))
    return StepResult(sums, grad_norm, skipped)


def count_step(meter, progress, step, lr, totals):
    """Count a step done: totals are its global (masked, samples, tokens, flops, positions computed)."""
    masked, samples, tokens, flops, computed = totals
    meter.computed += computed
    # skipped steps, on the device: the in-a-row count falls back to 0 at a step applied
    meter.skipped += step.skipped
    meter.skipped_in_a_row = (meter.skipped_in_a_row + step.skipped) * step.skipped
    meter.most_in_a_row = torch.maximum(meter.most_in_a_row, meter.skipped_in_a_row)
    progress.step += 1
    progress.samples_seen += samples
    progress.tokens_seen += tokens
    progress.flops_done += flops
    progress.train_seconds = meter.train_base + time.perf_counter() - meter.start.clock
    # The loss sums and counts of the steps applied (a skipped step's loss may be NaN), on the device: the
    # counts are filled in there (a copy from the host would wait for the device)
    counts = torch.stack([step.skipped.new_full((), n) for n in (masked, samples, tokens)])
    applied = torch.where(step.skipped > 0, 0.0, torch.cat([step.sums, counts]))
    interval = meter.interval
    interval.sums = applied if interval.sums is None else interval.sums + applied
    interval.samples += samples
    interval.tokens += tokens
    interval.flops += flops
    interval.lr = lr


def log_interval(log, meter, progress, grad_norm, scaler, objective):
    """Log the scalars of the steps since the last call; returns the train loss over them (the steps
    skipped for an inf/NaN gradient left out)."""
    interval, world_size = meter.interval, GROUP.world_size
    loss_sums = torch.cat([interval.sums, meter.skipped[None]]).double()
    if world_size > 1:
        dist.all_reduce(loss_sums)  # the loss of all ranks, not rank 0's: one sync per log
    mlm_loss, _, second_loss, _, masked, samples, tokens, skipped = loss_sums.tolist()
    masked /= world_size  # the global counts, on every rank
    samples /= world_size
    tokens /= world_size
    elapsed = time.perf_counter() - interval.t0
    speed = rates(elapsed, 0, interval.tokens, interval.flops, meter.peak, world_size)
    mlm_loss = mlm_loss / masked if masked else float("nan")  # nan: every step of the interval was skipped
    # the second loss as it is trained: nsp's per pair; electra's discriminator's per token, weighed
    divisor = tokens / DISC_WEIGHT if objective == "electra" else samples
    second_loss = second_loss / divisor if divisor else float("nan")
    scalars = {"train/loss": mlm_loss + second_loss, "train/mlm_loss": mlm_loss, "train/lr": interval.lr,
               "train/grad_norm": float(grad_norm), "train/tokens_per_sec": speed["tokens_per_sec"],
               "train/samples_per_sec": interval.samples / elapsed,
               "train/data_wait": interval.wait / elapsed, "train/epoch": progress.epoch}
    if objective == "nsp":
        scalars["train/nsp_loss"] = second_loss
    if objective == "electra":  # the discriminator's mean loss per token, unweighted
        scalars["train/disc_loss"] = second_loss / DISC_WEIGHT
    if scaler.is_enabled():
        scalars["train/loss_scale"] = scaler.get_scale()
    if skipped:
        scalars["train/skipped_steps"] = skipped / world_size  # this run's, in all
    if speed["mfu"] is not None:
        scalars["train/mfu"] = speed["mfu"]
    log(scalars, progress.step)
    meter.interval = Interval()
    return mlm_loss + second_loss


def most_skipped_in_a_row(meter):
    """Collective: the most steps skipped in a row since the last call (a host read: every --rollback-after
    and --log-every steps). Every rank skipped the same steps (their all-reduced gradients are the same);
    agreed all the same, since it decides a collective."""
    most = all_reduce_ctrl([float(meter.most_in_a_row)])[0] / GROUP.world_size
    meter.most_in_a_row = meter.skipped_in_a_row
    return most


def last_loss_finite(step):
    """Collective: did the last step give a finite loss on every rank? A step whose loss was not finite was
    skipped, so the weights now are the ones that gave it."""
    return all_reduce_ctrl([float(not torch.isfinite(step.sums[0] + step.sums[2]))])[0] == 0


def rollback(run, progress, trainer, meter, step, most_skipped):
    """Collective: --rollback-after steps in a row had an inf/NaN gradient (skipped). Every rank loads the
    newest checkpoint's weights, optimizer and loss scale, and goes on with the data after those steps (not
    replayed), the step count and LR plan too. No checkpoint is saved while the loss is not finite, so a
    second rollback to the same one means the steps right after it failed again: it did not help. Then,
    or with no checkpoint, the run stops (that checkpoint moved aside: a re-run resumes the one before)."""
    root = os.path.join(run.out_dir, "checkpoints")
    latest = from_rank0(read_latest(root))
    path = latest and os.path.join(root, latest)
    what = "a non-finite loss" if not last_loss_finite(step) else "an inf/NaN gradient"
    skipped = f"{most_skipped:.0f} steps in a row up to step {progress.step} had {what} (skipped)"
    error = None
    if GROUP.rank == 0 and path is None:
        error = "there is no checkpoint to roll back to"
    elif GROUP.rank == 0 and trainer.rolled_back_to == path:
        error = f"a rollback to {path} did not help (the steps after it were skipped again); " + abandon(root, path)
    if error:
        error = f"{skipped}, and {error}: lower --lr or --clip, raise --warmup, or look at the data of these steps"
    agree(error)
    mine = read_checkpoint(path)[0] if GROUP.rank == 0 else None
    sha = from_rank0(mine and mine["sha256"])
    loaded = fetch(mine, path, lambda: read_checkpoint(path)[0], lambda c: c["sha256"] == sha)
    load_trainer(loaded["trainer.pt"], trainer)
    trainer.rolled_back_to = path
    trainer.saved_at = (progress.step, progress.epoch)  # these are path's weights: not saved again at this step
    progress.rollbacks += 1
    meter.skipped_in_a_row = torch.zeros_like(meter.skipped_in_a_row)
    meter.most_in_a_row = torch.zeros_like(meter.most_in_a_row)
    if GROUP.rank == 0:
        say(f"{skipped}: rolled the weights and optimizer back to {path}; the data goes on after step "
            f"{progress.step} (the batches since step {loaded['meta']['step']} are not replayed)")


def mark(meter, progress, device, run, plan):
    """The steady rates' marks after 1 and STEADY_AFTER steps of this run. At the second, a --budget run
    says where its plan lands at this machine's speed (a resume on slower hardware keeps its plan)."""
    done = progress.step - meter.start.step
    if done in (1, STEADY_AFTER):
        meter.marks[done] = Mark(clock(device) - meter.paused, progress.step, progress.tokens_seen,
                                 progress.flops_done)
    budget = plan.budget
    if done == STEADY_AFTER and budget and GROUP.rank == 0:
        step_s = (meter.marks[done].clock - meter.marks[1].clock) / (done - 1) + budget.step_s - budget.train_step_s
        left = (plan.total - progress.plan_pos) * plan.batch / run.config["effective_batch"]
        ends = progress.train_seconds + left * step_s
        say(f"--budget: {left:,.0f} steps left at {step_s:.3g} s a step here (planned at {budget.step_s:.3g} s): "
            f"training ends after {estimate_steps.hours(ends)}, {ends / budget.seconds - 1:+.1%} off the budget")


def checkpoint(args, run, plan, progress, trainer, stream, device, tracker_runs, loss_finite=True):
    """Collective: every rank's RNG and data cursor go to rank 0, which writes the checkpoint
    atomically. A step saved already is not saved again (the final save after a save at that step), nor
    weights that gave a non-finite loss (loss_finite false: no rollback target)."""
    if trainer.saved_at == (progress.step, progress.epoch):
        return
    trainer.saved_at = (progress.step, progress.epoch)
    mine = {"rng": rng_states(device), "data": stream.state_dict()}
    gathered = [mine]
    if GROUP.world_size > 1:
        gathered = [None] * GROUP.world_size if GROUP.rank == 0 else None
        dist.gather_object(mine, gathered, dst=0, group=GROUP.ctrl)
    error = None
    if GROUP.rank == 0:
        meta = {**dataclasses.asdict(progress), "world_size": GROUP.world_size, "num_workers": args.num_workers,
                "config": run.config, "plan": dataclasses.asdict(plan), "estimate": run.estimate,
                "tokenizer_hash": run.tokenizer_hash, "fingerprint": run.fingerprint, "tracker_runs": tracker_runs}
        error = save_on_rank0(run.out_dir, progress.step, trainer, gathered, meta, args.keep_last, loss_finite)
    agree(error)  # one line from rank 0, every rank stops


def save_on_rank0(out_dir, step, trainer, ranks, meta, keep_last, loss_finite):
    """Rank 0: write the checkpoint, unless its weights are not finite (an error: a NaN checkpoint would
    rotate the good ones out) or gave a non-finite loss (a note). Returns the error's line, or None."""
    root = os.path.join(out_dir, "checkpoints")
    latest = read_latest(root)
    kept = f"{os.path.join(root, latest)} is the newest complete checkpoint" if latest else "no checkpoint yet"
    if not torch.stack([torch.isfinite(p).all() for p in trainer.raw_model.parameters()]).all():
        return f"the weights at step {step} are not finite: not saved; {kept}"
    if not loss_finite:
        say(f"not saved at step {step}: the weights gave a non-finite loss in the last step; {kept}")
        return None
    state = {"model": trainer.raw_model.hf.state_dict(), "optimizer": trainer.optimizer.state_dict(),
             "scaler": trainer.scaler.state_dict()}

    def save():
        say(f"saved {save_checkpoint(root, step, {'trainer.pt': state, 'ranks.pt': ranks}, meta, keep_last)}")
    error = data_stream.try_write(save, f"checkpoint {step_name(step)} into {root}", root, nbytes(state))
    if error:
        return f"{error}; {kept}: free space and run the same command again to resume there"
    return None


def run_eval(trainer, eval_loader, args, log, step):
    metrics = evaluate(trainer.raw_model, eval_loader, trainer.amp_ctx, args.objective)
    log(metrics, step)
    return metrics


@torch.no_grad()
def evaluate(raw_model, loader, amp_ctx, objective):
    """Collective: MLM loss / perplexity / accuracy (electra: its generator's) and NSP accuracy, or electra's
    replaced-token detection, over the whole (sharded) eval set."""
    device = next(raw_model.parameters()).device
    raw_model.eval()
    sums = torch.zeros(4, dtype=torch.float64, device=device)
    masked = 0
    samples = 0
    tokens = 0
    # electra's generator samples from torch's RNG: eval draws its own, seeded, and leaves training's as it was
    # (a run that evaluates at a step and one resumed there go on alike)
    with torch.random.fork_rng([device] if device.type == "cuda" else []):
        torch.manual_seed(EVAL_SEED)
        for batch in loader:
            batch, counts = prepare(batch, device)
            with amp_ctx:
                sums += raw_model(**batch).double()
            masked += counts["num_masked"]  # host counts: no copy from the device
            samples += counts["num_samples"]
            tokens += counts["num_tokens"]
    sums = torch.cat([sums, torch.tensor([masked, samples, tokens], dtype=torch.float64, device=device)])
    if GROUP.world_size > 1:
        dist.all_reduce(sums)
    raw_model.train()
    mlm_loss, mlm_correct, second_loss, second_correct, masked, samples, tokens = sums.tolist()
    if masked == 0:
        return {}
    metrics = {"eval/mlm_loss": mlm_loss / masked, "eval/perplexity": math.exp(min(mlm_loss / masked, 50)),
               "eval/mlm_accuracy": mlm_correct / masked}
    if objective == "nsp":
        metrics.update({"eval/nsp_loss": second_loss / samples, "eval/nsp_accuracy": second_correct / samples})
    if objective == "electra":
        metrics.update({"eval/disc_loss": second_loss / tokens, "eval/disc_accuracy": second_correct / tokens})
    return metrics


def end_epoch(progress, window, batches):
    """Collective: the epoch ended for all ranks at the same step; count what each rank had to leave."""
    left = sum(samples for _, samples in window) + sum(b["num_samples"] for b in batches)
    progress.unused_per_epoch.append([unused for _, unused in gather(left)])
    if GROUP.rank == 0:
        say(f"epoch {progress.epoch} ended at step {progress.step}; samples left unused per rank: "
            f"{progress.unused_per_epoch[-1]}")
    progress.epoch += 1


def end_finite(run, progress, trainer, finite, what):
    """Collective, at the end: a run whose last weights gave a non-finite loss stops with one line, its final
    checkpoint (if saved already) moved aside, no export."""
    error = None
    if GROUP.rank == 0 and not finite:
        root = os.path.join(run.out_dir, "checkpoints")
        final = step_name(progress.step)
        saved = read_latest(root) == final and trainer.saved_at == (progress.step, progress.epoch)
        moved = abandon(root, os.path.join(root, final)) if saved else "no checkpoint is saved"
        error = (f"the {what} loss at the end (step {progress.step}) is not finite: the model is not exported; "
                 f"{moved}; lower --lr or --clip, raise --warmup, or look at the data of the last steps")
    agree(error)


# ----------------------------------------------------------------------------- build the trainer, or restore it

def new_trainer(args, run, rank0_only, device, amp_dtype):
    """The model with the same initial weights on every rank (--init-from's, as rank 0 loaded them), its
    optimizer, fp16's GradScaler and the autocast context; then dropout's RNG, seeded per rank."""
    torch.manual_seed(args.seed)  # the same initial weights on every rank
    hf_model = model_from(run.config["architecture"], args.objective, args.dropout)  # electra: an ElectraPair
    if run.init:  # --init-from: the source's weights, as rank 0 loaded them
        init = run.init
        weights = fetch(rank0_only.init_weights, init["folder"],
                        lambda: load_init(init["kind"], init["folder"], init["objective"], init["seed"],
                                          init["arch"])[0],
                        lambda loaded: weights_checksum(loaded) == init["checksum"])
        hf_model.load_state_dict(weights)
    raw_model = Pretraining(hf_model).to(device)
    optimizer = new_optimizer(raw_model, args.lr, args.weight_decay)
    scaler = torch.amp.GradScaler(device.type, enabled=amp_dtype == torch.float16)
    amp_ctx = torch.autocast(device.type, dtype=amp_dtype) if amp_dtype else contextlib.nullcontext()
    torch.manual_seed(args.seed + GROUP.rank)  # dropout differs per rank (a same-size resume restores its RNG)
    return Trainer(raw_model, raw_model, optimizer, scaler, amp_ctx)


# torch 2.13 renamed DDP's broadcast_buffers to forward_sync_buffers (the old name warns there; older: only it)


NO_BUFFER_SYNC = {"forward_sync_buffers" if "forward_sync_buffers" in inspect.signature(DDP.__init__).parameters
                  else "broadcast_buffers": False}


def wrap_ddp(model, device):
    """DDP without the per-forward sync of buffers (BERT's are constant position and token-type
    ids, synced once at the start) and with gradients kept in the all_reduce buckets (no copy)."""
    return DDP(model, device_ids=[device.index] if device.type == "cuda" else None, gradient_as_bucket_view=True,
               **NO_BUFFER_SYNC)


def restore(run, rank0_only, trainer, device, num_workers):
    """Load the resumed checkpoint into this rank, before the DDP wrap: DDP's start-up broadcast would hide a
    rank that loaded something else. Returns (Progress, this rank's data cursor or None: the epoch starts
    from its beginning, the trackers' run ids to continue)."""
    if run.resume_path is None:
        return Progress(), None, {}
    resumed = fetch(rank0_only.resumed, run.resume_path, lambda: read_checkpoint(run.resume_path)[0],
                    lambda loaded: loaded["sha256"] == run.resume_sha256)
    meta = resumed["meta"]
    ranks = resumed["ranks.pt"]
    load_trainer(resumed["trainer.pt"], trainer)
    progress = Progress.from_meta(meta)
    tracker_runs = meta.get("tracker_runs", {})
    if run.corpus_changed:
        return progress, None, tracker_runs
    if (meta["world_size"], meta["num_workers"]) == (GROUP.world_size, num_workers):
        set_rng_states(ranks[GROUP.rank]["rng"], device)
        return progress, ranks[GROUP.rank]["data"], tracker_runs
    return progress, data_stream.merge_states([r["data"] for r in ranks]), tracker_runs


def load_trainer(state, trainer):
    trainer.raw_model.hf.load_state_dict(state["model"])
    trainer.optimizer.load_state_dict(state["optimizer"])
    if trainer.scaler.is_enabled() and state["scaler"]:
        trainer.scaler.load_state_dict(state["scaler"])
    elif trainer.scaler.is_enabled() and GROUP.rank == 0:
        warn("note: the checkpoint trained without fp16: a fresh GradScaler starts")


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


def peak_flops(device, amp_dtype):
    """Dense peak of the device, for MFU: a table for GPUs, a measured fp32 matmul on CPUs."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        peak = gpu_peak(name, amp_dtype, torch.get_float32_matmul_precision() != "highest")
        if peak is None and GROUP.rank == 0:
            warn(f"note: no peak FLOP/s known for {name}: MFU is n/a (add it to model.GPU_PEAKS)")
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


def newest_local_step(args):
    """The step of the newest checkpoint this process sees in its own out dir, -1 if none."""
    latest = read_latest(os.path.join(args.out_dir or default_out_dir(), "checkpoints"))
    return step_of(latest) if latest and args.resume == "auto" else -1


def default_out_dir():
    # torchrun's restarts keep the run id, so they find the same out dir and resume
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "none")
    return f"runs/run-{run_id}" if run_id != "none" else time.strftime("runs/%Y%m%d-%H%M%S")


# ----------------------------------------------------------------------------- the run: rank 0 decides, all verify

def plan_run(args, device, amp_dtype, rank0_only):
    """Rank 0 decides the run: out dir, checkpoint, tokenizer, corpus, LR plan. Returns (Run, LRPlan), what
    every rank needs (sent over the process group); what rank 0 read goes to rank0_only."""
    out_dir = args.out_dir or default_out_dir()
    lock_out_dir(out_dir)
    path, resumed = choose_checkpoint(os.path.join(out_dir, "checkpoints"), args.resume, args.overwrite)
    if args.resume == "none" and args.overwrite:
        for old in ("checkpoints", "tokenizer"):
            shutil.rmtree(os.path.join(out_dir, old), ignore_errors=True)
    init = None
    source = f"--model-size {args.model_size}"
    if args.init_from and resumed is not None:
        warn(f"note: {out_dir} has checkpoints of its own: resuming them, not --init-from {args.init_from}")
    elif args.init_from:
        kind, folder, init_tokenizer = init_source(args.init_from)
        if init_tokenizer is None and not args.tokenizer:
            fail(f"--init-from {folder} has no tokenizer: give the one its model was trained with (--tokenizer DIR)")
        weights, architecture, notes = load_init(kind, folder, args.objective, args.seed, args.arch)
        init = {"kind": kind, "folder": folder, "objective": args.objective, "seed": args.seed, "arch": args.arch,
                "checksum": weights_checksum(weights), "tokenizer": init_tokenizer}
        source = f"--init-from {folder}"
        rank0_only.init_weights = weights
    tokenizer = run_tokenizer(args, out_dir, resumed, path, init and init["tokenizer"])
    if resumed is not None:
        source = f"the checkpoint {path}"
        architecture = resumed["meta"]["config"]["architecture"]
    elif init is None:
        architecture = new_architecture(args.model_size or "tiny", len(tokenizer), args.max_seq_len,
                                        tokenizer.pad_token_id, args.generator_size, args.arch or "bert")
    model_size = size_name(architecture)
    if args.model_size not in (None, model_size):
        fail(f"--model-size {args.model_size} differs from {source}: {family_name(architecture)}-{model_size} "
             f"({architecture['num_hidden_layers']} layers, {architecture['hidden_size']} hidden); drop --model-size")
    if args.arch not in (None, architecture.get("arch", "bert")):
        fail(f"--arch {args.arch} differs from {source}'s {family_name(architecture)}: drop --arch")
    args.arch = architecture.get("arch", "bert")  # the checkpoint's or --init-from's, when not given
    if args.max_seq_len > architecture["max_position_embeddings"]:
        fail(f"--max-seq-len {args.max_seq_len} exceeds the {architecture['max_position_embeddings']} positions of "
             f"{source}'s model")
    if len(tokenizer) > architecture["vocab_size"]:
        fail(f"the tokenizer has {len(tokenizer)} tokens, the model of {source} embeds {architecture['vocab_size']}")
    if init and notes:
        warn(f"note: {source}: {'; '.join(notes)}")
    stream = make_stream(args, args.corpus, "train", tokenizer, args.seed, True)
    config = {**vars(args), "out_dir": out_dir, "world_size": GROUP.world_size, "device": str(device),
              "model_size": model_size, "architecture": architecture,
              "vocab": len(tokenizer), "tokenizer_path": os.path.join(out_dir, "tokenizer"),
              "amp_dtype": str(amp_dtype).replace("torch.", "") if amp_dtype else "fp32",
              "effective_batch": args.batch_size * args.accum_steps * GROUP.world_size}
    corpus_changed = False
    if resumed is None:
        plan, estimate = new_lr_plan(args, stream)
    else:
        plan, corpus_changed = plan_resume(args, path, resumed["meta"], config, stream.fingerprint())
        estimate = resumed["meta"]["estimate"]
    kept = os.path.join(out_dir, "tokenizer")
    tokenizer_files = {}
    for name in os.listdir(kept):
        with open(os.path.join(kept, name), "rb") as f:
            tokenizer_files[name] = f.read()
    rank0_only.tokenizer = tokenizer
    rank0_only.stream = stream
    rank0_only.resumed = resumed
    run = Run(out_dir, config, estimate, stream.fingerprint(), data_stream.tokenizer_hash(tokenizer), tokenizer_files,
              resume_path=path, resume_sha256=resumed and resumed["sha256"], corpus_changed=corpus_changed, init=init)
    return run, plan


# Fields a resume must share with the checkpoint (the corpus: its fingerprint; the tokenizer: its hash), with
# what a checkpoint without the field had


RESUME_MUST_MATCH = {"model_size": None, "objective": None, "max_seq_len": None, "vocab": None, "seed": None,
                     "schedule": "linear", "generator_size": None, "arch": "bert"}


def plan_resume(args, path, meta, config, fingerprint):
    """Rank 0, resuming the checkpoint at path: what must match does, and the LR plan goes on (re-planned
    when --epochs, --max-steps or --budget changed). Returns (the LR plan, whether the corpus changed)."""
    before = meta["config"]
    changed = [f"{k} (checkpoint {before.get(k, old)!r}, now {config[k]!r})"
               for k, old in RESUME_MUST_MATCH.items() if before.get(k, old) != config[k]]
    if changed:
        fail(f"cannot resume from {path}: {'; '.join(changed)} differ; use another --out-dir, "
             "or --resume none --overwrite")
    corpus_changed = meta["fingerprint"] != fingerprint
    if corpus_changed and not args.allow_corpus_change:
        fail(f"cannot resume from {path}: the corpus changed (checkpoint {meta['fingerprint']}, now {fingerprint}); "
             "--allow-corpus-change restarts the epoch on it, or use another --out-dir")
    if corpus_changed:
        warn(f"warning: the corpus changed since {path}; epoch {meta['epoch']} restarts on the new corpus")
    plan = LRPlan.from_dict(meta["plan"])
    pos = meta["plan_pos"]
    if args.budget and not plan.budget:
        fail(f"cannot resume {path} with --budget: its plan counts steps, not time; extend it with --epochs "
             "or --max-steps, or drop --budget")
    lengths = [(f"--{k.replace('_', '-')}", before.get(k), getattr(args, k)) for k in ("epochs", "max_steps", "budget")]
    if any(old != new for _, old, new in lengths):
        new = replan(plan, pos, meta["step"], args, config["effective_batch"])
        if lr_factor(new, pos) == 0 and new.total > pos:
            fail(f"cannot extend {path}: its LR had decayed to 0, so more steps would not train; start a new "
                 f"plan from its weights: --init-from {config['out_dir']} --out-dir ANOTHER_DIR")
        changes = ", ".join(f"{flag} {old} -> {new}" for flag, old, new in lengths if old != new)
        warn(f"warning: {changes}: the LR plan now ends after {new.total:.0f} planned steps, not {plan.total:.0f}, "
             "and goes on from today's LR (never up)")
        plan = new
    if (meta["world_size"], meta["num_workers"]) != (GROUP.world_size, args.num_workers):
        warn(f"warning: resuming {meta['world_size']} ranks x {meta['num_workers']} workers as {GROUP.world_size} x "
             f"{args.num_workers}: the data order is no longer bit-exact (the rest of the epoch is re-sharded; "
             f"no document is repeated); the LR plan continues, a step now counts as "
             f"{config['effective_batch'] / plan.batch:.3g} planned steps")
    return plan, corpus_changed


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
    tokenizer = rank0_only.tokenizer
    stream = rank0_only.stream
    error = None
    if stream is None:  # not rank 0: its tokenizer came over the process group, the corpus is local
        try:
            with tempfile.TemporaryDirectory() as tmp:
                for name, data in run.tokenizer_files.items():
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
    elif GROUP.rank == 0 and args.eval_corpus is None:
        warn("warning: no evaluation: give --eval-corpus for a held-out set")
    states = [state for _, state in gather(eval_state)]
    if eval_corpus != "none" and all(isinstance(state, str) for state in states):
        if GROUP.rank == 0:
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


# ----------------------------------------------------------------------------- the learning-rate plan
# Planned once (from the estimate, or --budget's calibration) and kept in every checkpoint; the record (LRPlan)
# and the factor the loop reads (lr_factor) live in estimate_steps.py, where finetune.py reads them too.

def new_lr_plan(args, stream):
    """Rank 0: the plan of --epochs (capped by --max-steps) from estimate_steps' count, and that estimate."""
    settings = (stream, GROUP.world_size, args.num_workers, args.batch_size, args.accum_steps)
    epochs = args.epochs
    if args.max_steps is not None:  # estimate only the epochs --max-steps can reach (not e.g. --epochs 100000)
        first = estimate_steps.estimate(*settings, 1)
        epochs = min(epochs, math.ceil(args.max_steps / max(first["total_steps"], 1)) + 1)
    est = estimate_steps.estimate(*settings, epochs, warmup=args.warmup, schedule=args.schedule, decay=args.decay)
    total = est["total_steps"] if args.max_steps is None else min(args.max_steps, est["total_steps"] or 1)
    batch = args.batch_size * args.accum_steps * GROUP.world_size
    return plan_of(total, est["total_steps"] / epochs, batch, args.warmup, args.schedule, args.decay), est


def replan(plan, pos, step, args, batch):
    """--epochs, --max-steps or --budget changed on resume: the plan ends elsewhere, and the LR never jumps:
    a wsd plan in its stable phase keeps its peak and decays over the new end's --decay; a decaying plan
    decays from today's LR; a plan in its warmup keeps it."""
    total = args.epochs * plan.steps_per_epoch
    if args.max_steps is not None:
        total = min(total, pos + (args.max_steps - step) * batch / plan.batch)
    if plan.budget and args.budget:  # the stored step time: a resume never measures again
        total = min(total, plan.total + (args.budget - plan.budget.seconds) / plan.budget.step_s)
    if plan.schedule == "wsd" and pos < plan.decay_from[0]:  # stable (or warming up): peak, then decay
        decay_from = (max(pos, estimate_steps.decay_start("wsd", plan.decay, plan.warmup, total)), 1.0)
    elif pos < plan.warmup:  # a linear or cosine plan in its warmup keeps the decay's start
        decay_from = plan.decay_from
    else:  # a decaying plan goes on from today's LR
        decay_from = (pos, lr_factor(plan, pos))
    return dataclasses.replace(plan, total=total, decay_from=decay_from)


def plan_budget(args, run, plan, trainer, stream, eval_loader, device, meter):
    """Collective, --budget: every rank runs real steps (3 untimed) and an eval, rank 0 a save; rank 0
    times them and plans the steps that fit (the calibration counted, eval and saves by their share),
    capped by --epochs and --max-steps. Weights, optimizer, loss scale, RNG and data are then as
    before: step 1 runs on the final plan, which every checkpoint carries (a resume never measures)."""
    raw_model = trainer.raw_model
    weights_before = {k: v.to("cpu", copy=True) for k, v in raw_model.state_dict().items()}
    scale_before = trainer.scaler.state_dict()
    rng_before = rng_states(device)  # and the optimizer's state: none yet
    times = [clock(device)]
    start_epoch(stream, 0, None, args.num_workers)
    batches = iter(make_loader(stream, args.num_workers, device, args.dist_timeout * 60))
    while len(times) <= sum(CALIBRATION):
        window, _, counts = next_window(batches, args, device, raw_model.hf, meter)
        full, *totals, _ = all_reduce_ctrl([len(window) == args.accum_steps, *counts, 0])
        if full < GROUP.world_size:
            break
        train_step(trainer, [batch for batch, _ in window], loss_divisors(args.objective, totals), GROUP.world_size,
                   args.clip, args.lr * lr_factor(plan, 0))
        times.append(clock(device))
    del batches
    warm = min(CALIBRATION[0], len(times) - 2) if len(times) > 1 else 0
    step_s = (times[-1] - times[warm]) / max(len(times) - 1 - warm, 1) if len(times) > 1 else math.inf
    if eval_loader is not None:
        evaluate(raw_model, eval_loader, trainer.amp_ctx, args.objective)
    eval_end = clock(device)
    if GROUP.rank == 0:  # a checkpoint's write, deleted (an export, a third of it, is counted as one)
        tmp = os.path.join(run.out_dir, ".budget-calibration")
        state = {"model": raw_model.hf.state_dict(), "optimizer": trainer.optimizer.state_dict()}
        save_checkpoint(tmp, 0, {"trainer.pt": state}, {}, 1)
        shutil.rmtree(tmp)
    save_end = clock(device)
    raw_model.load_state_dict(weights_before)
    trainer.optimizer.state.clear()
    trainer.scaler.load_state_dict(scale_before)
    set_rng_states(rng_before, device)
    meter.interval = Interval()
    meter.data_wait = 0.0
    spent = save_end - times[0]
    saves_per_step = 1 / args.save_every + (1 / args.export_every if args.export_every else 0)
    per_step = step_s + (eval_end - times[-1]) / args.eval_every + (save_end - eval_end) * saves_per_step
    fit = int(max(args.budget - spent, 0) // per_step)
    budget = Budget(args.budget, per_step, step_s, spent, fit, "budget" if fit < plan.total else "epochs")
    plan = from_rank0(plan_of(min(fit, plan.total), plan.steps_per_epoch, plan.batch, args.warmup, args.schedule,
                              args.decay, budget))
    error = None
    if plan.total < 1 and GROUP.rank == 0:
        error = (f"--budget {estimate_steps.hours(args.budget)} holds no step: the calibration took {spent:.1f} s "
                 f"and a step takes {per_step:.3g} s here")
    agree(error)
    if GROUP.rank == 0:
        announce_budget(plan)
    return plan


# ----------------------------------------------------------------------------- what the run says: lines, report, sinks

def new_meter(device, amp_dtype, progress):
    start = Mark(time.perf_counter(), progress.step, progress.tokens_seen, progress.flops_done)
    zero = torch.zeros((), device=device)
    # The peak is rank 0's, which reports MFU: timed on the CPU by it alone (another rank's matmuls beside it
    # could slow its timing, and cost that rank ~2.4 s at every launch with a cache of its own)
    peak = peak_flops(device, amp_dtype) if GROUP.rank == 0 else None
    return Meter(peak=peak, start=start, train_base=progress.train_seconds, skipped=zero.clone(),
                 skipped_in_a_row=zero.clone(), most_in_a_row=zero.clone())


def rates(seconds, steps, tokens, flops, peak, world_size):
    seconds = max(seconds, 1e-9)
    return {"tokens_per_sec": tokens / seconds, "steps_per_hour": steps / seconds * 3600,
            "mfu": flops / seconds / (peak * world_size) if peak else None}


def announce(args, run, plan, raw_model, device, progress):
    """Rank 0's first lines: the config, the model, the plan, where the weights came from."""
    config, estimate = run.config, run.estimate
    n_params = sum(p.numel() for p in raw_model.parameters())
    say(f"config: {json.dumps(config)}")
    name = f"{family_name(config['architecture'])}-{config['model_size']} {args.objective}"
    if isinstance(raw_model.hf, ElectraPair):  # its generator's parameters counted, the shared embeddings once
        name = (f"ELECTRA-{config['model_size']} (generator {raw_model.hf.generator.config.hidden_size} wide, "
                f"{sum(p.numel() for p in raw_model.hf.discriminator.parameters()) / 1e6:.2f}M in the discriminator)")
    say(f"model: {name}, {n_params / 1e6:.2f}M parameters; world size "
        f"{config['world_size']} on {device.type}; effective batch {config['effective_batch']} "
        f"({args.batch_size} x {config['world_size']} ranks x {args.accum_steps} accum)")
    capped = f", capped by --max-steps {args.max_steps})" if args.max_steps else ")"
    say(f"planned {plan.total:.0f} steps (estimate, {estimate['mode']}: {estimate['total_steps']} steps for "
        f"{estimate['epochs']} epoch(s){capped}; {plan.schedule} LR, warmup {plan.warmup} steps, decay from "
        f"{plan.decay_from[0]:.0f}")
    if run.resume_path and plan.budget:
        announce_budget(plan)
    if run.resume_path:
        say(f"resumed from {run.resume_path} at step {progress.step}, epoch {progress.epoch}")
    elif run.init:
        say(f"initialised from {run.init['folder']} (weights only: new optimizer and LR plan, step 0)")


def announce_budget(plan):
    budget = plan.budget
    epochs = plan.total / max(plan.steps_per_epoch, 1)
    limit = "" if budget.limit == "budget" else (f"; {budget.steps_fit:,} steps would fit: the data of --epochs / "
                                                 "--max-steps ends the run first")
    say(f"--budget {estimate_steps.hours(budget.seconds)}: a step takes {budget.train_step_s:.3g} s here, "
        f"{budget.step_s:.3g} s with eval, checkpoints and exports by their share; the calibration took "
        f"{budget.calibration_s:.1f} s: planned {plan.total:,} steps ({epochs:.2f} epochs), LR decay from step "
        f"{plan.decay_from[0]:.0f}{limit}")


def report(args, run, plan, progress, meter, end, train_loss, eval_metrics, stopped, trainer):
    """Rank 0's end-of-run lines and summary.json. Returns None, or the line saying why it was not written."""
    world_size = GROUP.world_size
    start = meter.start
    elapsed = end - start.clock
    train_clock = end - meter.paused
    total_steps = round(plan.total)
    effective = run.config["effective_batch"]
    overall = rates(elapsed, progress.step - start.step, progress.tokens_seen - start.tokens,
                    progress.flops_done - start.flops, meter.peak, world_size)
    # Steady: after STEADY_AFTER steps (1 in a run under 2 x STEADY_AFTER), without eval, saves and exports
    mark = meter.marks.get(STEADY_AFTER if progress.step - start.step >= 2 * STEADY_AFTER else 1)
    steady = overall
    if mark and progress.step > mark.step:
        steady = rates(train_clock - mark.clock, progress.step - mark.step, progress.tokens_seen - mark.tokens,
                       progress.flops_done - mark.flops, meter.peak, world_size)
    eta_h = total_steps / steady["steps_per_hour"] if steady["steps_per_hour"] else float("nan")
    wait_share = meter.data_wait / max(train_clock - start.clock, 1e-9)
    padding = 1 - (progress.tokens_seen - start.tokens) / max(meter.computed, 1)
    packed = " (pairs packed into rows)" if args.objective == "nsp" and args.packing else ""
    print(f"per-rank batch {args.batch_size} x {world_size} ranks, accumulation {args.accum_steps}, "
          f"effective batch {effective}, max seq len {args.max_seq_len}; padding {padding:.1%} of the positions "
          f"computed{packed}")
    since = f"from step {mark.step} on" if steady is not overall else "(too few steps: the overall ones)"
    print(f"iterations {progress.step - start.step}, time taken {elapsed:.1f} s; steady rates {since}, without "
          f"eval and saves: micro-batches/hour {steady['steps_per_hour'] * args.accum_steps:,.0f} => effective "
          f"batches/hour {steady['steps_per_hour']:,.0f}")
    mfu = f"{steady['mfu']:.1%}" if steady["mfu"] is not None else "n/a"
    print(f"ran {progress.step} steps (planned {total_steps}); estimated total time for the planned steps: "
          f"{eta_h:.2f} h; {steady['tokens_per_sec']:,.0f} tokens/s, MFU {mfu} (both of the real tokens) "
          f"(overall, start-up included: {overall['tokens_per_sec']:,.0f} tokens/s)")
    bottleneck = "; the data is the bottleneck: more --num-workers, or --build-cache first" if wait_share > 0.1 else ""
    print(f"data wait: {wait_share:.1%} of the training time on rank 0 (DataLoader workers per rank: "
          f"{args.num_workers}{bottleneck})")
    skipped = int(meter.skipped)
    if skipped or progress.rollbacks:
        fp16 = f" (fp16 overflows: the loss scale is now {trainer.scaler.get_scale():g})" \
            if trainer.scaler.is_enabled() else ""
        print(f"{skipped} step(s) skipped for an inf/NaN gradient{fp16}; rollbacks: {progress.rollbacks}")
    if plan.budget:
        print(f"--budget {estimate_steps.hours(plan.budget.seconds)}: trained "
              f"{estimate_steps.hours(progress.train_seconds)} ({progress.train_seconds / plan.budget.seconds - 1:+.1%}"
              "), the calibration included")
    summary = {"steps": progress.step, "planned_steps": total_steps, "epochs_done": progress.epoch,
               "train_loss": None if math.isnan(train_loss) else train_loss, "eval": eval_metrics,
               "samples_seen": progress.samples_seen, "tokens_seen": progress.tokens_seen,
               **steady, "steady_from_step": mark.step if steady is not overall else None,
               **{f"{k}_overall": v for k, v in overall.items()}, "data_wait_share": wait_share,
               "padding_share": padding, "world_size": world_size, "effective_batch": effective, "time_s": elapsed,
               "unused_samples_per_epoch": progress.unused_per_epoch, "stopped_by_signal": stopped,
               "skipped_steps": skipped, "rollbacks": progress.rollbacks, "train_seconds": progress.train_seconds,
               "budget": plan.budget and dataclasses.asdict(plan.budget), "estimate": run.estimate,
               "lr_plan": dataclasses.asdict(plan), "lr_plan_position": progress.plan_pos}
    path = os.path.join(run.out_dir, "summary.json")

    def write(f):
        json.dump(summary, f, indent=1)
    return data_stream.try_write(lambda: data_stream.atomic_write(path, write, "w"), path, run.out_dir)


# ----------------------------------------------------------------------------- data loading

def make_stream(args, corpus, split, tokenizer, seed, shuffle):
    return data_stream.stream_from_args(args, corpus, split, tokenizer, seed, shuffle, GROUP.rank,
                                        GROUP.world_size)


def make_loader(stream, num_workers, device, timeout_s, persistent=False):
    return workers.make_loader(stream, num_workers, device.type == "cuda", timeout_s, sparse_targets, persistent)


def start_epoch(stream, epoch, resume_data, num_workers):
    """The stream at the start of the epoch, or where the resumed checkpoint left it."""
    if resume_data is not None and resume_data["epoch"] == epoch:
        stream.load_state_dict(resume_data, num_workers)
    else:
        stream.set_epoch(epoch)


# ----------------------------------------------------------------------------- the process's ends

def exit_now(code):
    """End the process without the interpreter's teardown (its work done and said): teardown destroys C++
    objects in no set order, and a joinable std::thread destroyed there aborts a finished rank (1 of 9
    short 2-rank jobs under load, 0 of 50 with this exit: BENCHMARKS.md section 14)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def release_frames(error):
    """main()'s frames, kept by the error that left them, go now, and with them their DataLoaders: the workers end, and
    the semaphores of their queues are unlinked (exit_now skips the finalizers that would: multiprocessing's
    resource_tracker then warns of "leaked semaphore objects" after our one line). A frame can also be held in a
    reference cycle (an exception kept in a local of a frame it passed through: try_write's), which only the
    collector frees. A queue still alive after that (a 1-rank NaN stop, once in 4 suite runs: 2 semaphores) is
    unlinked by the first step of the interpreter's own exit, multiprocessing's finalizers of priority >= 0,
    which exit_now skips too."""
    error.__traceback__ = None
    gc.collect()
    multiprocessing.util._run_finalizers(0)


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


def cli(argv=None):
    """main() with its ends: each kind of failure in one line, a process that ends without teardown."""
    die_with_launcher()
    data_stream.check_versions("pretrain_ddp.py")
    try:
        main(argv)
    except USER_ERRORS as e:  # found before the ranks could agree (in the flags): each node says it once
        if GROUP.store is not None or int(os.environ.get("LOCAL_RANK", "0")) == 0:
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
