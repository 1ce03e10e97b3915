#!/usr/bin/env bash
# GPU checks for pretrain_ddp.py, one GPU, under ~8 minutes: the CUDA code paths work, then
# tokens/s and MFU of BERT-base at seq 128 in bf16 and fp16, eager and --compile.
#
#     bash bench/gpu_check.sh                 # from the repository root; results in $OUT (or /tmp/gpu_check)
#     STEPS=40 BATCH=32 bash bench/gpu_check.sh
#
# What one GPU cannot check: DDP over nccl with 2+ ranks (NCCL refuses two ranks on one device), so nccl is
# checked with 1 rank and DDP itself by the CPU tests (gloo). Never run on the CPU-only development machine
# (it stops at the first check). Each command has its own
# timeout; a failure is recorded as FAIL in the table and the script goes on. Runs write checkpoints
# (BERT-base + AdamW: ~1.3 GB) to $RUNS outside $OUT; only logs and summary.json files go to $OUT.
set -u
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_check}
RUNS=${RUNS:-/tmp/gpu_check_runs}
STEPS=${STEPS:-60}        # optimizer steps per performance run (log every 10; the first 20 are warmup)
BATCH=${BATCH:-64}        # micro-batch of the performance runs
WORKERS=${WORKERS:-4}     # DataLoader workers of the performance runs
BUDGET=${BUDGET:-470}     # seconds: a run starts only if its timeout ends inside this (the whole stays < 8 min)
mkdir -p "$OUT" "$RUNS"
LOG="$OUT/gpu_check.log"
rm -f "$OUT/table.txt"
exec > >(tee -a "$LOG") 2>&1
T0=$(date +%s)
RESULTS=()
note() { echo "== [$(( $(date +%s) - T0 )) s] $*"; }
# every row goes to the table file as soon as it is measured: a cut run keeps what it measured
record() { RESULTS+=("$1|$2"); note "$1: $2"; printf '%-52s %s\n' "$1" "$2" >> "$OUT/table.txt"; }
fits() { (( $(date +%s) - T0 + $1 <= BUDGET )); }  # does a run with this timeout end inside the budget?

# --- environment: import first, install only if needed (the machine may have no network)
note "machine"; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
nproc; date -u
if ! python -c "import torch, transformers, tokenizers, numpy" 2>/dev/null; then
    note "installing requirements"
    timeout 300 pip install -q -r requirements.txt || { echo "pip install failed: stopping"; exit 1; }
fi
python - <<'EOF' || { echo "no usable CUDA torch: stopping"; exit 1; }
import torch, transformers
print(f"torch {torch.__version__} (cuda {torch.version.cuda}), transformers {transformers.__version__}")
assert torch.cuda.is_available(), "torch.cuda.is_available() is False"
print(torch.cuda.get_device_name(0), "bf16 supported:", torch.cuda.is_bf16_supported())
EOF
export TOKENIZERS_PARALLELISM=false

# --- 1. plain CUDA checks: pinned memory, non_blocking copies, nccl (1 rank) + the gloo control group
note "cuda basics"
if timeout 120 python - <<'EOF'
import os, torch, torch.distributed as dist
x = torch.randn(64, 128).pin_memory()
assert x.is_pinned(), "pin_memory() did not pin"
y = x.to("cuda", non_blocking=True)
torch.cuda.synchronize()
assert torch.equal(y.cpu(), x)
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29531")
torch.cuda.set_device(0)
dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
t = torch.ones(6, device="cuda")
dist.all_reduce(t)
ctrl = dist.new_group(backend="gloo")  # pretrain_ddp's control group under nccl
c = torch.ones(6, dtype=torch.float64)
dist.all_reduce(c, group=ctrl)
assert t.sum().item() == 6 and c.sum().item() == 6
dist.destroy_process_group()
print("pinned memory, non_blocking copy, nccl all_reduce, gloo control group: ok")
EOF
then record "pinned + nccl(1 rank) + gloo ctrl" ok; else record "pinned + nccl(1 rank) + gloo ctrl" FAIL; fi

