"""
The LR schedules of pretrain_ddp.py drawn from its own plan functions (plan_of, lr_factor in estimate_steps.py,
replan): linear, cosine and wsd over one plan; a wsd plan extended by a resume in its stable phase; a decay branched
off a stable checkpoint with --init-from CKPT --schedule wsd --warmup 0 --decay 1. Writes bench/lr_schedules.png
(needs matplotlib), the figure of BENCHMARKS.md section 17.

    python bench/lr_schedules.py
    python bench/lr_schedules.py --out /tmp/lr_schedules.png     # a smoke run
"""
import argparse
import os
import sys
from types import SimpleNamespace

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
import estimate_steps  # noqa: E402
import pretrain_ddp as P  # noqa: E402


def flags(**kw):
    return SimpleNamespace(**{"warmup": 0.06, "schedule": "linear", "decay": 0.2, "epochs": 1, "max_steps": None,
                              "budget": None, **kw})


def plan_of(flags, steps):
    return estimate_steps.plan_of(steps, steps, 64, flags.warmup, flags.schedule, flags.decay)


def curve(plan, start, end):
    return list(range(start, end)), [estimate_steps.lr_factor(plan, pos) for pos in range(start, end)]


def main():
    p = argparse.ArgumentParser(description=__doc__.strip().split("\n\n")[0])
    p.add_argument("--out", default=os.path.join(HERE, "lr_schedules.png"), help="the PNG")
    args = p.parse_args()
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4))
    for schedule in ("linear", "cosine", "wsd"):
        left.plot(*curve(plan_of(flags(schedule=schedule), 1000), 0, 1001), label=f"--schedule {schedule}")
    left.set_title("one plan of 1,000 steps, --warmup 0.06 (--decay 0.2)")
    wsd = plan_of(flags(schedule="wsd"), 1000)
    right.plot(*curve(wsd, 0, 1001), color="tab:green", alpha=0.4, label="wsd, 1,000 steps")
    longer = P.replan(wsd, 600, 600, flags(schedule="wsd", epochs=2), 64)  # resumed at 600 with --epochs 2
    right.plot(*curve(longer, 600, 2001), color="tab:green", label="resumed at 600 (stable) to 2,000 steps")
    branch = plan_of(flags(schedule="wsd", warmup=0.0, decay=1.0), 300)  # --init-from step 600
    steps, lrs = curve(branch, 0, 301)
    right.plot([600 + s for s in steps], lrs, color="tab:red", label="--init-from step 600: --decay 1, 300 steps")
    right.set_title("wsd: extended in its stable phase; a decay branched off")
    for ax in (left, right):
        ax.set_xlabel("optimizer step (plan position)")
        ax.set_ylabel("LR / peak LR")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(args.out, dpi=90)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
