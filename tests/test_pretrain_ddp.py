"""pretrain_ddp.py end to end: real processes, real torchrun + gloo on the CPU, each bounded by a timeout (conftest's
run) so that a hang fails the test instead of stalling CI; and, in-process, what main() does before training (the
input checks) and in a step (the loss scale, clipping), and the CPU's peak for MFU. A run that several tests read is
a module fixture, made once."""
import contextlib
import json
import os
import re
import sys

import pytest
import torch
from conftest import (
    FAST,
    ROOT,
    TESTS,
    Launch,
    common,
    copy_of,
    crash_at,
    logged,
    make_stream,
    plain,
    run,
    run_main,
    summary,
    torchrun,
    wait_for,
    write_corpus,
)

import model as M
import pretrain_ddp as P
import ranks


def fp16_main(init_scale, *args):
    """run_main with fp16 autocast and a GradScaler on the CPU (for users fp16 is CUDA's: a CPU takes bf16 or
    fp32); a large init_scale makes the first steps overflow, as fp16 training does at its start."""
    grad_scaler = torch.amp.GradScaler
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(P, "choose_amp_dtype", lambda args, device: torch.float16)
        patch.setattr(torch.amp, "GradScaler",
                      lambda device, enabled: grad_scaler(device, init_scale=init_scale, enabled=enabled))
        return run_main(*args)


def planned_lr(lr, total, warmup, step):
    """The documented schedule, written out independently: step k runs at plan position k - 1."""
    pos = step - 1
    return lr * (pos + 1) / warmup if pos < warmup else lr * (total - pos) / (total - warmup)


# ----------------------------------------------------------------------------- several ranks

@pytest.mark.slow
def test_two_ranks_with_accumulation_give_the_weights_of_one_big_batch():
    """tests/_ddp_equivalence.py under torchrun: 2 ranks x 2 micro-batches move the weights as one process with
    one batch of all of them, without clipping and with it (on the global norm)."""
    result = run(torchrun(2, "2", script=os.path.join(TESTS, "_ddp_equivalence.py")))
    found = re.findall(r"RESULT clip=(\S+) max_diff=(\S+) moved=(\S+)", result.stdout)
    assert [clip for clip, _, _ in found] == ["0.0", "0.5"], result.stdout + result.stderr
    for clip, max_diff, moved in found:
        assert float(moved) > 1e-3, clip  # the weights really changed...
        assert float(max_diff) < 1e-5, clip  # ...and identically (fp32 sums in another order)


@pytest.fixture(scope="module")
def eval_corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("eval") / "eval.txt", 24, seed=5)


@pytest.fixture(scope="module", params=[(2, 0), (3, 2)], ids=["2_ranks", "3_ranks_2_workers"])
def uneven_run(request, tmp_path_factory, tok_dir, eval_corpus):
    """2 epochs with --accum-steps 2 on one huge document (most of the bytes) and a few small ones: shards as
    uneven as sharding by documents allows, some ranks may hold nothing at all. --lr 0 keeps the initial
    weights (which the seed makes those of every run here), so the eval at the end is theirs.
    Returns (ranks, out dir, stdout)."""
    nproc, num_workers = request.param
    root = tmp_path_factory.mktemp("uneven")
    path = write_corpus(root / "uneven.txt", 5, skew=[400, 3, 2, 2, 1])
    out = str(root / "run")
    result = run(torchrun(nproc, *common(path, tok_dir, out), "--eval-corpus", eval_corpus, "--num-workers",
                          str(num_workers), "--epochs", "2", "--accum-steps", "2", "--lr", "0"))
    assert result.returncode == 0, result.stderr[-3000:]
    return nproc, out, result.stdout


@pytest.mark.slow
def test_uneven_shards_finish_in_step(uneven_run):
    nproc, out, stdout = uneven_run
    s = summary(out)
    assert s["world_size"] == nproc and s["epochs_done"] == 2
    assert s["steps"] == s["planned_steps"] == s["estimate"]["total_steps"]
    unused = s["unused_samples_per_epoch"]
    assert len(unused) == 2 and all(len(u) == nproc for u in unused)
    assert max(max(u) for u in unused) > 20  # the big rank had to leave data: it was really uneven
    assert len(re.findall(r"epoch \d ended at step", stdout)) == 2


