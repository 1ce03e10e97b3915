"""Training for a time budget and the LR plans: the schedules, a re-plan when a resume moves the end (issues 38,
44). Every process is bounded by a timeout."""
import json
import os
import re
import shutil

import pytest
from conftest import common, final_weights, logged, run_main, same_weights, summary

import checkpoints
import estimate_steps
import pretrain_ddp as P
from estimate_steps import lr_factor


class Flags:
    warmup, schedule, decay, epochs, max_steps, budget = 0.1, "linear", 0.2, 2, None, None


def test_cosine_and_wsd_schedules_end_at_0_and_a_moved_end_never_raises_the_lr():
    """linear/cosine fall from the end of warmup to 0 at the total; wsd holds the peak until its last
    --decay, then falls linearly to 0. A resume that moves the end: a wsd plan in its stable phase keeps
    the peak and decays over the new end's last 20%; a decaying plan goes on from today's LR; the LR
    never jumps up. The trainer and estimate_steps.py place warmup and decay alike."""
    curves = {}
    for schedule in ("linear", "cosine", "wsd"):
        Flags.schedule = schedule
        plan = estimate_steps.plan_of(100, 50.0, 64, Flags.warmup, Flags.schedule, Flags.decay)
        curves[schedule] = [lr_factor(plan, pos) for pos in range(101)]
        assert plan.warmup == estimate_steps.warmup_steps(0.1, 100) == 10
        assert plan.decay_from[0] == estimate_steps.decay_start(schedule, 0.2, 10, 100)
        assert curves[schedule][0] == 0.1 and curves[schedule][9] == 1.0 and curves[schedule][100] == 0.0
        assert all(a >= b for a, b in zip(curves[schedule][9:], curves[schedule][10:], strict=False))
    assert curves["linear"][55] == pytest.approx(0.5) and curves["cosine"][55] == pytest.approx(0.5)
    assert curves["cosine"][30] > curves["linear"][30] and curves["cosine"][80] < curves["linear"][80]
    assert curves["wsd"][80] == 1.0 and curves["wsd"][90] == pytest.approx(0.5)
    Flags.schedule = "wsd"
    plan = estimate_steps.plan_of(100, 50.0, 64, Flags.warmup, Flags.schedule, Flags.decay)
    Flags.epochs = 4  # at position 60, stable: the new end is 200, the decay its last 20%
    longer = P.replan(plan, 60, 60, Flags, 64)
    assert longer.total == 200 and longer.decay_from == (160, 1.0)
    assert [lr_factor(longer, pos) for pos in (60, 159, 180, 200)] == [1.0, 1.0, pytest.approx(0.5), 0.0]
    decaying = P.replan(plan, 90, 90, Flags, 64)  # at position 90, decaying: from today's LR to the new end
    assert lr_factor(decaying, 90) == pytest.approx(lr_factor(plan, 90)) and lr_factor(decaying, 200) == 0
    assert all(lr_factor(decaying, p) >= lr_factor(decaying, p + 1) for p in range(90, 200))
    Flags.epochs, Flags.schedule = 2, "linear"


def test_a_replanned_lr_continues_from_today_s_value_and_never_rises():
    """A resume that moves the end of a linear plan (more epochs; --max-steps at twice the batch; fewer steps)
    goes on from the LR of today's position down to 0, never up; during the warmup the warmup is kept."""
    plan = estimate_steps.LRPlan(total=100, warmup=10, batch=64, steps_per_epoch=50.0, decay_from=(10, 1.0))
    curve = [lr_factor(plan, pos) for pos in range(101)]
    assert curve[0] == 0.1 and curve[9] == 1.0 and curve[10] == 1.0 and curve[55] == 0.5 and curve[100] == 0.0
    at_60 = lr_factor(plan, 60)

    class Flags:
        epochs, max_steps, budget = 2, None, None

    # at plan position 60: more epochs; --max-steps at twice the planned batch (a step counts 2); fewer steps
    for epochs, max_steps, step, batch, total in ((4, None, 60, 64, 200), (2, 70, 55, 128, 90), (2, 65, 60, 64, 65)):
        Flags.epochs, Flags.max_steps = epochs, max_steps
        new = P.replan(plan, 60, step, Flags, batch)
        assert new.total == total
        after = [lr_factor(new, pos) for pos in range(60, 301)]
        assert after[0] == pytest.approx(at_60)  # continues from today's LR...
        assert all(a >= b for a, b in zip(after, after[1:], strict=False)) and after[-1] == 0  # ...to 0, never up
    Flags.epochs, Flags.max_steps = 2, None  # during warmup the warmup is kept
    assert lr_factor(P.replan(plan, 5, 5, Flags, 64), 5) == curve[5]


def test_durations_parse_and_the_estimator_says_which_limit_ends_the_run(tmp_path):
    assert [estimate_steps.duration(t) for t in ("6h", "90m", "45s", "1h30m", "0.5h")] == [21600, 5400, 45, 5400,
                                                                                          1800]
    for bad in ("", "6", "h", "-1h", "0s", "6 hours"):
        with pytest.raises(Exception, match="is not a time such as 6h, 90m, 45s"):
            estimate_steps.duration(bad)
    summary_path = tmp_path / "summary.json"
    summary_path.write_text(json.dumps({"steps_per_hour": 7200}))
    assert estimate_steps.step_time(str(summary_path)) == 0.5
    answer = estimate_steps.time_answer(1000, 0.5, 300)
    assert (answer["epochs_seconds"], answer["budget_steps"], answer["limit"]) == (500, 600, "budget")
    assert estimate_steps.time_answer(1000, 0.5, 3600)["limit"] == "epochs"
    assert estimate_steps.time_answer(1000, 0.5, 60)["limit"] == "budget"


