"""
Quality per hour (issue 38): pretrain_ddp.py --budget against transformers.Trainer on run_mlm's recipe with the same
wall-clock budget, the same model, on the same machine, alternating; one evaluator scores both at the same marks.

    python bench/time_to_quality.py                               # mini 600 s, small 400 s a run, seeds 0-2 (~2 h)
    python bench/time_to_quality.py --sizes tiny --budget 60 --seeds 0 --marks 3     # a smoke run

Both sides: BERT-SIZE at vocab 30522 (bench/vs_trainer.py's tokenizer: builtin's WordPiece padded with unused
entries), batch 32 x 128, AdamW as pretrain_ddp.py's (fused, 0.9/0.98, eps 1e-6, decay 0.01 off biases and
LayerNorm), clipping 1.0, dropout 0.1, --lr, warmup 6% and linear decay to 0 at the run's last planned step,
`--threads` OpenMP threads, one process each, nothing else running.
- ours: `pretrain_ddp.py --objective mlm --budget B`: it times a few steps, an eval and a save before step 1 and plans
  its steps (the calibration counted in the budget);
- the Trainer: a calibration run of its own first (--calibration-steps, untimed in the budget), whose steady step
  time plans max_steps = B / step time; then the run, stopped by a callback at B seconds if it is late.
Both save their weights at the same marks, fractions k/--marks of the budget in training time (ours: summary's
train_seconds clock, from its calibration's start; the Trainer: from its train() call), and at the end. The
evaluator (bench/learning.py's: builtin's held-out split, masked once with a fixed seed) scores every saved model.
Time ratio per seed: the Trainer's time to its final loss, over the time ours first reaches that loss (linear
between marks); above 1, ours is faster to the same quality. Writes results.json, table.md and curves.png (needs
matplotlib: bench only) into --out-dir.
"""
import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, ROOT)
sys.path.insert(0, HERE)

BUDGETS = {"tiny": 120, "mini": 600, "small": 400}  # shorter: both sides sit on the plateau
LRS = {"tiny": 2e-3, "mini": 1e-3, "small": 5e-4}


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.strip().split("\n\n")[0].strip(),
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--sizes", default="mini,small")
    p.add_argument("--budget", type=float, default=None, help="seconds a run (default: tiny 120, mini 600, small 400)")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--marks", type=int, default=8, help="weights saved at k/marks of the budget")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--max-seq-len", type=int, default=128)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--calibration-steps", type=int, default=25, help="the Trainer's calibration run (10 untimed)")
    p.add_argument("--mask-seed", type=int, default=1234)
    p.add_argument("--out-dir", default="/tmp/bert_ddp_bench/time_to_quality")
    p.add_argument("--worker", choices=["trainer", "ours"], help=argparse.SUPPRESS)
    p.add_argument("--size", help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--tokenizer", help=argparse.SUPPRESS)
    p.add_argument("--run-dir", help=argparse.SUPPRESS)
    p.add_argument("--steps", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--seconds", type=float, default=0, help=argparse.SUPPRESS)
    return p.parse_args(sys.argv[1:sys.argv.index("--")] if "--" in sys.argv else None)  # after --: ours' flags


# ----------------------------------------------------------------------------- ours: pretrain_ddp.py with marks

def ours_worker(args, argv):
    """pretrain_ddp.py's own main (its cli), saving the weights when its training clock passes a mark."""
    import torch

    import model as M
    import pretrain_ddp as P
    marks = [args.seconds * k / args.marks for k in range(1, args.marks + 1)]
    count_step, saved = P.count_step, []

    def counted(meter, progress, *rest):
        count_step(meter, progress, *rest)
        if marks and progress["train_seconds"] >= marks[0]:
            marks.pop(0)
            saved.append(progress["train_seconds"])
            torch.save({"model": meter["model"].hf.state_dict()},
                       os.path.join(args.run_dir, f"mark_{len(saved):02d}_{progress['train_seconds']:.1f}.pt"))

    new_meter = P.new_meter

    def meter_with_model(device, amp_dtype, progress):
        meter = new_meter(device, amp_dtype, progress)
        meter["model"] = MODEL[0]
        return meter

    MODEL = []
    pretraining = M.Pretraining.__init__

    def remember(self, hf_model):
        pretraining(self, hf_model)
        MODEL.append(self)

    M.Pretraining.__init__, P.count_step, P.new_meter = remember, counted, meter_with_model
    P.cli(argv)


def run_ours(args, size, seed, tok_dir, run_dir, budget, env):
    os.makedirs(run_dir, exist_ok=True)
    flags = ["--objective", "mlm", "--model-size", size, "--tokenizer", tok_dir, "--budget", f"{budget}s",
             "--batch-size", str(args.batch_size), "--max-seq-len", str(args.max_seq_len), "--lr", str(LRS[size]),
             "--seed", str(seed), "--epochs", "1000", "--eval-corpus", "none", "--save-every", "1000000",
             "--log-every", "50", "--log-to", "stdout", "--out-dir", run_dir, "--resume", "none", "--overwrite"]
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "ours", "--run-dir", run_dir, "--seconds",
           str(budget), "--marks", str(args.marks), "--", *flags]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT)
    if out.returncode:
        sys.exit(f"ours failed:\n{out.stderr[-3000:]}")
    with open(os.path.join(run_dir, "summary.json")) as f:
        summary = json.load(f)
    final = os.path.join(run_dir, f"final_{summary['train_seconds']:.1f}.pt")
    import torch
    latest = open(os.path.join(run_dir, "checkpoints", "latest")).read()
    state = torch.load(os.path.join(run_dir, "checkpoints", latest, "trainer.pt"), weights_only=True)["model"]
    torch.save({"model": state}, final)
    return {"steps": summary["steps"], "train_seconds": summary["train_seconds"], "plan": summary["lr_plan"]}


