#!/usr/bin/env bash
# GPU check of pretrain_ddp.py on one rented GPU, in under 8 minutes, without network or pip (BENCHMARKS.md
# sections 6 and 16, row 7):
#
#     bash bench/gpu_check.sh                # on the GPU machine (from any directory: it cd's to the repository)
#     bash bench/gpu_check.sh --cpu-smoke    # every row but 7a at toy size on the CPU: checks this script anywhere
#
# Needs `python3` (there may be no `python`; PY= names another) with torch, transformers, tokenizers and numpy
# installed. Nothing is ever pip-installed: a missing module, or no CUDA outside --cpu-smoke, stops the script
# with one line. Every python/nvidia-smi command runs under `timeout -k 20 LIMIT` (SIGKILL 20 s after the
# SIGTERM: a trainer saves a checkpoint on SIGTERM first). Each row is printed the moment it is measured and
# appended to $OUT/table.txt as "label | result" (ok..., FAIL..., skipped...); the script exits 1 if a row failed.
#   data  the builtin corpus's train split x COPIES (16: ~4.4M tokens, so a timed run stays in one epoch),
#         its WordPiece tokenizer and token cache (data_stream.py --build-cache), built once
#   1     pinned memory, a non_blocking copy, nccl all_reduce at world size 1, the gloo control group
#   2     BERT-base mlm, seq 128, --amp --amp-dtype bf16, micro-batch BATCH (256; BATCH_FALLBACK 128 if 256 runs
#         out of memory), STEPS (110) steps: tokens/s, MFU and the data-wait share from summary.json (steady
#         rates: after step 5, so >= 100 timed steps), the micro-batch and DataLoader workers used, the peak
#         GPU memory (torch.cuda.max_memory_allocated: every trainer run goes through a driver that calls
#         pretrain_ddp.main(argv) in-process and then reads the counter)
#   3     the DDP wrap on the GPU: wrap_ddp + train_step, nccl at world size 1, 3 steps of BERT-base on
#         hand-made batches: finite loss, weights as an unwrapped copy's, the same on every rank
#   4     seq 512 (BERT's phase 2), bf16, micro-batch BATCH512 (64; 32 on OOM)
#   5     fp16 + GradScaler and a resume: SIGTERM after step 20 (the trainer stops at the next step, saves a
#         checkpoint, exits), then the same command with --resume auto and 40 more steps: both losses finite,
#         the second run says it resumed; the loss scale before and after and the skipped steps (overflows)
#   7     nsp pairs packed into rows (the default) against --no-packing (a padded row per pair), BERT-base bf16 at
#         seq 128 and 512, STEPS_AB (40) steps each: real tokens/s, MFU (of the real tokens), the padding share of
#         the positions computed, and packed / unpacked (issue 37)
#   8     ModernBERT's block (--arch modernbert, mlm) of the same size at seq 512, bf16, STEPS_AB steps: tokens/s,
#         MFU (its local layers' band counted as attended), peak memory (issue 51)
#   6     row 2 with --compile; last, as the longest: its timeout shrinks to the budget left (at least 120 s)
# What one GPU cannot check: DDP over nccl with 2+ ranks (NCCL refuses two ranks on one device), so row 3 runs
# nccl at world size 1 (DDP's gradient all_reduce runs, but nothing crosses between GPUs); the multi-rank logic
# is checked by the CPU tests (gloo) and by --cpu-smoke's row 3 (2 ranks). Nor several nodes, nor nccl timeouts.
# Budget: a command starts only if its timeout plus the 20 s grace ends inside BUDGET seconds from the start
# (else its row says "skipped"). Runs write checkpoints (BERT-base + AdamW: ~1 GB) under $RUNS and delete them
# after each run; logs and summary.json files go to $OUT.
# --cpu-smoke (~70 s on 2 cores beside the test suite's other worker; BUDGET 300 s): CUDA hidden, BERT-tiny, seq 64
# (rows 4 and 7b: 128), 12 steps, one OpenMP thread per process; gloo instead of nccl and no pinned memory (row 1);
# rows 2, 4 and 7b in bf16 if the CPU has it natively (else fp32); row 5 in fp32 (fp16 needs CUDA); row 3 under
# torchrun with 2 ranks over gloo; rows 4-7 without DataLoader workers; row 6 in fp32 with torch's debug
# backend override SMOKE_COMPILE_BACKEND (aot_eager: dynamo and AOT autograd trace forward and backward, no
# kernels are built; "inductor" builds them: +45 s on 2 idle cores); the first try of row 2 fails with a
# simulated out-of-memory error, so the fallback runs too; row 7a is not run (7b runs its code, and rows 2, 5 and
# 6 its sizes).
# Environment knobs (GPU default / --cpu-smoke default):
#   OUT (/tmp/gpu_check / /tmp/gpu_check_smoke)  RUNS (/tmp/gpu_check_runs / /tmp/gpu_check_smoke_runs)
#   BUDGET s (450 / 300)  STEPS (110 / 12)  STEPS_AB (40 / 8)  BATCH, BATCH_FALLBACK (256, 128 / 16, 8)  BATCH512,
#   BATCH512_FALLBACK (64, 32 / 8, 4)  COPIES (16 / 1)  WORKERS (unset: the trainer's default / same, rows
#   4-7: 0)  PY (python3)  BERT_DDP_CACHE (the trainer's cache, ~/.cache/bert_ddp)  TORCHINDUCTOR_CACHE_DIR
#   ($RUNS/inductor, deleted if row 6 fails)  SMOKE_COMPILE_BACKEND (aot_eager)  GPU_CHECK_FAKE_OOM_ABOVE (unset
#   / BATCH_FALLBACK: a run with a larger micro-batch fails as if out of memory, before it starts)
set -u
cd "$(dirname "$0")/.." || exit 1
ROOT=$PWD
SMOKE=0
case "${1:-}" in
    "") ;;
    --cpu-smoke) SMOKE=1 ;;
    *) echo "usage: bash bench/gpu_check.sh [--cpu-smoke]"; exit 2 ;;
