#!/usr/bin/env bash
# Both ends of the supported version range (issue 27; BENCHMARKS.md section 13): the scripts run end to end on
# the oldest torch/transformers that requirements.txt allows and on the newest that pip resolves.
#
#     bash bench/compat.sh floor              # torch 2.11.0, transformers 5.17.0 + the small deps' floors
#     bash bench/compat.sh newest             # pip install -r requirements.txt (the newest pip resolves)
#     bash bench/compat.sh system             # no venv: python3 on PATH, as it is (CI: torch 2.13.0, tf 5.24.0)
#     bash bench/compat.sh floor /work/venvs/floor     # an existing venv (or VENV=/work/venvs/floor)
#     bash bench/compat.sh /path/to/any/venv           # whatever is installed there
#
# The venv: the 2nd argument, else $VENV, else $VENVS/<spec> (VENVS: ~/.cache/bert_ddp_compat). One that
# does not exist is created (never modified when it exists):
#   floor   python3.12 -m venv DIR   ($PYTHON overrides python3.12)
#           DIR/bin/pip install torch==2.11.0 transformers==5.17.0 tokenizers==0.23.1 numpy==1.26.4 \
#               tensorboard==2.16.2 sentencex
#           (tokenizers 0.23.1: the lowest that transformers 5.17.0 accepts, its metadata says >=0.23.1,<0.24)
#   newest  python3 -m venv DIR && DIR/bin/pip install -r requirements.txt
# torch from PyPI on Linux is the CUDA build: creating a venv downloads ~3-5 GB (torch + the nvidia-*
# wheels, ~6 GB on disk) and takes ~5-15 minutes; the checks themselves then take ~2 minutes on a quiet
# 2-core CPU (5-8 minutes while other work shares the cores; torch.compile's C++ build is the longest). CUDA is hidden (CUDA_VISIBLE_DEVICES=""): every
# run is on the CPU, the DDP ranks talk over gloo.
#
# Checks (in a temp dir; each prints one line, "ok" or "FAIL <why>", with its seconds):
#   0 setup     the versions; a generated corpus (40 documents) and a 300-word WordPiece trained on it
#   1 nsp/mlm   torchrun, 2 ranks over gloo, 1 DataLoader worker each, BERT-tiny, seq 32, batch 4 x accum 2,
#               2 epochs (the run ends by its epochs), a checkpoint every 4 steps; mlm logs to tensorboard
#               too (its events must hold train/loss for every step)
#   2 resume    a copy of each run resumes (--resume <copy>/checkpoints/step_N, the checkpoint nearest the
#               middle, in the first epoch) and runs to the end: its final weights (the latest checkpoint's
#               trainer.pt model state) equal the uninterrupted run's bit for bit, as do steps and samples
#   3 compile   --compile, 1 rank, mlm, 4 steps: finite loss, and inductor wrote its generated code
#   4 estimate  estimate_steps.py --mode exact for the settings of 1 predicts the steps each run ran
#               (summary.json: steps == planned_steps == the estimate's total_steps), and its per-epoch
#               samples minus unused samples are the samples the run trained on
# Then the versions again and the total seconds. Exit status: 0 when every check is ok, else 1 (setup: 2).
# Each command is bounded (timeout -k): T_RUN (300 s) per training run, T_COMPILE (600 s), T_EST (180 s).
# The temp dir ($TMPDIR/compat.XXXX) is deleted when all is ok, else kept for its logs (KEEP=1: always kept).
# Every cache of the runs (tokenizer, token cache, inductor) lives in the temp dir: nothing else is touched.
set -u -o pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
spec=${1:-}
if [[ -z $spec || $spec == -h || $spec == --help ]]; then
    sed -n '2,/^set -u/p' "${BASH_SOURCE[0]}" | sed '$d; s/^# \{0,1\}//'
    exit 2
fi
T_RUN=${T_RUN:-300}
T_COMPILE=${T_COMPILE:-600}
T_EST=${T_EST:-180}
FLOOR_PKGS=(torch==2.11.0 transformers==5.17.0 tokenizers==0.23.1 numpy==1.26.4 tensorboard==2.16.2 sentencex)

