"""
What an hour buys (issue 50): arms (an objective, a size, a recipe, a corpus: pretrain_ddp.py flags) pretrained for
the same budget side by side, one thread each, then fine-tuned by finetune.py on polarity and r8; one table beside
each arm's random-init floor and the same split's bag of words, with the SE of every difference.

    python bench/hour.py run --dir D --budget 60m \\
        --arm "tiny=--model-size tiny --lr 2e-3" --arm "mini=--model-size mini --lr 1e-3"
    python bench/hour.py table --dir D              # the table, from D's JSONs (a run also prints it)
    python bench/hour.py run --dir /tmp/hour_smoke --budget 20s --arm "tiny=--model-size tiny" --seeds 2 \
        --finetune-flags "--max-train 64 --max-test 48 --epochs 1"     # a smoke run

Every arm: `pretrain_ddp.py --corpus D/corpus.txt --objective mlm --batch-size 32 --dropout 0 --epochs 100
--budget B --num-workers 0 --eval-corpus none` then its own flags (argparse keeps the last of a flag), into D/<arm>,
with OMP_NUM_THREADS=1; the arms run at once (--parallel, default 2: one a core of this 2-core machine), so each
sees the same machine. Their CPU seconds are in the table: --budget is wall-clock, and on a machine shared with
other jobs CPU seconds are the compute an arm got. D/corpus.txt: bench/downstream.py's task-adaptive corpus
(polarity's non-test movies x6, r8's train file; no test text, checked line by line), built if missing.
Fine-tuning: finetune.py --threads 1 --seeds 3, each arm and its floor (--random-init: the arm's shape and
tokenizer, fresh weights) with --pooling cls and mean, polarity and r8, two at a time.
"""
import argparse
import json
import math
import os
import shlex
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import downstream  # noqa: E402

BASE = ["--objective", "mlm", "--batch-size", "32", "--dropout", "0", "--epochs", "100", "--num-workers", "0",
        "--eval-corpus", "none", "--log-every", "200", "--log-to", "stdout"]


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("action", choices=("run", "table"))
    p.add_argument("--dir", default="runs/hour", help="the corpus, the arms and every result go here")
    p.add_argument("--arm", action="append", default=[], metavar="NAME=FLAGS",
                   help="an arm: its name and the pretrain_ddp.py flags it adds (repeat for each arm)")
    p.add_argument("--budget", default="60m", help="pretrain_ddp.py --budget of every arm")
    p.add_argument("--parallel", type=int, default=2, help="processes at once (pretraining and fine-tuning)")
    p.add_argument("--seeds", type=int, default=3, help="fine-tuning seeds")
    p.add_argument("--tasks", default="polarity,r8", help="the tasks every arm is fine-tuned on")
    p.add_argument("--poolings", default="cls,mean", help="finetune.py --pooling values, each fine-tuned")
    p.add_argument("--finetune-flags", default="", help="more finetune.py flags (a smoke run: --max-train 64 ...)")
    return p.parse_args()


def arms_of(args):
    arms = dict(arm.split("=", 1) for arm in args.arm)
    if not arms:
        sys.exit("hour.py: give at least one --arm NAME=FLAGS")
    return {name: shlex.split(flags) for name, flags in arms.items()}