esac
PY=${PY:-python3}
GRACE=20  # timeout -k: SIGKILL this long after SIGTERM (a trainer stopped by SIGTERM saves a checkpoint first)
if (( SMOKE )); then
    OUT=${OUT:-/tmp/gpu_check_smoke}; RUNS=${RUNS:-/tmp/gpu_check_smoke_runs}; BUDGET=${BUDGET:-300}
    STEPS=${STEPS:-12}; STEPS_AB=${STEPS_AB:-8}; BATCH=${BATCH:-16}; BATCH_FALLBACK=${BATCH_FALLBACK:-8}
    BATCH512=${BATCH512:-8}; BATCH512_FALLBACK=${BATCH512_FALLBACK:-4}; COPIES=${COPIES:-1}
    MODEL=tiny; SEQ=64; SEQ2=128; LOG_EVERY=2; STOP_AT=4; MORE=4; MIN_TIMED=5; DDP_RANKS=2
    RUN_LIMITS=(90 30); COMPILE_LIMITS=(150 60)  # a trainer run's timeout: at most, at least (else skipped)
    export GPU_CHECK_FAKE_OOM_ABOVE=${GPU_CHECK_FAKE_OOM_ABOVE:-$BATCH_FALLBACK}
    export CUDA_VISIBLE_DEVICES=""  # the smoke is the CPU's, also on a GPU machine
    # one thread per process: on a loaded small machine, 2 OpenMP threads that spin-wait for each other ran
    # the tiny model up to 10x slower
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
    export TORCHINDUCTOR_COMPILE_THREADS=${TORCHINDUCTOR_COMPILE_THREADS:-1}  # no pool of compile processes
else
    OUT=${OUT:-/tmp/gpu_check}; RUNS=${RUNS:-/tmp/gpu_check_runs}; BUDGET=${BUDGET:-450}
    STEPS=${STEPS:-110}; STEPS_AB=${STEPS_AB:-40}; BATCH=${BATCH:-256}; BATCH_FALLBACK=${BATCH_FALLBACK:-128}
    BATCH512=${BATCH512:-64}; BATCH512_FALLBACK=${BATCH512_FALLBACK:-32}; COPIES=${COPIES:-16}
    MODEL=base; SEQ=128; SEQ2=512; LOG_EVERY=10; STOP_AT=20; MORE=40; MIN_TIMED=100; DDP_RANKS=1
    RUN_LIMITS=(150 60); COMPILE_LIMITS=(300 120)
fi
WORKERS=${WORKERS:-}
SMOKE_COMPILE_BACKEND=${SMOKE_COMPILE_BACKEND:-aot_eager}
LIGHT=()  # rows 4-7 of the smoke: no DataLoader worker (each starts a Python that imports torch); row 2 has one
(( SMOKE )) && [ -z "$WORKERS" ] && LIGHT=(--num-workers 0)
# torch.compile's cache: a compile killed by its timeout can leave a truncated kernel there (seen: "file too
# short" in the next run), so it is this script's own and is deleted when the compile row fails
OWN_INDUCTOR_CACHE=$( [ -z "${TORCHINDUCTOR_CACHE_DIR:-}" ] && echo 1 || echo 0 )
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-$RUNS/inductor}
export GPU_CHECK_ROOT=$ROOT OUT MIN_TIMED PYTHONUNBUFFERED=1
mkdir -p "$OUT" "$RUNS/py"
LOG="$OUT/gpu_check.log"
rm -f "$OUT/table.txt" "$LOG"
exec > >(tee -a "$LOG") 2>&1
T0=$(date +%s)
RESULTS=()
note() { echo "== [$(( $(date +%s) - T0 )) s] $*"; }
# every row goes to stdout and to the table file the moment it is measured: a cut run keeps what it has
FAILS=0
record() {
    RESULTS+=("$1|$2"); note "$1: $2"; printf '%-50s | %s\n' "$1" "$2" >> "$OUT/table.txt"
    [[ $2 == FAIL* ]] && FAILS=$(( FAILS + 1 ))
    return 0
}
# limit_for MAX MIN: the timeout a command may have, MAX or what is left of the budget after the kill
# grace, whichever is less; fails (the row is skipped) when that is under MIN.
limit_for() {
    local left=$(( BUDGET - ($(date +%s) - T0) - GRACE ))
    (( left >= $2 )) || return 1
    echo $(( left < $1 ? left : $1 ))
}
skipped() { echo "skipped (under ${1} s of the ${BUDGET} s budget left)"; }