die() { echo "FAIL setup: $*"; exit 2; }

# ---------------------------------------------------------------- the interpreter
case $spec in
    system) PY=$(command -v "${PYTHON:-python3}") || die "no ${PYTHON:-python3} on PATH" ;;
    floor|newest)
        venv=${2:-${VENV:-${VENVS:-$HOME/.cache/bert_ddp_compat}/$spec}}
        if [[ ! -x $venv/bin/python ]]; then
            if [[ $spec == floor ]]; then base=${PYTHON:-python3.12}; else base=${PYTHON:-python3}; fi
            command -v "$base" >/dev/null || die "creating the $spec venv needs $base (PYTHON=... to choose another)"
            echo "creating $venv with $base (downloads ~3-5 GB: torch's CUDA build) ..."
            "$base" -m venv "$venv" || die "$base -m venv $venv failed"
            if [[ $spec == floor ]]; then
                timeout -k 30 3600 "$venv/bin/pip" install -q "${FLOOR_PKGS[@]}" || die "pip install into $venv failed"
            else
                timeout -k 30 3600 "$venv/bin/pip" install -q -r "$ROOT/requirements.txt" || die "pip install into $venv failed"
            fi
        fi
        PY=$venv/bin/python ;;
    *)  [[ -x $spec/bin/python ]] || die "$spec: not floor, newest, system or a venv directory"
        PY=$spec/bin/python ;;
esac

WORK=$(mktemp -d "${TMPDIR:-/tmp}/compat.XXXX")
export OMP_NUM_THREADS=1 PYTHONUNBUFFERED=1 CUDA_VISIBLE_DEVICES="" BERT_DDP_CACHE=$WORK/cache \
    TORCHINDUCTOR_CACHE_DIR=$WORK/inductor TRITON_CACHE_DIR=$WORK/triton
cd "$WORK" || die "cannot cd to $WORK"
START=$SECONDS
FAILED=0

# A small Python helper for what bash cannot check: corpus, tokenizer, summaries, weights, events.
cat > "$WORK/helper.py" <<'PYEOF'
import glob, json, math, os, random, sys

ROOT = sys.argv[1]
cmd, args = sys.argv[2], sys.argv[3:]
sys.path.insert(0, ROOT)


def summary(out):
    with open(os.path.join(out, "summary.json")) as f:
        return json.load(f)


def check(cond, why):
    if not cond:
        print(why)
        sys.exit(1)


def excepthook(kind, value, tb):  # one line on stdout (what the check line shows), the traceback on stderr
    print(f"{kind.__name__}: {value}".splitlines()[0][:300])
    sys.__excepthook__(kind, value, tb)


sys.excepthook = excepthook


if cmd == "versions":
    import platform
    from importlib.metadata import PackageNotFoundError, version
    parts = [f"python {platform.python_version()}"]
    for name in ("torch", "transformers", "tokenizers", "numpy", "tensorboard", "sentencex"):
        try:
            parts.append(f"{name} {version(name)}")
        except PackageNotFoundError:
            parts.append(f"{name} (not installed)")
    import numpy, tokenizers, torch, transformers  # noqa: F401,E401  (importable, not only installed)
    parts[1] = f"torch {torch.__version__}"  # with its build: +cpu, +cu130
    print(", ".join(parts))

elif cmd == "corpus":  # as tests/conftest.py's write_corpus: one sentence per line, blank line between docs
    path, num_docs = args[0], int(args[1])
    words = ("the a of to and in is was for on that with as by at from it an be this which or are river stone "
             "garden winter paper engine market signal window forest letter silver bridge music number orange "
             "planet rabbit season teacher valley yellow basket candle doctor empty finger guitar hollow island "
             "jacket kettle lemon meadow needle ocean pepper").split()
    rng = random.Random(0)
    docs = []
    for d in range(num_docs):
        sents = [f"document {d} begins ."]
        sents += [" ".join(rng.choice(words) for _ in range(rng.randint(3, 25))) + " ."
                  for _ in range(rng.randint(1, 30) - 1)]
        docs.append("\n".join(sents))
    with open(path, "w") as f:
        f.write("\n\n".join(docs) + "\n")