# ----------------------------------------------------------------------------- the Trainer (run_mlm recipe)

def trainer_worker(args):
    """One Trainer run: max_steps --steps (0: calibrate: --calibration-steps, print the steady step time), marks
    every --seconds / --marks seconds from train()'s start, stopped at --seconds."""
    import torch
    from learning import split_documents
    from transformers import DataCollatorForLanguageModeling, Trainer, TrainerCallback, TrainingArguments

    import data_stream
    import estimate_steps
    import model as M
    import pretrain_ddp as P
    tok = data_stream.get_tokenizer(args.tokenizer)
    docs = split_documents(tok, argparse.Namespace(corpus="builtin"), "train")
    ids = [t for doc in docs for t in [tok.cls_token_id, *doc, tok.sep_token_id]]
    n = args.max_seq_len
    blocks = [{"input_ids": ids[i:i + n], "token_type_ids": [0] * n, "attention_mask": [1] * n}
              for i in range(0, len(ids) // n * n, n)]
    torch.manual_seed(args.seed)
    model = M.model_from(M.new_architecture(args.size, len(tok), n, tok.pad_token_id), "mlm", 0.1)
    steps = args.steps or args.calibration_steps
    optimizer = M.new_optimizer(M.Pretraining(model), LRS[args.size], 0.01)
    warmup = estimate_steps.warmup_steps(0.06, steps)
    plan = {"total": steps, "warmup": warmup, "decay_from": [warmup, 1.0]}
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: P.lr_factor(plan, s))
    marks = [args.seconds * k / args.marks for k in range(1, args.marks + 1)] if args.steps else []
    times = []

    class Clock(TrainerCallback):
        def on_train_begin(self, targs, state, control, **kw):
            times.append(time.perf_counter())

        def on_step_end(self, targs, state, control, model=None, **kw):
            elapsed = time.perf_counter() - times[0]
            times.append(elapsed)
            if marks and elapsed >= marks[0]:
                marks.pop(0)
                torch.save({"model": model.state_dict()},
                           os.path.join(args.run_dir, f"mark_{args.marks - len(marks):02d}_{elapsed:.1f}.pt"))
            if args.steps and elapsed >= args.seconds:
                control.should_training_stop = True

    os.makedirs(args.run_dir, exist_ok=True)
    targs = TrainingArguments(
        output_dir=os.path.join(args.run_dir, "trainer_tmp"), per_device_train_batch_size=args.batch_size,
        max_steps=steps, learning_rate=LRS[args.size], weight_decay=0.01, adam_beta1=0.9, adam_beta2=0.98,
        adam_epsilon=1e-6, max_grad_norm=1.0, use_cpu=True, dataloader_num_workers=0, logging_strategy="no",
        save_strategy="no", report_to="none", disable_tqdm=True, seed=args.seed)
    trainer = Trainer(model=model, args=targs, train_dataset=blocks, optimizers=(optimizer, scheduler),
                      data_collator=DataCollatorForLanguageModeling(tok, mlm=True, mlm_probability=0.15),
                      callbacks=[Clock()])
    trainer.train()
    elapsed = times[-1]
    if args.steps:
        torch.save({"model": model.state_dict()}, os.path.join(args.run_dir, f"final_{elapsed:.1f}.pt"))
    step_s = (times[-1] - times[10]) / (len(times) - 11) if len(times) > 12 else elapsed / max(len(times) - 1, 1)
    print(json.dumps({"steps": len(times) - 1, "train_seconds": elapsed, "step_s": step_s}))


def run_trainer(args, size, seed, tok_dir, run_dir, budget, env):
    base = [sys.executable, os.path.abspath(__file__), "--worker", "trainer", "--size", size, "--seed", str(seed),
            "--tokenizer", tok_dir, "--batch-size", str(args.batch_size), "--max-seq-len", str(args.max_seq_len),
            "--marks", str(args.marks), "--calibration-steps", str(args.calibration_steps)]
    results = []
    for steps in (0, None):  # the calibration, then the run it plans
        steps = steps if steps == 0 else max(1, int(budget / results[0]["step_s"]))
        cmd = [*base, "--run-dir", os.path.join(run_dir, "calibration" if steps == 0 else ""), "--steps", str(steps),
               "--seconds", str(budget)]
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT)
        if out.returncode:
            sys.exit(f"Trainer failed:\n{out.stderr[-3000:]}")
        results.append(json.loads(out.stdout.strip().splitlines()[-1]))
    step_s = results[0]["step_s"]
    return {**results[1], "planned_steps": int(budget / step_s), "calibrated_step_s": step_s}