@pytest.fixture(scope="module")
def one_rank_eval(tmp_path_factory, corpus, tok_dir, eval_corpus):
    """The eval of the initial weights (--lr 0) by 1 rank."""
    out = str(tmp_path_factory.mktemp("one_rank_eval") / "run")
    run_main(*common(corpus, tok_dir, out), "--eval-corpus", eval_corpus, "--max-steps", "1", "--lr", "0")
    return summary(out)["eval"]


@pytest.mark.slow
def test_eval_on_several_ranks_equals_the_one_rank_eval(uneven_run, one_rank_eval):
    """Eval metrics are global: 2 ranks (3 with 2 workers each), each holding part of the eval set, report
    what 1 rank reports, for the same (initial: --lr 0) weights."""
    one, several = one_rank_eval, summary(uneven_run[1])["eval"]
    assert one.keys() == {"eval/mlm_loss", "eval/perplexity", "eval/mlm_accuracy", "eval/nsp_loss",
                          "eval/nsp_accuracy"}
    assert all(several[k] == pytest.approx(one[k], rel=1e-4) for k in one), (one, several)


@pytest.mark.slow
def test_one_document_on_two_ranks_ends_without_a_step_and_evaluates_on_both(tmp_path, tok_dir):
    path = write_corpus(tmp_path / "one.txt", 1, skew=[40])
    out = str(tmp_path / "run")
    result = run(torchrun(2, *common(path, tok_dir, out), "--eval-corpus", path))
    assert result.returncode == 0, result.stderr[-3000:]
    s = summary(out)
    assert s["steps"] == 0 and s["unused_samples_per_epoch"][0][0] + s["unused_samples_per_epoch"][0][1] > 0
    assert "eval/mlm_loss" in s["eval"]  # eval is sharded too: the rank without data adds zeros


@pytest.mark.slow
def test_bad_tokenizer_under_torchrun_is_one_line_from_rank_0_and_every_rank_exits(tmp_path, corpus):
    result = run(torchrun(2, "--corpus", corpus, "--tokenizer", str(tmp_path), "--out-dir", str(tmp_path / "o")),
                 timeout=300)
    assert result.returncode != 0
    # said once, by rank 0 (which names itself), then all ranks exit
    assert re.search(r"pretrain_ddp.py: error: rank 0 on \S+: --tokenizer", result.stderr), result.stderr[-3000:]
    assert result.stderr.count("pretrain_ddp.py: error") == 1


# On PYTHONPATH of the ranks: rank 0's preparation (plan_run -> new_lr_plan, the only caller of
# estimate_steps.estimate) sleeps, as counting a big corpus would. The agent is left alone.
SLOW_PREPARATION = """
import os, sys, time
if "LOCAL_RANK" in os.environ:
    import estimate_steps
    _estimate = estimate_steps.estimate

    def estimate(*args, **kwargs):
        if not estimate.__dict__.get("slept"):
            estimate.slept = True
            print(f"rank {{os.environ['RANK']}}: the preparation sleeps {seconds} s", file=sys.stderr, flush=True)
            time.sleep({seconds})
        return _estimate(*args, **kwargs)

    estimate_steps.estimate = estimate
"""


@pytest.mark.slow
def test_ranks_wait_out_rank_0_s_preparation_beyond_the_collective_timeout(tmp_path, corpus):
    """Rank 0 trains the tokenizer and counts the steps (hours on a big corpus) while rank 1 waits:
    --dist-timeout bounds only the collectives, not that wait. Here the preparation sleeps 12 s on
    purpose and --dist-timeout is 0.15 min (9 s), far above what a training collective needs under
    load: a rank that waited for rank 0 with --dist-timeout fails, whatever the machine's load."""
    patch = tmp_path / "slow_preparation"
    patch.mkdir()
    (patch / "sitecustomize.py").write_text(SLOW_PREPARATION.format(seconds=12))
    out = str(tmp_path / "run")
    result = run(torchrun(2, "--corpus", corpus, "--vocab-size", "300", "--out-dir", out, *FAST, "--max-steps", "2",
                          "--eval-corpus", "none", "--dist-timeout", "0.15"), timeout=300,
                 env={"BERT_DDP_CACHE": str(tmp_path / "cache"), "PYTHONPATH": os.pathsep.join([str(patch), ROOT])})
    assert result.returncode == 0, result.stderr[-3000:]
    # the preparation really outlasted the timeout, on rank 0 alone
    assert re.findall(r"rank \d: the preparation sleeps", result.stderr) == ["rank 0: the preparation sleeps"], \
        result.stderr[-3000:]
    assert summary(out)["steps"] == 2