# A pretrain_ddp.py run: name, timeout, launcher..., -- flags. Keeps its stdout and summary.json in $OUT.
train() {
    local name=$1 limit=$2; shift 2
    note "run $name: $*"
    rm -rf "${RUNS:?}/$name"
    if timeout "$limit" "$@" --out-dir "$RUNS/$name" --log-to stdout --eval-corpus none --save-every 1000000 \
            --resume none > "$OUT/$name.log" 2>&1 && [ -f "$RUNS/$name/summary.json" ]; then
        cp "$RUNS/$name/summary.json" "$OUT/$name.summary.json"
        rm -rf "${RUNS:?}/$name"  # its checkpoint and hf export: GBs for base
        return 0
    fi
    tail -20 "$OUT/$name.log"
    return 1
}
# The train loss of a finished run is finite
finite() { python -c "import json,math,sys; s=json.load(open('$OUT/$1.summary.json')); \
sys.exit(0 if s['train_loss'] is not None and math.isfinite(s['train_loss']) else 1)"; }

# --- 2. the mixed-precision paths and torchrun (short, tiny model)
SKIP="skipped (its 150 s would end past the budget)"
if ! fits 150; then record "fp16 + GradScaler (tiny)" "$SKIP"
elif train fp16_tiny 150 python pretrain_ddp.py --amp --amp-dtype fp16 --max-steps 30 --log-every 10 \
        && finite fp16_tiny && grep -q "train/loss_scale" "$OUT/fp16_tiny.log"; then
    record "fp16 + GradScaler (tiny)" "ok, loss scale $(grep -o 'loss_scale [0-9.e+]*' "$OUT/fp16_tiny.log" | tail -1)"
else record "fp16 + GradScaler (tiny)" FAIL; fi
if ! fits 150; then record "bf16 autocast (tiny)" "$SKIP"
elif train bf16_tiny 150 python pretrain_ddp.py --amp --amp-dtype bf16 --max-steps 30 --log-every 10 \
        && finite bf16_tiny; then record "bf16 autocast (tiny)" ok; else record "bf16 autocast (tiny)" FAIL; fi
# One rank under torchrun: pretrain_ddp only creates a process group (nccl) for world size > 1, so this
# checks the torchrun environment path; nccl itself was checked in step 1.
if ! fits 150; then record "torchrun 1 rank, --amp, 2 workers, pinned (tiny)" "$SKIP"
elif train torchrun1_tiny 150 python -m torch.distributed.run --standalone --nproc_per_node 1 pretrain_ddp.py --amp --max-steps 30 \
        --log-every 10 --num-workers 2 && finite torchrun1_tiny; then
    record "torchrun 1 rank, --amp, 2 workers, pinned (tiny)" ok
else record "torchrun 1 rank, --amp, 2 workers, pinned (tiny)" FAIL; fi

# --- 3. performance: BERT-base, seq 128; tokens/s and MFU averaged over the log intervals after step 20
perf() {
    local name=$1 limit=$2; shift 2
    if ! fits "$limit"; then record "$name" "skipped (its ${limit} s would end past the ${BUDGET} s budget)"; return; fi
    if train "$name" "$limit" python pretrain_ddp.py --model-size base --max-seq-len 128 --batch-size "$BATCH" \
            --num-workers "$WORKERS" --max-steps "$STEPS" --log-every 10 --amp "$@"; then
        record "$name" "$(python - "$OUT/$name.log" <<'EOF'
import re, statistics, sys
rows = [(int(m[1]), m[2]) for m in re.finditer(r"^step (\d+): (.*)$", open(sys.argv[1]).read(), re.M)]
def col(key):
    return [float(re.search(key + r" ([\d.e+-]+)", s)[1]) for step, s in rows if step > 20 and key in s]
tps, mfu, wait = col("train/tokens_per_sec"), col("train/mfu"), col("train/data_wait")
mfu_text = f"{statistics.median(mfu):.1%}" if mfu else "n/a (GPU not in GPU_PEAKS)"
print(f"{statistics.median(tps):,.0f} tok/s, MFU {mfu_text}, data_wait {statistics.median(wait):.1%}"
      if tps else "no log interval after step 20")
EOF
)"
    else record "$name" FAIL; fi
}
perf base_bf16 150 --amp-dtype bf16
perf base_fp16 150 --amp-dtype fp16
perf base_bf16_compile 240 --amp-dtype bf16 --compile
perf base_fp16_compile 240 --amp-dtype fp16 --compile

# --- the table (last)
echo
echo "gpu_check: $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1), $(( $(date +%s) - T0 )) s;" \
     "base: batch $BATCH x seq 128, $STEPS steps, medians of 10-step intervals after step 20"
printf '%-52s %s\n' "check" "result"
for r in "${RESULTS[@]}"; do printf '%-52s %s\n' "${r%%|*}" "${r#*|}"; done