# --- the machine
command -v timeout >/dev/null || { echo "gpu_check: no 'timeout' command (coreutils): stopping"; exit 1; }
command -v "$PY" >/dev/null || { echo "gpu_check: no $PY on PATH (set PY=...): stopping"; exit 1; }
note "machine (mode: $( ((SMOKE)) && echo "--cpu-smoke" || echo GPU))"
if command -v nvidia-smi >/dev/null; then
    timeout -k "$GRACE" 30 nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
fi
echo "cores: $(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc); $(date -u); C compiler (torch.compile and" \
     "triton need one): $(command -v cc || command -v gcc || echo none)"
if (( SMOKE )); then
    if grep -qE 'avx512_bf16|amx_bf16' /proc/cpuinfo 2>/dev/null; then BF16=(--amp --amp-dtype bf16); DT=bf16
    else BF16=(); DT="fp32 (no native bf16)"; fi
    FP16=(); FP16_DT="fp32 (smoke)"; COMPILE_AMP=(); COMPILE_DT=fp32
else
    BF16=(--amp --amp-dtype bf16); DT=bf16; FP16=(--amp --amp-dtype fp16); FP16_DT="fp16 + GradScaler"
    COMPILE_AMP=("${BF16[@]}"); COMPILE_DT=bf16
fi

# --- helper programs (written each time: the script is all there is to copy)
DRIVER=$RUNS/py/driver.py
cat > "$DRIVER" <<'EOF'
"""pretrain_ddp.main(argv) in this process, then the peak memory, which the trainer does not print.
Exit 3: out of memory (the caller retries with a smaller micro-batch)."""
import os
import resource
import sys

sys.path.insert(0, os.environ["GPU_CHECK_ROOT"])  # also in the DataLoader's forkserver, which imports this file

if __name__ == "__main__":
    if os.environ.get("GPU_CHECK_PIDFILE"):  # for the SIGTERM of the resume row
        with open(os.environ["GPU_CHECK_PIDFILE"], "w") as f:
            f.write(str(os.getpid()))
    argv = sys.argv[1:]
    fake = os.environ.get("GPU_CHECK_FAKE_OOM_ABOVE")
    if fake and int(argv[argv.index("--batch-size") + 1]) > int(fake):
        print(f"gpu_check: out of memory (simulated: GPU_CHECK_FAKE_OOM_ABOVE={fake})", flush=True)
        sys.exit(3)
    import torch

    import pretrain_ddp
    try:
        pretrain_ddp.main(argv)
    except Exception as e:  # torch.cuda.OutOfMemoryError, or an OOM wrapped by torch.compile
        if isinstance(e, torch.cuda.OutOfMemoryError) or "out of memory" in str(e).lower():
            print(f"gpu_check: out of memory: {str(e).strip().splitlines()[0][:300]}", flush=True)
            sys.exit(3)
        raise
    if torch.cuda.is_available():
        print(f"gpu_check: peak memory: {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB allocated, "
              f"{torch.cuda.max_memory_reserved() / 2**30:.1f} GiB reserved", flush=True)
    else:
        print(f"gpu_check: peak memory: n/a on the CPU (peak RSS "
              f"{resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.1f} GiB)", flush=True)
EOF
ROW=$RUNS/py/row.py
cat > "$ROW" <<'EOF'
"""One table cell from the trainer's own outputs (its log and summary.json); fields that this trainer
version does not write are n/a. Prints 'ok: ...' (exit 0) or 'FAIL: ...' (exit 1).
    row.py perf NAME             a timed run
    row.py resume NAME_A NAME_B  a run stopped by SIGTERM, then resumed"""
import json
import math
import os
import re
import statistics
import sys

OUT = os.environ["OUT"]


def load(name):
    with open(os.path.join(OUT, name + ".log"), errors="replace") as f:
        log = f.read()
    try:
        with open(os.path.join(OUT, name + ".summary.json")) as f:
            summary = json.load(f)
    except (OSError, ValueError):
        summary = None
    return log, summary


def scalars(log, key, after=0):
    """The key's values in the 'step N: k v, ...' lines after step `after`."""
    found = []
    for step, rest in re.findall(r"^step (\d+): (.*)$", log, re.M):
        m = re.search(re.escape(key) + r" ([-+\d.e]+|nan|inf)", rest)
        if m and int(step) > after:
            found.append(float(m[1]))
    return found


def pct(x):
    return "n/a" if x is None else f"{x:.1%}"


def finite(summary):
    loss = (summary or {}).get("train_loss")
    return isinstance(loss, (int, float)) and math.isfinite(loss)


def config(log):
    m = re.search(r"^config: (\{.*\})$", log, re.M)
    try:
        return json.loads(m[1]) if m else {}
    except ValueError:
        return {}


def describe(log, summary, timed_note=True):
    """tokens/s, MFU, data wait, peak memory, batch, workers, timed steps, loss."""
    s, cfg = summary, config(log)
    steady_from = s.get("steady_from_step")
    timed = s["steps"] - steady_from if steady_from is not None else None
    wait = s.get("data_wait_share")
    if wait is None:  # older trainers: the median of the logged intervals after the steady start
        waits = scalars(log, "train/data_wait", after=steady_from or 0)
        wait = statistics.median(waits) if waits else None
    tps = s.get("tokens_per_sec")
    peak = re.findall(r"^gpu_check: peak memory: (.*)$", log, re.M)
    workers = cfg.get("num_workers")
    parts = [f"{tps:,.0f} tok/s" if tps else "tok/s n/a", f"MFU {pct(s.get('mfu'))}", f"data wait {pct(wait)}",
             f"peak {peak[-1] if peak else 'n/a'}", f"batch {cfg.get('batch_size', 'n/a')}",
             f"workers {workers if workers is not None else 'n/a'}",
             f"{timed if timed is not None else 'n/a'} timed steps"
             + (f" (under {os.environ['MIN_TIMED']})" if timed_note and timed is not None
                and timed < int(os.environ["MIN_TIMED"]) else ""),
             f"loss {s['train_loss']:.3f}"]
    return ", ".join(parts)