@pytest.mark.slow
def test_resize_resume_keeps_the_lr_plan_across_a_chain(tmp_path, corpus, tok_dir):
    """1 rank for part of an epoch, SIGKILL; resumed on 2 ranks, SIGKILL again; resumed on 2 ranks to
    the end. The plan (in planned steps) continues through every hop: after the warmup the logged LR
    never rises, and the run ends at the plan's end with the LR at ~0. (A position taken from the
    checkpoint's step, not from its planned batches, passes the first hop and fails the second: the
    LR jumps back up and the data ends with the plan unfinished.)"""
    out = str(tmp_path / "run")
    ckpts = os.path.join(out, "checkpoints")
    args = common(corpus, tok_dir, out, "--epochs", "1", "--batch-size", "8", "--save-every", "20")
    rc, first, _ = run(plain(*args), crash_at(r"^step 45:"))
    assert rc != 0 and "step 45:" in first
    rc, second, err = run(torchrun(2, *args), crash_at(r"^step 64:"))
    assert rc != 0 and "step 64:" in second and f"resumed from {ckpts}/step_000040" in second, err[-3000:]
    assert "a step now counts as 2 planned steps" in err and "no longer bit-exact" in err, err[-3000:]
    rc, third, err = run(torchrun(2, *args))
    assert rc == 0 and f"resumed from {ckpts}/step_000060" in third, third[-2000:] + err[-3000:]
    assert "warning: resuming" not in err  # 2 ranks again: no resize on this hop
    # the timeline: each hop's steps replace those of the hop before from where it resumed
    lrs = {**logged(first, "train/lr"), **logged(second, "train/lr"), **logged(third, "train/lr")}
    s = summary(out)
    plan, last = s["lr_plan"], s["steps"]
    assert sorted(lrs) == list(range(1, last + 1)) and last > 70, sorted(lrs)
    rises = [(k, lrs[k - 1], lrs[k]) for k in range(plan["warmup"] + 1, last + 1) if lrs[k] > lrs[k - 1]]
    assert not rises, f"the LR rose after the warmup at (step, from, to): {rises}"
    # 1 rank: positions 0-39; 2 ranks: 2 a step from there; the last step ran at total - 2
    assert s["lr_plan_position"] == 40 + 2 * (last - 40) == pytest.approx(plan["total"], abs=2), (s, last)
    assert lrs[last] < 0.05 * max(lrs.values()), (lrs[last], plan)  # ~0: 2 planned steps before the end


# ----------------------------------------------------------------------------- one rank

@pytest.mark.slow
def test_a_bf16_run_reports_every_summary_key_and_logs_each_step_to_tensorboard(tmp_path, corpus, tok_dir):
    out = str(tmp_path / "run")
    run_main(*common(corpus, tok_dir, out), "--eval-corpus", corpus, "--amp", "--amp-dtype", "bf16", "--max-steps", "6",
             "--objective", "mlm", "--log-to", "stdout,tensorboard")
    s = summary(out)
    assert s["steps"] == 6 and s["train_loss"] is not None and 0 < s["train_loss"] < 20
    assert set(s) >= {"steps", "epochs_done", "train_loss", "eval", "samples_seen", "tokens_seen",
                      "tokens_per_sec", "world_size", "effective_batch", "planned_steps", "steps_per_hour", "mfu",
                      "tokens_per_sec_overall", "steps_per_hour_overall", "mfu_overall", "steady_from_step"}
    assert s["steady_from_step"] == 1  # a 6-step run: the steady rates leave out only the first step
    assert s["effective_batch"] == 4 and s["samples_seen"] == 24 and s["tokens_seen"] > 24 * 10
    assert 0 < s["eval"]["eval/mlm_accuracy"] <= 1 and "eval/nsp_accuracy" not in s["eval"]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(out)
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/loss", "train/lr", "train/grad_norm", "train/tokens_per_sec", "train/data_wait",
            "train/mfu", "eval/perplexity"} <= tags
    assert [e.step for e in events.Scalars("train/loss")] == [1, 2, 3, 4, 5, 6]