BUDGET = ["--budget", "20s", "--epochs", "50", "--num-workers", "0", "--save-every", "20", "--keep-last", "1000",
          "--log-every", "1"]


@pytest.mark.slow
def test_a_budget_run_ends_on_its_budget_and_resumes_bitwise(tmp_path, corpus, tok_dir):
    """--budget 20s: the run plans its steps from a calibration (put back: step 1 runs on the final plan),
    ends within 10% of the budget in training time (plus however much this machine's speed moved between
    the calibration and the run: a plan is never re-made), its LR plan ends at its last step. Resumed from
    its last checkpoint before the end in a copy of its out dir (what a SIGKILL there leaves; the kill itself:
    test_checkpoints), with no new calibration, it ends bitwise equal to the uninterrupted run."""
    out = str(tmp_path / "budget")
    _, stdout, _ = run_main(*common(corpus, tok_dir, out), *BUDGET)
    s = summary(out)
    budget, plan = s["budget"], s["lr_plan"]
    assert s["steps"] == plan["total"] == budget["steps_fit"] and s["lr_plan_position"] == plan["total"]
    assert lr_factor(P.LRPlan.from_dict(plan), s["lr_plan_position"]) == 0 and budget["limit"] == "budget"
    speed_moved = abs(3600 / s["steps_per_hour"] / budget["train_step_s"] - 1)
    assert abs(s["train_seconds"] / 20 - 1) <= 0.10 + speed_moved, (s["train_seconds"], budget, speed_moved)
    assert re.search(r"^--budget 0h00m20s: a step takes [\d.]+ s here, [\d.]+ s with eval, checkpoints and exports "
                     r"by their share; the calibration took [\d.]+ s: planned [\d,]+ steps \([\d.]+ epochs\)", stdout,
                     re.M), stdout[:3000]
    # The run as if SIGKILLed after its last checkpoint before the end (its last ~20 steps to redo: resuming the
    # first one would train most of the budget again, ~17 s of the suite, for the same check of the stored plan)
    killed = str(tmp_path / "killed")
    shutil.copytree(out, killed, ignore=shutil.ignore_patterns("hf", "summary.json"))
    steps = sorted(checkpoints.step_folders(os.path.join(killed, "checkpoints")))
    resume_at = max(k for k in steps if k < s["steps"])
    for k in steps:
        if k != resume_at:
            shutil.rmtree(os.path.join(killed, "checkpoints", checkpoints.step_name(k)))
    with open(os.path.join(killed, "checkpoints", "latest"), "w") as f:
        f.write(checkpoints.step_name(resume_at))
    _, stdout, err = run_main(*common(corpus, tok_dir, killed), *BUDGET)
    assert f"resumed from {killed}/checkpoints/{checkpoints.step_name(resume_at)}" in stdout, err[-3000:]
    assert "the calibration took" in stdout and resume_at >= 20, stdout[:3000]
    assert summary(killed)["steps"] == s["steps"]
    assert same_weights(final_weights(out), final_weights(killed))


@pytest.mark.slow
def test_wsd_extends_in_its_stable_phase_and_a_decay_branches_off_with_init_from(tmp_path, corpus, tok_dir):
    """A wsd run of 20 steps (decay over the last 4) resumed from its stable checkpoint of step 12 with
    --max-steps 40: the LR stays at its peak until step 32 and decays to 0 at 40 (no jump). A decay
    branched off the stable checkpoint with --init-from --warmup 0 --decay 1: the LR starts at the peak
    and falls linearly to 0 over its 10 steps."""
    out = str(tmp_path / "wsd")
    args = [*common(corpus, tok_dir, out), "--schedule", "wsd", "--lr", "1e-3", "--warmup", "0.1", "--save-every",
            "4", "--keep-last", "10"]
    _, stdout, _ = run_main(*args, "--max-steps", "20")
    lr = logged(stdout, "train/lr")
    assert lr[2] == pytest.approx(1e-3) and lr[17] == pytest.approx(1e-3) and lr[18] < 1e-3 and lr[20] < lr[19]
    _, stdout, err = run_main(*args, "--max-steps", "40", "--resume", os.path.join(out, "checkpoints", "step_000012"))
    assert "resumed from" in stdout, err[-3000:]
    lr = logged(stdout, "train/lr")
    assert min(lr.values()) == lr[40] and lr[40] == pytest.approx(1e-3 / 8)  # step 40 runs at position 39
    assert all(lr[k] == pytest.approx(1e-3) for k in range(13, 34)) and lr[34] < 1e-3
    branch = str(tmp_path / "branch")
    _, stdout, _ = run_main(*common(corpus, tok_dir, branch), "--init-from",
                            os.path.join(out, "checkpoints", "step_000012"), "--schedule", "wsd", "--decay", "1",
                            "--warmup", "0", "--lr", "1e-3", "--max-steps", "10")
    lr = logged(stdout, "train/lr")
    assert [round(lr[k] / 1e-4, 6) for k in range(1, 11)] == [10, 9, 8, 7, 6, 5, 4, 3, 2, 1]