def perf(name):
    log, s = load(name)
    if s is None:
        return "FAIL: no summary.json"
    if not finite(s):
        return f"FAIL: train loss {s.get('train_loss')}"
    return "ok: " + describe(log, s)


def resume(name_a, name_b):
    (log_a, a), (log_b, b) = load(name_a), load(name_b)
    problems = []
    if a is None or not finite(a) or not a.get("stopped_by_signal"):
        problems.append(f"run 1: summary {'missing' if a is None else 'without a finite loss or a signal stop'}")
    if not re.search(r"^resumed from .* at step \d+", log_b, re.M):
        problems.append("run 2 did not say 'resumed from'")
    if b is None or not finite(b):
        problems.append("run 2: no finite train loss")
    if problems:
        return "FAIL: " + "; ".join(problems)
    at = re.search(r"^resumed from .* at step (\d+)", log_b, re.M)[1]
    scale_a, scale_b = scalars(log_a, "train/loss_scale"), scalars(log_b, "train/loss_scale")
    scale = f"loss scale {scale_a[-1]:g} -> {scale_b[-1]:g}, " if scale_a and scale_b else ""
    skips = [x.get("skipped_steps", x.get("fp16_overflow_skips", "n/a")) for x in (a, b)]
    return (f"ok: SIGTERM stop at step {a['steps']}, resumed at step {at} to {b['steps']}; loss {a['train_loss']:.3f}"
            f" -> {b['train_loss']:.3f}; {scale}overflow skips {skips[0]} + {skips[1]}; run 2: "
            + describe(log_b, b, timed_note=False))


def ab(packed, padded):
    """nsp pairs packed into rows against a padded row per pair: real tokens/s, MFU, padding, the ratio."""
    (log_a, a), (log_b, b) = load(packed), load(padded)
    if not (finite(a) and finite(b)):
        return "FAIL: " + ("no finite loss packed" if not finite(a) else "no finite loss unpadded")
    cells = [f"{name} {s['tokens_per_sec']:,.0f} tok/s, MFU {pct(s.get('mfu'))}, padding {pct(s.get('padding_share'))}"
             for name, s in (("packed", a), ("--no-packing", b))]
    return f"ok: {cells[0]}; {cells[1]}; packed/unpacked {a['tokens_per_sec'] / b['tokens_per_sec']:.2f}x"


text = {"perf": lambda: perf(sys.argv[2]), "resume": lambda: resume(sys.argv[2], sys.argv[3]),
        "ab": lambda: ab(sys.argv[2], sys.argv[3])}[sys.argv[1]]()
print(text)
sys.exit(0 if text.startswith("ok") else 1)
EOF
BASICS=$RUNS/py/basics.py
cat > "$BASICS" <<'EOF'
"""CUDA: pinned memory, a non_blocking copy, nccl all_reduce at world size 1 and the gloo control group
that pretrain_ddp runs beside nccl. CPU (--cpu-smoke): the gloo group and control group only."""
import torch
import torch.distributed as dist