@pytest.mark.slow
def test_the_builtin_corpus_loss_falls_by_a_nat_in_60_steps(tmp_path):
    out = str(tmp_path / "run")
    result = run_main("--out-dir", out, "--max-steps", "60", "--log-every", "10", "--eval-every", "1000",
                      "--log-to", "stdout", "--lr", "2e-3", "--num-workers", "0")
    losses = [float(x) for x in re.findall(r"train/mlm_loss (\S+),", result.stdout)]
    assert len(losses) == 6 and losses[-1] < losses[0] - 1.0, losses  # visibly learning
    s = summary(out)
    assert s["eval"]["eval/mlm_loss"] < losses[0] and 0.3 < s["eval"]["eval/nsp_accuracy"] < 1
    assert "effective batches/hour" in result.stdout and "estimated total time" in result.stdout


def lr_run_args(corpus, tok_dir, out):
    # --epochs 100000: --max-steps ends the run, and only the epochs it reaches are estimated
    return common(corpus, tok_dir, out, "--max-steps", "12", "--warmup", "0.25", "--lr", "1e-3", "--save-every", "4",
                  "--keep-last", "5", "--eval-corpus", corpus, "--eval-every", "2", "--epochs", "100000")


@pytest.fixture(scope="module")
def lr_run(tmp_path_factory, corpus, tok_dir):
    """One finished fp32 run of 12 steps, a checkpoint every 4, an eval of the whole corpus every 2 steps;
    shared by the tests that read it and those that resume it (each its own copy, with no eval).
    Returns (out dir, its stdout)."""
    out = str(tmp_path_factory.mktemp("lr_run") / "run")
    return out, run_main(*lr_run_args(corpus, tok_dir, out)).stdout


@pytest.mark.slow
def test_logged_lr_is_the_plan_every_step_and_after_a_resume(tmp_path, corpus, tok_dir, lr_run):
    """12 steps, --warmup 0.25: 3 warmup steps to the peak, linear decay to 0 at step 12; a run
    resumed from step 4 logs the same LR at every step."""
    out = copy_of(lr_run[0], tmp_path)
    lrs = logged(lr_run[1], "train/lr")
    expected = {k: planned_lr(1e-3, 12, 3, k) for k in range(1, 13)}
    assert lrs.keys() == expected.keys() and max(lrs.values()) == pytest.approx(1e-3, rel=1e-3)
    assert all(lrs[k] == pytest.approx(expected[k], rel=1e-3, abs=1e-9) for k in expected), (lrs, expected)
    resumed = run_main(*lr_run_args(corpus, tok_dir, out), "--eval-corpus", "none", "--resume",
                       os.path.join(out, "checkpoints", "step_000004"))
    assert "resumed from" in resumed.stdout, resumed.stdout[-3000:]
    assert logged(resumed.stdout, "train/lr") == {k: lrs[k] for k in range(5, 13)}


@pytest.mark.slow
def test_steady_rates_leave_out_the_start_and_the_evals(lr_run):
    out, stdout = lr_run
    s = summary(out)
    # ~33 steps per epoch at this batch: one epoch reaches step 12, one more is the margin
    assert s["estimate"]["epochs"] <= 2 and s["planned_steps"] == 12
    assert os.path.getsize(os.path.join(out, "summary.json")) < 50_000  # was 20 MB: one entry per epoch
    assert s["steady_from_step"] == 5 and "steady rates from step 5 on" in stdout
    # six evals over the whole eval corpus are in the overall rates only
    assert s["tokens_per_sec"] > 1.5 * s["tokens_per_sec_overall"]
    assert s["steps_per_hour"] > 1.5 * s["steps_per_hour_overall"] and s["mfu"] > s["mfu_overall"] > 0
    assert s["tokens_per_sec_overall"] * s["time_s"] == pytest.approx(s["tokens_seen"], rel=1e-6)