# ----------------------------------------------------------------------------- scoring

def curve(run_dir, evaluator, size):
    """[(training seconds, loss, accuracy)] of every model a run saved, in time order."""
    points = []
    for name in os.listdir(run_dir):
        if name.endswith(".pt") and name.startswith(("mark_", "final_")):
            seconds = float(name.rsplit("_", 1)[1][:-3])
            scores = evaluator.score(os.path.join(run_dir, name), size)
            points.append((seconds, scores["loss"], scores["accuracy"]))
    return sorted(points)


def time_to(points, loss):
    """The first training time at which the curve's loss is <= loss (linear between points), None if never."""
    prev = None
    for t, value, _ in points:
        if value <= loss:
            if prev is None:
                return t
            (t0, v0) = prev
            return t0 + (t - t0) * (v0 - loss) / (v0 - value) if v0 != value else t
        prev = (t, value)
    return None


def main():
    args = parse_args()
    if args.worker == "trainer":
        return trainer_worker(args)
    if args.worker == "ours":
        return ours_worker(args, sys.argv[sys.argv.index("--") + 1:])
    from learning import Evaluator
    from vs_trainer import tokenizer_dir
    os.makedirs(args.out_dir, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "TOKENIZERS_PARALLELISM": "false"}
    tok_dir = tokenizer_dir(30522)
    evaluator = Evaluator(tok_dir, argparse.Namespace(corpus="builtin", max_seq_len=args.max_seq_len,
                                                       mask_seed=args.mask_seed, out_dir=args.out_dir))
    results = {}
    for size in args.sizes.split(","):
        budget = args.budget or BUDGETS[size]
        for k, seed in enumerate(int(s) for s in args.seeds.split(",")):
            for side in (("ours", "trainer") if k % 2 == 0 else ("trainer", "ours")):
                run_dir = os.path.join(args.out_dir, f"{size}-{side}-seed{seed}")
                print(f"{size} seed {seed}: {side} ({budget:.0f} s)", flush=True)
                run = (run_ours if side == "ours" else run_trainer)(args, size, seed, tok_dir, run_dir, budget, env)
                results.setdefault(size, {}).setdefault(str(seed), {})[side] = {**run, "curve": curve(run_dir,
                                                                                                   evaluator, size)}
            pair = results[size][str(seed)]
            t_end, l_end, _ = pair["trainer"]["curve"][-1]
            reached = time_to(pair["ours"]["curve"], l_end)
            pair["ratio"] = t_end / reached if reached else None
            pair["ours_final"], pair["trainer_final"] = pair["ours"]["curve"][-1], pair["trainer"]["curve"][-1]
            print(f"  Trainer's final loss {l_end:.3f} after {t_end:.0f} s; ours reached it after "
                  f"{reached and round(reached)} s: time ratio {pair['ratio'] and round(pair['ratio'], 2)}; ours' "
                  f"final loss {pair['ours_final'][1]:.3f}", flush=True)
        with open(os.path.join(args.out_dir, "results.json"), "w") as f:
            json.dump({"args": vars(args), "evaluator": evaluator.info, "results": results}, f, indent=1)
    write_table(args, results)
    plot(args, results)