cuda = torch.cuda.is_available()
done = []
if cuda:
    x = torch.randn(64, 128).pin_memory()
    assert x.is_pinned(), "pin_memory() did not pin"
    y = x.to("cuda", non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(y.cpu(), x)
    torch.cuda.set_device(0)
    done.append("pinned memory, non_blocking copy")
# an in-process store: world size 1 needs no port (nothing to collide with on a shared machine)
dist.init_process_group("nccl" if cuda else "gloo", store=dist.HashStore(), rank=0, world_size=1,
                        device_id=torch.device("cuda", 0) if cuda else None)
t = torch.ones(6, device="cuda" if cuda else "cpu")
dist.all_reduce(t)
ctrl = dist.new_group(backend="gloo")  # pretrain_ddp's control group under nccl
c = torch.ones(6, dtype=torch.float64)
dist.all_reduce(c, group=ctrl)
assert t.sum().item() == 6 and c.sum().item() == 6
dist.destroy_process_group()
done.append(f"{'nccl' if cuda else 'gloo'} all_reduce (1 rank), gloo control group")
print("gpu_check ok: " + ", ".join(done))
EOF
DDP_CHECK=$RUNS/py/ddp_check.py
cat > "$DDP_CHECK" <<'EOF'
"""Under torchrun: the trainer's DDP wrap (wrap_ddp) and train_step on real batches: N ranks each train
their share of a step's micro-batches; rank 0 also trains an unwrapped copy on the whole batch. The loss
must stay finite and the weights must move as the copy's (the trainer's loss normalisation and DDP's
gradient average give one big batch's gradient). nccl on a GPU (1 rank on one device), gloo on a CPU."""
import contextlib
import copy
import math
import os
import sys

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS, before CUDA starts
sys.path.insert(0, os.environ["GPU_CHECK_ROOT"])
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: E402

import model as M  # noqa: E402
import pretrain_ddp as P  # noqa: E402

SIZE, WIDTH, BATCH, STEPS, VOCAB = os.environ["DDP_SIZE"], int(os.environ["DDP_SEQ"]), 8, 3, 8192
cuda = torch.cuda.is_available()
device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if cuda else torch.device("cpu")
if cuda:
    torch.cuda.set_device(device)
else:
    torch.set_num_threads(1)
torch.use_deterministic_algorithms(True, warn_only=True)
dist.init_process_group("nccl" if cuda else "gloo", device_id=device if cuda else None)
rank, world = dist.get_rank(), dist.get_world_size()


def step_batches(step):
    """The whole step: world x 1 micro-batches of BATCH rows, some padded, 15% of the tokens masked."""
    g = torch.Generator().manual_seed(step)
    out = []
    for _ in range(world):
        ids = torch.randint(5, VOCAB, (BATCH, WIDTH), generator=g)
        lengths = torch.randint(WIDTH // 2, WIDTH + 1, (BATCH,), generator=g)
        attention = (torch.arange(WIDTH)[None] < lengths[:, None]).long()
        chosen = (torch.rand(BATCH, WIDTH, generator=g) < 0.15) & attention.bool()
        out.append({"input_ids": ids * attention, "token_type_ids": torch.zeros_like(ids),
                    "attention_mask": attention, "labels": torch.where(chosen, ids, -100)})
    return out


def train(model, ranks, parts_of):
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler(device.type, enabled=False)
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if cuda else contextlib.nullcontext()
    losses = []
    for step in range(STEPS):
        everything = step_batches(step)
        g_masked = sum(int((b["labels"] != -100).sum()) for b in everything)
        window = [M.prepare(M.sparse_targets(dict(b)), device)[0] for b in parts_of(everything)]
        sums = P.train_step(P.Trainer(model, model, opt, scaler, amp), window, (g_masked, BATCH * world), ranks,
                            1.0, 0.05).sums
        local = torch.tensor([float(sums[0])], dtype=torch.float64, device=device)  # nccl: on the GPU
        if ranks > 1:
            dist.all_reduce(local)
        losses.append(local.item() / g_masked)
    return losses


torch.manual_seed(0)
layers, hidden, heads = M.MODEL_SIZES[SIZE]
from transformers import BertConfig, BertForMaskedLM  # noqa: E402

config = BertConfig(vocab_size=VOCAB, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                    intermediate_size=4 * hidden, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
model = M.Pretraining(BertForMaskedLM(config)).to(device)
reference, initial = copy.deepcopy(model), copy.deepcopy(model)
wrapped = P.wrap_ddp(model, device)
assert isinstance(wrapped, DDP), type(wrapped)
losses = train(wrapped, world, lambda everything: everything[rank:rank + 1])
# every rank holds the same weights
check = torch.tensor([sum(p.double().sum().item() for p in model.parameters())] * 2, dtype=torch.float64,
                     device=device)
check[1] = -check[1]
dist.all_reduce(check, op=dist.ReduceOp.MAX)
same_on_ranks = check[0].item() == -check[1].item()
if rank == 0:
    def whole(everything):
        return [{k: torch.cat([b[k] for b in everything]) for k in everything[0]}]
    ref_losses = train(reference, 1, whole)
    diff = max((a - b).abs().max().item() for a, b in zip(model.parameters(), reference.parameters(), strict=True))
    moved = max((a - b).abs().max().item() for a, b in zip(reference.parameters(), initial.parameters(), strict=True))
    tolerance = 1e-5 if not cuda else 2e-2 * moved  # bf16 autocast on the GPU: its kernels may sum in another order
    text = (f"{world} rank(s) over {dist.get_backend()} on {device.type}, BERT-{SIZE}, {STEPS} steps: loss "
            f"{losses[0]:.3f} -> {losses[-1]:.3f} (unwrapped {ref_losses[0]:.3f} -> {ref_losses[-1]:.3f}); weights "
            f"moved "
            f"{moved:.2e}, max |ddp - unwrapped| {diff:.2e}; ranks {'identical' if same_on_ranks else 'DIFFER'}")
    ok = (all(math.isfinite(x) for x in losses + ref_losses) and moved > 0 and diff <= tolerance
          and same_on_ranks)
    print(("gpu_check ok: " if ok else "gpu_check FAIL: ") + text, flush=True)
dist.barrier()  # rank 0 trained the unwrapped copy meanwhile: the ranks end together
dist.destroy_process_group()
EOF

SETUP=$RUNS/py/setup.py
cat > "$SETUP" <<'EOF'
"""The environment, then the data. Exit 10: a module or the GPU is missing (the script stops). The data: COPIES
copies of the builtin corpus's train split in one file (enough tokens that a timed run stays in one epoch: a
new epoch restarts the DataLoader workers), then `data_stream.py --build-cache` on it: its tokenizer and token
cache, so that the timed runs only read ids. Lines for the script's output start with 'gpu_check: '."""
import importlib
import os
import sys

missing = []
for name in ("torch", "transformers", "tokenizers", "numpy"):
    try:
        importlib.import_module(name)
    except Exception as e:  # ImportError, or a broken install
        missing.append(f"{name} ({type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''})")
if missing:
    print(f"gpu_check: {sys.executable} cannot import {', '.join(missing)}; nothing is installed here (no pip, "
          "no network): use a Python that has them (PY=...). Stopping.", flush=True)
    sys.exit(10)
import torch  # noqa: E402
import transformers  # noqa: E402

print(f"gpu_check: python {sys.version.split()[0]} ({sys.executable}), torch {torch.__version__} (cuda "
      f"{torch.version.cuda}), transformers {transformers.__version__}", flush=True)
if sys.argv[1] == "0":
    if not torch.cuda.is_available():
        print("gpu_check: torch.cuda.is_available() is False: no usable GPU (--cpu-smoke checks the script on a "
              "CPU). Stopping.", flush=True)
        sys.exit(10)
    try:
        native = torch.cuda.is_bf16_supported(including_emulation=False)
    except TypeError:  # an older torch
        native = torch.cuda.is_bf16_supported()
    print(f"gpu_check: {torch.cuda.get_device_name(0)}; bf16 on tensor cores: {native}", flush=True)

sys.path.insert(0, os.environ["GPU_CHECK_ROOT"])
import data_stream  # noqa: E402

path, copies = sys.argv[2], int(sys.argv[3])
with open(data_stream.build_builtin_corpus()[0]) as f:
    text = f.read().strip()
body = "\n\n".join([text] * copies) + "\n"
if not os.path.exists(path) or os.path.getsize(path) != len(body.encode()):  # else keep it: its cache stays valid
    with open(path, "w") as f:
        f.write(body)
print(f"{path}: {os.path.getsize(path) / 1e6:.1f} MB", flush=True)
data_stream.main(["--corpus", path, "--objective", "mlm", "--build-cache"])
EOF

# A snippet's row: LABEL MAX MIN command...: ok with the snippet's "gpu_check ok:" line, else FAIL.
snippet_row() {
    local label=$1 max=$2 min=$3 name=$4 limit line rc exit_note=""; shift 4
    limit=$(limit_for "$max" "$min") || { record "$label" "$(skipped "$min")"; return; }
    note "$label (timeout ${limit} s)"
    timeout -k "$GRACE" "$limit" "$@" > "$OUT/$name.log" 2>&1
    rc=$?
    (( rc )) && exit_note="; then exit $rc$( ((rc == 124 || rc == 137)) && echo " (timed out after $limit s)")"
    line=$(grep -E '^gpu_check (ok|FAIL): ' "$OUT/$name.log" | tail -1)
    if [[ $line == "gpu_check ok: "* ]] && ! grep -qE '^gpu_check FAIL' "$OUT/$name.log"; then
        record "$label" "ok: ${line#gpu_check ok: }$exit_note"  # the check passed; a crash after it is shown
    else
        tail -15 "$OUT/$name.log"
        record "$label" "FAIL: ${line#gpu_check FAIL: }${line:+; }exit $rc; see $OUT/$name.log"
    fi
}

# A trainer run in the driver: NAME MAX MIN flags... Its log and summary.json go to $OUT.
# Returns 0 (finished), 3 (out of memory), 4 (skipped: budget), else 1.
CORPUS=$RUNS/corpus/train.txt
COMMON=(--objective mlm --corpus "$CORPUS" --model-size "$MODEL" --log-to stdout --eval-corpus none
        --save-every 1000000 --epochs 100 --log-every "$LOG_EVERY")
[ -n "$WORKERS" ] && COMMON+=(--num-workers "$WORKERS")
LIMIT=0
train() {
    local name=$1 max=$2 min=$3 rc; shift 3
    LIMIT=$(limit_for "$max" "$min") || return 4
    note "run $name (timeout ${LIMIT} s): $*"
    rm -rf "${RUNS:?}/$name" "$OUT/$name.summary.json"
    timeout -k "$GRACE" "$LIMIT" "$PY" "$DRIVER" "${COMMON[@]}" --out-dir "$RUNS/$name" "$@" > "$OUT/$name.log" 2>&1
    rc=$?
    [ -f "$RUNS/$name/summary.json" ] && cp "$RUNS/$name/summary.json" "$OUT/$name.summary.json"
    rm -rf "${RUNS:?}/$name"  # its checkpoint and hf export: GBs for base
    (( rc == 0 || rc == 3 )) && return "$rc"
    tail -15 "$OUT/$name.log"
    (( rc == 124 || rc == 137 )) && echo "timed out after ${LIMIT} s" >> "$OUT/$name.log"
    return 1
}
# A timed row: LABEL NAME MAX MIN "BATCH [FALLBACK]" flags...; FIT is the micro-batch that fit.
FIT=
perf_row() {
    local label=$1 name=$2 max=$3 min=$4 batches=$5 b rc tried=""; shift 5
    FIT=
    for b in $batches; do
        train "$name" "$max" "$min" --batch-size "$b" "$@"; rc=$?
        case $rc in
            0) FIT=$b; record "$label" "$("$PY" "$ROW" perf "$name")$tried"; return ;;
            3) tried="${tried}; batch $b ran out of memory$(grep -q simulated "$OUT/$name.log" && echo ' (simulated)')"
               cp "$OUT/$name.log" "$OUT/$name.oom$b.log" ;;
            4) record "$label" "$(skipped "$min")$tried"; return ;;
            *) record "$label" "FAIL: $(tail -1 "$OUT/$name.log" | cut -c1-200)$tried; see $OUT/$name.log"; return ;;
        esac
    done
    record "$label" "FAIL: out of memory at every micro-batch tried (${batches})"
}