@pytest.mark.slow
def test_a_resume_switches_between_fp32_and_fp16_with_a_fresh_grad_scaler(tmp_path, corpus, tok_dir, lr_run):
    """fp32 checkpoint resumed with fp16 + GradScaler (a disabled scaler saved {}: loading it into an
    enabled one used to raise), and that fp16 checkpoint resumed in fp32: both run on, each says so."""
    out = copy_of(lr_run[0], tmp_path)  # fp32, 12 steps, a checkpoint every 4
    args = [*lr_run_args(corpus, tok_dir, out), "--eval-corpus", "none"]
    step = lambda n: ["--resume", os.path.join(out, "checkpoints", f"step_00000{n}")]  # noqa: E731
    # a full plan's LR is 0 at its end, so each resumes mid-way
    fp16 = fp16_main(1024, *args, *step(4))
    assert "resumed from" in fp16.stdout and "a fresh GradScaler starts" in fp16.stderr
    assert logged(fp16.stdout, "train/loss_scale")  # fp16 really ran
    back = run_main(*args, *step(8))  # the fp16 run's checkpoint
    assert "resumed from" in back.stdout, back.stdout[-3000:]
    assert summary(out)["steps"] == 12


@pytest.fixture(scope="module")
def fp16_run(tmp_path_factory, corpus, tok_dir):
    """8 steps of fp16 autocast + GradScaler on the CPU (fp16_main) from a loss scale of 1.6e6, so that
    the first steps overflow; a checkpoint every 3. Its eval corpus holds no text. Returns (out dir, the args of
    the run, its stdout and stderr)."""
    root = tmp_path_factory.mktemp("fp16")
    blank = root / "blank.txt"
    blank.write_text("\n\n")
    out = str(root / "run")
    args = common(corpus, tok_dir, out, "--max-steps", "8", "--warmup", "0.5", "--lr", "1e-3", "--save-every", "3",
                  "--eval-corpus", str(blank), "--eval-every", "1")
    first = fp16_main(1.6e6, *args)
    return out, args, first.stdout, first.stderr


@pytest.mark.slow
def test_fp16_with_grad_scaler_on_cpu_skips_overflows_and_resumes_the_scale(fp16_run):
    """The overflowing steps are skipped (the weights stay) but count as steps, as in the Trainer: knowing a skip
    on the host would cost a sync per step, so the count lives on the device and is read at log steps. The scale
    falls by halves, it is saved with the checkpoint, and a run resumed in the middle of the skips continues
    with it, step for step."""
    out, args, stdout, _ = fp16_run
    s, scales = summary(out), logged(stdout, "train/loss_scale")
    skips = s["skipped_steps"]
    assert 3 <= skips < 8 and s["steps"] == 8 and s["samples_seen"] == 8 * 4, s
    assert f"{skips} step(s) skipped for an inf/NaN gradient (fp16 overflows: the loss scale is now" in stdout
    # the first step overflowed; each skipped step halved the scale and every other step kept it,
    # so the count read from the device at the end is the number of halvings
    assert sorted(scales) == list(range(1, 9)) and scales[1] == pytest.approx(1.6e6 / 2, rel=1e-3), scales
    assert all(scales[k] / scales[k - 1] in (pytest.approx(1.0), pytest.approx(0.5)) for k in range(2, 9)), scales
    assert 1.6e6 / scales[8] == pytest.approx(2 ** skips, rel=1e-3), (scales, skips)
    lrs = logged(stdout, "train/lr")
    assert all(lrs[k] == pytest.approx(planned_lr(1e-3, 8, 4, k), rel=1e-3) for k in lrs), lrs
    trainer = torch.load(os.path.join(out, "checkpoints", "step_000008", "trainer.pt"), weights_only=True)
    assert trainer["scaler"]["scale"] == pytest.approx(scales[8], rel=1e-3)
    again = fp16_main(1.6e6, *args, "--resume", os.path.join(out, "checkpoints", "step_000003"))
    assert 2 ** summary(out)["skipped_steps"] == pytest.approx(scales[3] / scales[8], rel=1e-3)
    for name in ("train/loss_scale", "train/loss", "train/lr"):  # the same steps 4-8 (a skipped one's loss: nan)
        assert str(logged(again.stdout, name)) == str({k: v for k, v in logged(stdout, name).items() if k > 3})


@pytest.mark.slow
def test_an_empty_eval_set_warns_and_is_skipped(fp16_run):
    out, _, _, stderr = fp16_run  # --eval-corpus: a file with no text, --eval-every 1
    assert "warning: no evaluation" in stderr and summary(out)["eval"] == {}