def write_table(args, results):
    lines = ["| size | seed | ours: steps, final loss / accuracy | Trainer: steps, final loss / accuracy | "
             "Trainer's final loss reached by ours after | time ratio |", "| --- | --- | --- | --- | --- | --- |"]
    for size, seeds in results.items():
        for seed, pair in seeds.items():
            o, t = pair["ours"], pair["trainer"]
            reached = pair["ratio"] and pair["trainer_final"][0] / pair["ratio"]
            when = f"{reached:.0f} s of {o['train_seconds']:.0f}" if reached else "never"
            lines.append(f"| {size} | {seed} | {o['steps']}, {o['curve'][-1][1]:.3f} / {o['curve'][-1][2]:.1%} | "
                         f"{t['steps']}, {t['curve'][-1][1]:.3f} / {t['curve'][-1][2]:.1%} | {when} | "
                         f"{pair['ratio'] and round(pair['ratio'], 2)} |")
    text = "\n".join(lines)
    print("\n" + text)
    with open(os.path.join(args.out_dir, "table.md"), "w") as f:
        f.write(text + "\n")


def plot(args, results):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("no matplotlib: no curves.png (pip install matplotlib)")
        return
    fig, axes = plt.subplots(2, len(results), figsize=(6 * len(results), 8), squeeze=False)
    for col, (size, seeds) in enumerate(results.items()):
        for seed, pair in seeds.items():
            for side, color in (("ours", "tab:blue"), ("trainer", "tab:orange")):
                t, loss, acc = zip(*pair[side]["curve"], strict=True)
                label = f"{'pretrain_ddp.py --budget' if side == 'ours' else 'Trainer (run_mlm)'}" if seed == "0" \
                    else None
                axes[0][col].plot(t, loss, color=color, marker="o", ms=3, label=label, alpha=0.8)
                axes[1][col].plot(t, acc, color=color, marker="o", ms=3, label=label, alpha=0.8)
        axes[0][col].set_title(f"BERT-{size}, vocab 30522, batch 32 x 128, {os.cpu_count()} CPU cores")
        axes[0][col].set_ylabel("held-out MLM loss (fixed masks)")
        axes[1][col].set_ylabel("held-out MLM accuracy")
        for ax in axes[:, col]:
            ax.set_xlabel("training time (s)")
            ax.grid(alpha=0.3)
            ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(args.out_dir, "curves.png"), dpi=110)
    print(f"wrote {os.path.join(args.out_dir, 'curves.png')}")


if __name__ == "__main__":
    main()