# --- the environment (nothing is installed: a missing module stops here), then the data: the corpus, its
# tokenizer and token cache, once (the runs then only read the cache)
note "environment; data: the builtin train split x $COPIES, its tokenizer and token cache"
mkdir -p "$RUNS/corpus"
timeout -k "$GRACE" 180 "$PY" "$SETUP" "$SMOKE" "$CORPUS" "$COPIES" > "$OUT/setup.log" 2>&1
rc=$?
grep '^gpu_check: ' "$OUT/setup.log" | sed 's/^gpu_check: //'
if (( rc == 10 )); then exit 1; fi
DATA_OK=$(( rc == 0 ))
if (( DATA_OK )); then
    record "data: corpus, tokenizer, token cache" "ok: $(grep -o '[0-9.]* MB$' "$OUT/setup.log"), $(grep -o \
        '[0-9,]* tokens in [0-9.]* s' "$OUT/setup.log") into the cache"
else
    tail -15 "$OUT/setup.log"
    record "data: corpus, tokenizer, token cache" "FAIL: exit $rc; see $OUT/setup.log"
fi
NODATA="skipped (no corpus: the data row failed)"

# --- 1. plain CUDA: pinned memory, non_blocking copies, nccl (1 rank) + the gloo control group
B_LABEL="1 cuda: pinned, nccl 1 rank, gloo ctrl"
(( SMOKE )) && B_LABEL="1 cpu: gloo 1 rank + gloo control group"
snippet_row "$B_LABEL" 60 20 basics "$PY" "$BASICS"