elif cmd == "tokenizer":
    import data_stream
    data_stream.get_tokenizer(None, [args[0]], vocab_size=300).save_pretrained(args[1])

elif cmd == "run":  # a finished training run: out, epochs, world size
    out, epochs, world = args[0], int(args[1]), int(args[2])
    s = summary(out)
    check(s["world_size"] == world and s["epochs_done"] == epochs,
          f"world_size {s['world_size']}, epochs_done {s['epochs_done']} (want {world}, {epochs})")
    check(s["steps"] > 0 and s["train_loss"] is not None and math.isfinite(s["train_loss"]),
          f"steps {s['steps']}, train_loss {s['train_loss']}")
    check(os.path.exists(os.path.join(out, "hf", "config.json")), "no Hugging Face export in hf/")
    print(f"{s['steps']} steps, loss {s['train_loss']:.3f}")

elif cmd == "tensorboard":
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    out = args[0]
    events = EventAccumulator(out)
    events.Reload()
    steps = [e.step for e in events.Scalars("train/loss")] if "train/loss" in events.Tags()["scalars"] else []
    check(steps == list(range(1, summary(out)["steps"] + 1)), f"tensorboard train/loss at steps {steps}")

elif cmd == "middle":  # the checkpoint nearest the middle of a run's first epoch (else of the run)
    import re
    out, log = args
    steps = summary(out)["steps"]
    import checkpoints
    ckpts = sorted(checkpoints.step_folders(os.path.join(out, "checkpoints")))
    ended = re.search(r"epoch 0 ended at step (\d+)", open(log).read())
    first = [c for c in ckpts if ended and 0 < c < int(ended.group(1))]
    inner = first or [c for c in ckpts if 0 < c < steps]
    check(inner, f"no checkpoint inside the run: {ckpts}")
    print(checkpoints.step_name(min(inner, key=lambda c: abs(c - steps / 2))))

elif cmd == "equal":  # two finished runs: the same final weights, bit for bit
    import torch

    def final(out):
        latest = open(os.path.join(out, "checkpoints", "latest")).read().strip()
        return torch.load(os.path.join(out, "checkpoints", latest, "trainer.pt"), weights_only=True)["model"]
    a, b = final(args[0]), final(args[1])
    check(a.keys() == b.keys(), "the two state dicts hold other tensors")
    diff = [k for k in a if not torch.equal(a[k], b[k])]
    if diff:
        worst = max((a[k].float() - b[k].float()).abs().max().item() for k in diff)
        check(False, f"{len(diff)} of {len(a)} tensors differ (first {diff[0]}), max |diff| {worst:.3g}")
    sa, sb = summary(args[0]), summary(args[1])
    for key in ("steps", "samples_seen", "epochs_done"):
        check(sa[key] == sb[key], f"{key}: {sa[key]} uninterrupted, {sb[key]} resumed")
    print(f"{len(a)} tensors equal")

elif cmd == "compile":
    out, steps = args[0], int(args[1])
    s = summary(out)
    check(s["steps"] == steps and s["train_loss"] is not None and math.isfinite(s["train_loss"]),
          f"steps {s['steps']}, train_loss {s['train_loss']}")
    code = glob.glob(os.path.join(args[2], "**", "*.py"), recursive=True)
    check(code, f"inductor generated no code under {args[2]}: was the model compiled?")
    print(f"{steps} steps, loss {s['train_loss']:.3f}, {len(code)} generated files")