def timed(name, command, log, times):
    """Run command (OMP_NUM_THREADS=1) with its output into log; its wall and CPU seconds into times[name]. The CPU
    seconds are this child's own (wait4), not RUSAGE_CHILDREN's, which also counts the arm beside it."""
    print(f"# {name}: OMP_NUM_THREADS=1 {shlex.join(command)}", flush=True)
    start = time.perf_counter()
    with open(log, "w") as out:
        child = subprocess.Popen(command, cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=out,
                                 stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(child.pid, 0)
    if os.waitstatus_to_exitcode(status):
        sys.exit(f"{name} failed ({os.waitstatus_to_exitcode(status)}): see {log}")
    times[name] = {"wall_s": round(time.perf_counter() - start, 1), "cpu_s": round(usage.ru_utime + usage.ru_stime, 1)}


def scores(args, arm, task, pooling, floor):
    """A fine-tuning's JSON: the floor's where finetune.py puts it (where a model's run finds it), a model's by
    --out (finetune.py's default names it by the checkpoint's step)."""
    suffix = ("" if pooling == "cls" else f"_{pooling}") + ("_random_init" if floor else "")
    return os.path.join(args.dir, arm, "finetune", f"{task}{suffix}.json")


def run(args):
    corpus = os.path.join(args.dir, "corpus.txt")
    if not os.path.exists(corpus):
        downstream.build_corpus(args.dir, "polarity=6,r8=1,20ng=0")
    times_path = os.path.join(args.dir, "times.json")
    times = json.load(open(times_path)) if os.path.exists(times_path) else {}
    jobs = []
    for name, flags in arms_of(args).items():
        out = os.path.join(args.dir, name)
        if not os.path.exists(os.path.join(out, "summary.json")):
            jobs.append((f"pretrain {name}", [sys.executable, "pretrain_ddp.py", "--corpus", corpus, *BASE,
                                              "--budget", args.budget, *flags, "--out-dir", out],
                         os.path.join(args.dir, f"{name}.log")))
    with ThreadPoolExecutor(args.parallel) as pool:  # the arms side by side
        list(pool.map(lambda job: timed(*job, times), jobs))
    json.dump(times, open(times_path, "w"), indent=1)
    jobs = []
    for name in arms_of(args):
        for task in args.tasks.split(","):
            for pooling in args.poolings.split(","):
                for floor in (True, False):  # the floor first: the model's summary line shows it
                    out = scores(args, name, task, pooling, floor)
                    if os.path.exists(out):
                        continue
                    command = [sys.executable, "finetune.py", os.path.join(args.dir, name), "--task", task,
                               "--threads", "1", "--seeds", str(args.seeds), "--pooling", pooling,
                               *shlex.split(args.finetune_flags)]
                    label = f"finetune {name} {task} {pooling}{' floor' if floor else ''}"
                    jobs.append((label, command + (["--random-init"] if floor else ["--out", out]),
                                 os.path.join(args.dir, label.replace(" ", "_") + ".log")))
    with ThreadPoolExecutor(args.parallel) as pool:
        list(pool.map(lambda job: timed(*job, times), jobs))
    json.dump(times, open(times_path, "w"), indent=1)
    table(args)


def stats(values):
    return statistics.mean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def versus(values, reference, spread=0.0):
    """'+0.0123 (2.4 SE)': mean(values) - reference, in standard errors of the difference (the reference's own
    spread over its seeds, or 0 for the deterministic bag of words)."""
    mean, sd = stats(values)
    se = math.sqrt(sd ** 2 / len(values) + spread)
    return f"{mean - reference:+.4f} ({(mean - reference) / se if se else float('inf'):+.1f} SE)"


def table(args):
    times = json.load(open(os.path.join(args.dir, "times.json")))
    print("| task | arm | pooling | pretraining: steps, CPU s | accuracy (mean ± sd) | macro-F1 | floor (mean ± sd) "
          "| - floor | bag of words | - bag of words |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for task in args.tasks.split(","):
        for name in arms_of(args):
            summary = json.load(open(os.path.join(args.dir, name, "summary.json")))
            for pooling in args.poolings.split(","):
                paths = scores(args, name, task, pooling, False), scores(args, name, task, pooling, True)
                if not all(map(os.path.exists, paths)):
                    continue
                model, floor = (json.load(open(p)) for p in paths)
                acc = [s["accuracy"] for s in model["seeds"]]
                floor_acc = [s["accuracy"] for s in floor["seeds"]]
                f1 = [s["macro_f1"] for s in model["seeds"]] if "macro_f1" in model["seeds"][0] else None
                bow = model.get("bag_of_words_accuracy")
                n = len(floor_acc)
                print(f"| {task} | {name} | {pooling} | {summary['steps']}, "
                      f"{times[f'pretrain {name}']['cpu_s']:.0f} | {'{:.4f} ± {:.4f}'.format(*stats(acc))} | "
                      f"{'{:.3f} ± {:.3f}'.format(*stats(f1)) if f1 else ''} | "
                      f"{'{:.4f} ± {:.4f}'.format(*stats(floor_acc))} | "
                      f"{versus(acc, stats(floor_acc)[0], stats(floor_acc)[1] ** 2 / n)} | "
                      f"{'' if bow is None else f'{bow:.4f}'} | {'' if bow is None else versus(acc, bow)} |")


def main():
    args = parse_args()
    run(args) if args.action == "run" else table(args)


if __name__ == "__main__":
    main()