# --- 2. BERT-base, seq 128, bf16, eager: the micro-batch that fits, tokens/s, MFU, data wait, peak memory
L2="2 $MODEL seq $SEQ $DT eager"
if (( DATA_OK )); then
    perf_row "$L2" eager "${RUN_LIMITS[@]}" "$BATCH $BATCH_FALLBACK" --max-seq-len "$SEQ" --max-steps "$STEPS" \
        "${BF16[@]}"
else record "$L2" "$NODATA"; fi
B128=${FIT:-$BATCH_FALLBACK}
unset GPU_CHECK_FAKE_OOM_ABOVE  # the smoke's simulated OOM is for row 2's first try only

# --- 3. the DDP wrap: nccl at world size 1 on the GPU (2 ranks over gloo in the smoke)
L3="3 ddp: wrap_ddp + train_step, nccl 1 rank"
(( SMOKE )) && L3="3 ddp: wrap_ddp + train_step, gloo 2 ranks"
snippet_row "$L3" 120 45 ddp \
    env DDP_SIZE="$MODEL" DDP_SEQ="$SEQ" "$PY" -m torch.distributed.run --standalone --nproc_per_node "$DDP_RANKS" \
    "$DDP_CHECK"

# --- 4. seq 512 (BERT's phase 2)
L4="4 $MODEL seq $SEQ2 $DT eager"
if (( DATA_OK )); then
    perf_row "$L4" seq2 "${RUN_LIMITS[@]}" "$BATCH512 $BATCH512_FALLBACK" --max-seq-len "$SEQ2" --max-steps "$STEPS" \
        "${BF16[@]}" "${LIGHT[@]}"
else record "$L4" "$NODATA"; fi

# --- 5. fp16 + GradScaler, stopped by SIGTERM after step STOP_AT, then resumed with MORE steps
L5="5 $MODEL seq $SEQ $FP16_DT, SIGTERM + resume"
resume_row() {
    local limit pid_file=$RUNS/resume.pid tpid rc rc_a steps
    limit=$(limit_for "${RUN_LIMITS[@]}") || { record "$L5" "$(skipped "${RUN_LIMITS[1]}")"; return; }
    note "run resume_a (timeout ${limit} s; SIGTERM after step $STOP_AT)"
    rm -rf "${RUNS:?}/resume" "$pid_file" "$OUT"/resume_[ab].summary.json
    GPU_CHECK_PIDFILE=$pid_file timeout -k "$GRACE" "$limit" "$PY" "$DRIVER" "${COMMON[@]}" --out-dir "$RUNS/resume" \
        --batch-size "$B128" --max-seq-len "$SEQ" --max-steps $(( STOP_AT * 10 )) "${FP16[@]}" "${LIGHT[@]}" \
        > "$OUT/resume_a.log" 2>&1 &
    tpid=$!
    while kill -0 "$tpid" 2>/dev/null && ! grep -q "^step $STOP_AT:" "$OUT/resume_a.log"; do sleep 0.2; done
    if grep -q "^step $STOP_AT:" "$OUT/resume_a.log" && [ -s "$pid_file" ]; then
        kill -TERM "$(cat "$pid_file")" 2>/dev/null
    fi
    wait "$tpid"; rc_a=$?
    [ -f "$RUNS/resume/summary.json" ] && cp "$RUNS/resume/summary.json" "$OUT/resume_a.summary.json"
    if [ ! -f "$OUT/resume_a.summary.json" ]; then  # no report: it crashed, or timed out before it stopped
        tail -15 "$OUT/resume_a.log"; rm -rf "${RUNS:?}/resume"
        record "$L5" "FAIL: run 1 (exit $rc_a): $(tail -1 "$OUT/resume_a.log" | cut -c1-200); see $OUT/resume_a.log"
        return
    fi
    steps=$("$PY" -c 'import json, sys; print(json.load(open(sys.argv[1]))["steps"])' "$OUT/resume_a.summary.json")
    if ! limit=$(limit_for "${RUN_LIMITS[@]}"); then
        rm -rf "${RUNS:?}/resume"; record "$L5" "$(skipped "${RUN_LIMITS[1]}") (run 2)"; return
    fi
    note "run resume_b (timeout ${limit} s): --resume auto to step $(( steps + MORE ))"
    timeout -k "$GRACE" "$limit" "$PY" "$DRIVER" "${COMMON[@]}" --out-dir "$RUNS/resume" --resume auto \
        --batch-size "$B128" --max-seq-len "$SEQ" --max-steps $(( steps + MORE )) "${FP16[@]}" "${LIGHT[@]}" \
        > "$OUT/resume_b.log" 2>&1
    rc=$?
    [ -f "$RUNS/resume/summary.json" ] && cp "$RUNS/resume/summary.json" "$OUT/resume_b.summary.json"
    rm -rf "${RUNS:?}/resume"
    (( rc == 0 )) || tail -15 "$OUT/resume_b.log"
    record "$L5" "$("$PY" "$ROW" resume resume_a resume_b)$( ((rc_a)) && echo "; run 1 exit $rc_a")$( ((rc)) \
        && echo "; run 2 exit $rc")"
}
if (( DATA_OK )); then resume_row; else record "$L5" "$NODATA"; fi