elif cmd == "estimate":  # estimate_steps.py --json output vs the run's summary
    with open(args[0]) as f:
        r = json.load(f)
    s = summary(args[1])
    check(r["mode"] == "exact", f"mode {r['mode']}")
    check(r["total_steps"] == s["steps"] == s["planned_steps"] == s["estimate"]["total_steps"],
          f"estimate_steps.py {r['total_steps']}, ran {s['steps']}, planned {s['planned_steps']}, "
          f"the trainer's estimate {s['estimate']['total_steps']}")
    used = sum(e["samples"] - e["unused_samples"] for e in r["per_epoch"])
    check(used == s["samples_seen"], f"estimated samples used {used}, trained on {s['samples_seen']}")
    unused = [e["unused_samples"] for e in r["per_epoch"]]
    ran_unused = [sum(u) for u in s["unused_samples_per_epoch"]]
    check(unused == ran_unused, f"unused samples per epoch: estimated {unused}, run {ran_unused}")
    print(f"{r['total_steps']} steps ({'+'.join(str(e['steps']) for e in r['per_epoch'])}), "
          f"{used} samples")
PYEOF

helper() { "$PY" "$WORK/helper.py" "$ROOT" "$@" 2>>"$WORK/helper.log"; }

# result NAME T0 RC DETAIL LOG: one line per check
result() {
    local name=$1 t0=$2 rc=$3 detail=$4 log=${5:-}
    local secs=$((SECONDS - t0))
    if [[ $rc == 0 ]]; then
        printf 'ok    %-12s %4d s  %s\n' "$name" "$secs" "$detail"
    else
        FAILED=1
        local tail=""
        [[ -n $log && -f $log ]] && tail=$(grep -v '^\s*$' "$log" | tail -n 1 | cut -c1-200)
        printf 'FAIL  %-12s %4d s  %s%s%s\n' "$name" "$secs" "$detail" "${tail:+ | last line: $tail}" \
            "${log:+ (log: $log)}"
    fi
}

# bounded LIMIT LOG CMD...: run CMD under timeout -k, stdout+stderr into LOG; 124/137 say "timed out"
bounded() {
    local limit=$1 log=$2
    shift 2
    timeout -k 20 "$limit" "$@" >"$log" 2>&1
    local rc=$?
    [[ $rc == 124 || $rc == 137 ]] && echo "timed out after $limit s" >>"$log"
    return $rc
}

# ---------------------------------------------------------------- 0 setup
t0=$SECONDS
VERSIONS=$(timeout -k 10 120 "$PY" "$WORK/helper.py" "$ROOT" versions 2>&1) \
    || die "importing torch/transformers/tokenizers/numpy with $PY: $(tail -n 1 <<<"$VERSIONS")"
echo "python: $PY"
CODE=$(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo "not a git checkout")
[[ -n $(git -C "$ROOT" status --porcelain -- pretrain_ddp.py data_stream.py estimate_steps.py 2>/dev/null) ]] \
    && CODE="$CODE + uncommitted changes to the scripts"
echo "code: $CODE"
echo "versions: $VERSIONS"
CORPUS=$WORK/corpus.txt TOK=$WORK/tok
helper corpus "$CORPUS" 40 && bounded 120 "$WORK/tokenizer.log" "$PY" "$WORK/helper.py" "$ROOT" tokenizer "$CORPUS" "$TOK"
rc=$?
result "0 setup" "$t0" $rc "corpus of 40 documents, WordPiece of 300 trained" "$WORK/tokenizer.log"
[[ $rc == 0 ]] || exit 2

TRAIN=(--corpus "$CORPUS" --tokenizer "$TOK" --eval-corpus none --model-size tiny --max-seq-len 32
       --batch-size 4 --accum-steps 2 --epochs 2 --num-workers 1 --log-every 1)
TORCHRUN=("$PY" -m torch.distributed.run --standalone --nproc_per_node 2 "$ROOT/pretrain_ddp.py")