# ----------------------------------------------------------------------------- bad input

def bad_input_cases(tmp_path):
    as_file = tmp_path / "a_file"
    as_file.write_text("x")
    return [(["--batch-size", "0"], "--batch-size"), (["--accum-steps", "0"], "--accum-steps"),
            (["--max-seq-len", "4"], "--max-seq-len"), (["--amp", "--amp-dtype", "fp16"], "fp16"),
            (["--tokenizer", str(tmp_path)], "--tokenizer"), (["--out-dir", str(as_file)], "is a file"),
            (["--log-to", "stdout,mlflow"], "mlflow"), (["--corpus", str(tmp_path / "nope.txt")], "does not exist"),
            # every numeric flag has its range in one table (argparse types): flag, value and range in one line
            (["--mask-prob", "1.5"], "--mask-prob: 1.5 is out of range (allowed: 0 < x <= 1)"),
            (["--warmup", "2"], "--warmup: 2 is out of range (allowed: 0 <= x <= 1)"),
            (["--lr", "-1"], "--lr: -1 is out of range (allowed: x >= 0)"),
            (["--dropout", "1"], "--dropout: 1 is out of range"), (["--seed", "-1"], "--seed: -1 is out of range"),
            (["--epochs", "two"], "--epochs: 'two' is not an integer"),
            (["--model-size", "huge"], "invalid choice"),
            (["--generator-size", "0.5"], "--generator-size applies to --objective electra only, not nsp"),
            (["--objective", "electra", "--generator-size", "2"], "makes the generator wider than the model")]


# Run end to end (exit code 2, one line on stderr, no traceback): one case of each place an input error is
# found (argparse, validate() with mlflow hidden, the device's precision, plan_run, a choice); the rest are
# checked in-process by test_bad_input_is_found_before_training_in_one_line.
END_TO_END = ("--mask-prob", "--log-to", "--amp", "--out-dir", "--model-size")


def test_bad_input_is_found_before_training_in_one_line(tmp_path, corpus, tok_dir, capsys, monkeypatch):
    """Every bad input of bad_input_cases is an argparse error (exit code 2, one line) or a UserError
    (__main__ prints its one line and exits with 2) raised in the steps main() takes before any
    training: parse_args, validate, the precision, plan_run."""
    monkeypatch.setitem(sys.modules, "mlflow", None)  # as when it is not installed: import mlflow fails
    base = ["--corpus", corpus, "--tokenizer", tok_dir, "--out-dir", str(tmp_path / "o")]
    for extra, message in bad_input_cases(tmp_path):
        with pytest.raises((SystemExit, *P.USER_ERRORS)) as error:
            args = P.parse_args([*base, *extra])
            P.validate(args)
            P.choose_amp_dtype(args, torch.device("cpu"))
            P.plan_run(args, torch.device("cpu"), None, P.Rank0Only())
        stderr = capsys.readouterr().err
        if error.type is SystemExit:
            assert error.value.code == 2 and len(stderr.strip().splitlines()) == 1, (extra, stderr)
            assert message in stderr, (extra, stderr)
        else:
            assert message in str(error.value) and len(str(error.value).splitlines()) == 1, (extra, error.value)


@pytest.mark.slow
def test_bad_input_end_to_end_exits_2_with_one_line_and_no_traceback(tmp_path, corpus, tok_dir):
    """End to end, one case of each place (END_TO_END): exit code 2, one line, no traceback."""
    base = ["--corpus", corpus, "--tokenizer", tok_dir, "--out-dir", str(tmp_path / "o")]
    cases = [(extra, message) for extra, message in bad_input_cases(tmp_path) if extra[0] in END_TO_END]
    assert len(cases) == len(END_TO_END)
    # mlflow is hidden (as when it is not installed), so that the verdict does not depend on this machine
    hidden = tmp_path / "hidden" / "mlflow"
    hidden.mkdir(parents=True)
    (hidden / "__init__.py").write_text("raise ImportError(\"No module named 'mlflow'\")\n")
    results = wait_for([Launch(plain(*base, *extra), extra_env={"PYTHONPATH": str(hidden.parent)})
                        for extra, _ in cases], timeout=300)  # in parallel: each pays for importing torch
    for (extra, message), (code, _, stderr) in zip(cases, results, strict=True):
        assert code == 2, (extra, stderr)
        assert message in stderr and "Traceback" not in stderr, (extra, stderr)
        assert len(stderr.strip().splitlines()) == 1, (extra, stderr)