# --- 7. nsp: pairs packed into rows (the default) against --no-packing, at seq SEQ and SEQ2 (issue 37)
ab_row() {
    local label=$1 seq=$2 batch=$3 rc mode; shift 3
    for mode in packed padded; do
        train "ab_$mode$seq" "${RUN_LIMITS[@]}" --objective nsp --batch-size "$batch" --max-seq-len "$seq" \
            --max-steps "$STEPS_AB" "${BF16[@]}" "${LIGHT[@]}" $( [ $mode = padded ] && echo --no-packing ); rc=$?
        (( rc == 4 )) && { record "$label" "$(skipped "${RUN_LIMITS[1]}")"; return; }
        (( rc )) && { record "$label" "FAIL: $mode: $(tail -1 "$OUT/ab_$mode$seq.log" | cut -c1-200)"; return; }
    done
    record "$label" "$("$PY" "$ROW" ab "ab_packed$seq" "ab_padded$seq")"
}
if (( DATA_OK )); then
    # The smoke runs 7b alone: 7a is the same function with row 2's seq and batch (which rows 2, 5 and 6 run),
    # and its two more trainer starts were ~14 s of the suite's time
    if (( SMOKE )); then record "7a $MODEL nsp seq $SEQ $DT: packed vs padded" "not run in the smoke: 7b's code"
    else ab_row "7a $MODEL nsp seq $SEQ $DT: packed vs padded" "$SEQ" "$B128"; fi
    ab_row "7b $MODEL nsp seq $SEQ2 $DT: packed vs padded" "$SEQ2" "$BATCH512"
else record "7 nsp packed vs padded" "$NODATA"; fi

# --- 8. ModernBERT's block (--arch modernbert, issue 51), mlm at seq SEQ2: RoPE, GeGLU, its 128-token band
# inside the rows, in bf16
L8="8 modernbert $MODEL mlm seq $SEQ2 $DT eager"
if (( DATA_OK )); then
    perf_row "$L8" modern "${RUN_LIMITS[@]}" "$BATCH512 $BATCH512_FALLBACK" --arch modernbert --max-seq-len "$SEQ2" \
        --max-steps "$STEPS_AB" "${BF16[@]}" "${LIGHT[@]}"
else record "$L8" "$NODATA"; fi

# --- 6. row 2 with --compile, last: compiling takes the longest, and its timeout shrinks to the budget left
L6="6 $MODEL seq $SEQ $COMPILE_DT --compile"
if (( SMOKE )) && [ "$SMOKE_COMPILE_BACKEND" != inductor ]; then
    # torch's debug override of the backend (torch >= 2.13; older ones compile with inductor): dynamo traces
    # the model with the trainer's dynamic dims and AOT autograd builds forward and backward, but no kernels
    # are generated; inductor's C++ build of BERT-tiny took 55 s on 2 idle cores, over 2 min on loaded ones
    export TORCH_COMPILE_OVERRIDE_BACKENDS=">=0:$SMOKE_COMPILE_BACKEND"
    L6="$L6 ($SMOKE_COMPILE_BACKEND)"
fi
if (( DATA_OK )); then
    perf_row "$L6" compile "${COMPILE_LIMITS[@]}" "$B128" --max-seq-len "$SEQ" --max-steps "$STEPS" --compile \
        "${COMPILE_AMP[@]}" "${LIGHT[@]}"
    [ -z "$FIT" ] && (( OWN_INDUCTOR_CACHE )) && rm -rf "${RUNS:?}/inductor"
else record "$L6" "$NODATA"; fi

# --- the table (last; each row was printed and written to $OUT/table.txt as it came)
echo
echo "gpu_check$( ((SMOKE)) && echo " --cpu-smoke"): $(( $(date +%s) - T0 )) s of ${BUDGET} s; rows 2 and 6:" \
     "seq $SEQ, $STEPS steps; rates are summary.json's steady ones (after step 5); results in $OUT"
for r in "${RESULTS[@]}"; do printf '%-50s | %s\n' "${r%%|*}" "${r#*|}"; done
exit $(( FAILS > 0 ))