# ---------------------------------------------------------------- 1 two ranks, nsp then mlm
declare -A RAN
for obj in nsp mlm; do
    t0=$SECONDS
    out=$WORK/$obj
    logto=stdout
    [[ $obj == mlm ]] && logto=stdout,tensorboard
    if bounded "$T_RUN" "$WORK/$obj.log" "${TORCHRUN[@]}" "${TRAIN[@]}" --objective $obj --out-dir "$out" \
            --save-every 4 --keep-last 100 --log-to $logto; then
        detail=$(helper run "$out" 2 2); rc=$?
        if [[ $rc == 0 && $obj == mlm ]]; then
            tb=$(helper tensorboard "$out"); rc=$?
            detail="$detail, ${tb:-tensorboard holds train/loss of every step}"
        fi
    else
        rc=$?; detail="torchrun exit $rc"
    fi
    result "1 $obj" "$t0" $rc "2 ranks, 2 epochs: $detail" "$WORK/$obj.log"
    [[ $rc == 0 ]] && RAN[$obj]=1
done

# ---------------------------------------------------------------- 2 resume from the middle, bit for bit
for obj in nsp mlm; do
    t0=$SECONDS
    if [[ -z ${RAN[$obj]:-} ]]; then result "2 resume $obj" "$t0" 1 "no uninterrupted run to compare with"; continue; fi
    if ! mid=$(helper middle "$WORK/$obj" "$WORK/$obj.log"); then result "2 resume $obj" "$t0" 1 "$mid"; continue; fi
    out=$WORK/$obj-resumed
    cp -a "$WORK/$obj" "$out"
    rm -rf "$out/summary.json" "$out/hf" "$out"/events.out.tfevents.*
    logto=stdout
    [[ $obj == mlm ]] && logto=stdout,tensorboard
    if bounded "$T_RUN" "$WORK/$obj-resumed.log" "${TORCHRUN[@]}" "${TRAIN[@]}" --objective $obj --out-dir "$out" \
            --save-every 4 --keep-last 100 --log-to $logto --resume "$out/checkpoints/$mid"; then
        if grep -q "^resumed from .*$mid at step" "$WORK/$obj-resumed.log"; then
            detail=$(helper equal "$WORK/$obj" "$out"); rc=$?
        else
            rc=1; detail="the log does not say 'resumed from .../$mid'"
        fi
    else
        rc=$?; detail="torchrun exit $rc"
    fi
    result "2 resume $obj" "$t0" $rc "from $mid to the end: $detail" "$WORK/$obj-resumed.log"
done

# ---------------------------------------------------------------- 3 torch.compile
t0=$SECONDS
out=$WORK/compiled
if bounded "$T_COMPILE" "$WORK/compiled.log" "$PY" "$ROOT/pretrain_ddp.py" "${TRAIN[@]}" --objective mlm \
        --out-dir "$out" --num-workers 0 --max-steps 4 --compile --log-to stdout; then
    detail=$(helper compile "$out" 4 "$TORCHINDUCTOR_CACHE_DIR"); rc=$?
else
    rc=$?; detail="exit $rc"
fi
result "3 compile" "$t0" $rc "1 rank, mlm: $detail" "$WORK/compiled.log"

# ---------------------------------------------------------------- 4 estimate_steps.py --mode exact
for obj in nsp mlm; do
    t0=$SECONDS
    if [[ -z ${RAN[$obj]:-} ]]; then result "4 estimate $obj" "$t0" 1 "no run to compare with"; continue; fi
    if timeout -k 20 "$T_EST" "$PY" "$ROOT/estimate_steps.py" --corpus "$CORPUS" --tokenizer "$TOK" \
            --objective $obj --max-seq-len 32 --batch-size 4 --accum-steps 2 --world-size 2 --num-workers 1 \
            --epochs 2 --mode exact --json >"$WORK/estimate-$obj.json" 2>"$WORK/estimate-$obj.log"; then
        detail=$(helper estimate "$WORK/estimate-$obj.json" "$WORK/$obj"); rc=$?
    else
        rc=$?; detail="exit $rc"
    fi
    result "4 estimate $obj" "$t0" $rc "exact == ran: $detail" "$WORK/estimate-$obj.log"
done

echo "versions: $VERSIONS"
echo "total: $((SECONDS - START)) s ($spec, $PY, code $CODE)"
if [[ $FAILED == 0 && -z ${KEEP:-} ]]; then
    rm -rf "$WORK"
else
    echo "logs: $WORK"
fi
exit $FAILED
