#!/usr/bin/env bash
# Issue 28 (BENCHMARKS.md section 14): do short 2-rank torchrun jobs always end clean under CPU load? Counts exit
# codes, hangs and "terminate called" aborts over JOBS jobs, with a busy loop on the machine beside them.
#
#     bash bench/exit_stress.sh                   # 20 plain jobs + 30 with eval (the recorded run)
#     PLAIN=5 EVAL=5 bash bench/exit_stress.sh    # fewer
#
# Plain: nsp, --max-steps 4, checkpoints. Eval: mlm, --accum-steps 2, an eval corpus, --eval-every 2,
# --num-workers 1, --max-steps 4 (the job that once hung in eval). Each job has a 300 s limit; a job
# that reaches it gets a stack dump of every process (py-spy, when installed) before it is killed.
set -u
cd "$(dirname "$0")/.."
PLAIN=${PLAIN:-20}
EVAL=${EVAL:-30}
PY=${PY:-python3}
WORK=$(mktemp -d /tmp/exit_stress.XXXXXX)
export BERT_DDP_CACHE=$WORK/cache OMP_NUM_THREADS=1
"$PY" - "$WORK" <<'PYEOF'
import sys
sys.path.insert(0, "tests")
import conftest, data_stream
work = sys.argv[1]
conftest.write_corpus(f"{work}/train.txt", 120)
conftest.write_corpus(f"{work}/eval.txt", 24, seed=5)
data_stream.get_tokenizer(None, [f"{work}/train.txt"], vocab_size=300).save_pretrained(f"{work}/tok")
PYEOF
"$PY" -c "while True: pass" &   # the load: one core busy all along
BUSY=$!
trap 'kill $BUSY 2>/dev/null' EXIT
common=(--corpus "$WORK/train.txt" --tokenizer "$WORK/tok" --max-seq-len 32 --batch-size 4 --log-to stdout
        --max-steps 4 --save-every 2)
ok=0; failed=0; aborted=0; hung=0; t0=$(date +%s)
job() {  # name, flags...
    local name=$1; shift
    local port=$((29600 + RANDOM % 2000))
    timeout -k 10 300 "$PY" -m torch.distributed.run --nnodes 1 --nproc_per_node 2 --master_addr 127.0.0.1 \
        --master_port $port pretrain_ddp.py "${common[@]}" --out-dir "$WORK/$name" "$@" > "$WORK/$name.log" 2>&1 &
    local pid=$! waited=0
    while kill -0 $pid 2>/dev/null; do
        sleep 1; waited=$((waited + 1))
        if [ $waited -eq 290 ] && command -v py-spy >/dev/null; then  # caught in the act: every process
            for p in $(pgrep -f "$WORK/$name"); do py-spy dump --pid "$p" >> "$WORK/$name.stacks" 2>&1; done
        fi
    done
    wait $pid; local rc=$?
    if grep -q "terminate called" "$WORK/$name.log"; then aborted=$((aborted + 1)); fi
    if [ $rc -eq 0 ]; then ok=$((ok + 1)); elif [ $rc -eq 124 ] || [ $rc -eq 137 ]; then hung=$((hung + 1));
    else failed=$((failed + 1)); echo "job $name: rc $rc (log $WORK/$name.log)"; tail -5 "$WORK/$name.log"; fi
}
for i in $(seq 1 "$PLAIN"); do job "plain$i" --eval-corpus none; done
echo "plain: $ok ok, $failed failed, $hung hung, $aborted with 'terminate called' of $PLAIN ($(( $(date +%s) - t0 )) s)"
p_ok=$ok; p_failed=$failed; p_hung=$hung; p_aborted=$aborted; ok=0; failed=0; hung=0; aborted=0; t0=$(date +%s)
for i in $(seq 1 "$EVAL"); do
    job "eval$i" --objective mlm --accum-steps 2 --eval-corpus "$WORK/eval.txt" --eval-every 2 --num-workers 1
done
echo "eval: $ok ok, $failed failed, $hung hung, $aborted with 'terminate called' of $EVAL ($(( $(date +%s) - t0 )) s)"
echo "logs: $WORK"
[ $((p_failed + p_hung + p_aborted + failed + hung + aborted)) -eq 0 ]