# ----------------------------------------------------------------------------- in-process: a step, the CPU's peak

def test_fp16_overflow_step_is_reported_and_leaves_the_weights(corpus, tokenizer):
    import copy

    stream = make_stream(corpus, tokenizer)
    batch, counts = M.prepare(M.sparse_targets(next(iter(stream))), torch.device("cpu"))
    masked = counts["num_masked"]
    torch.manual_seed(0)
    model = M.Pretraining(M.model_from(M.new_architecture("tiny", len(tokenizer), 32, tokenizer.pad_token_id),
                                       "nsp", 0.0))
    before = copy.deepcopy(model.state_dict())
    optimizer = torch.optim.AdamW(model.parameters())
    for init_scale, skipped in ((float("inf"), True), (1.0, False)):  # every gradient x inf overflows
        scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
        trainer = P.Trainer(model, model, optimizer, scaler, contextlib.nullcontext())
        overflowed = P.train_step(trainer, [batch], (masked, 4), 1, 1.0, 1e-3).skipped
        assert bool(overflowed) == skipped  # a device tensor: read here, in the loop only at log steps
        unchanged = all(torch.equal(before[k], v) for k, v in model.state_dict().items())
        assert unchanged == skipped


def test_clipping_bounds_the_applied_gradient_measured_unscaled(corpus, tokenizer):
    """SGD at lr 1 makes the weight update the applied gradient: with --clip 0 its norm is the raw
    norm; with --clip 0.01 it is 0.01. Under fp16's GradScaler (scale 4096) the norm is measured
    and clipped on the unscaled gradients: the same numbers."""
    stream = make_stream(corpus, tokenizer)
    batch, counts = M.prepare(M.sparse_targets(next(iter(stream))), torch.device("cpu"))
    masked = counts["num_masked"]
    found = {}
    for loss_scale in (None, 2.0 ** 12):
        for clip in (0.0, 0.01):
            torch.manual_seed(0)
            model = M.Pretraining(M.model_from(M.new_architecture("tiny", len(tokenizer), 32, tokenizer.pad_token_id),
                                               "nsp", 0.0))
            before = [p.detach().clone() for p in model.parameters()]
            scaler = torch.amp.GradScaler("cpu", init_scale=loss_scale or 1.0, enabled=loss_scale is not None)
            trainer = P.Trainer(model, model, torch.optim.SGD(model.parameters()), scaler, contextlib.nullcontext())
            raw_norm = P.train_step(trainer, [batch], (masked, 4), 1, clip, 1.0).grad_norm
            applied = sum(float(((p.detach() - b) ** 2).sum()) for p, b in zip(model.parameters(), before,
                                                                                 strict=True)) ** 0.5
            found[loss_scale, clip] = float(raw_norm), applied
    raw, applied = found[None, 0.0]
    assert raw > 0.1 and applied == pytest.approx(raw, rel=1e-4)  # no clipping: the whole gradient
    for key, (raw_norm, applied) in found.items():
        assert raw_norm == pytest.approx(raw, rel=1e-4), key  # reported before clipping, unscaled
        assert applied == pytest.approx(raw if key[1] == 0 else 0.01, rel=1e-4), key


def test_cpu_peak_is_timed_once_per_machine_and_thread_count(tmp_path, monkeypatch):
    """The CPU's peak (for MFU) is timed at the first launch and read from the cache after it."""
    monkeypatch.setattr(P.data_stream, "CACHE_DIR", str(tmp_path))
    cpu = torch.device("cpu")
    first = P.peak_flops(cpu, None)
    with open(tmp_path / "cpu_peak.json") as f:
        assert json.load(f) == {f"{ranks.HOST} {torch.get_num_threads()} threads": first} and first > 1e9
    monkeypatch.setattr(torch, "mm", None)  # a second timing would fail
    assert P.peak_flops(cpu, None) == first
    threads = torch.get_num_threads()
    try:  # another thread count is another peak: timed again
        torch.set_num_threads(threads + 1)
        with pytest.raises(TypeError):
            P.peak_flops(cpu, None)
    finally:
        torch.set_num_threads(threads)
