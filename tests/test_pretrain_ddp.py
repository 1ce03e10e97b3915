"""pretrain_ddp.py end to end: real processes, real torchrun + gloo on the CPU, each bounded by a
timeout so that a hang fails the test instead of stalling CI."""
import contextlib
import itertools
import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch
from conftest import ROOT, write_corpus

import model as M
import pretrain_ddp as P
import ranks

SCRIPT = os.path.join(ROOT, "pretrain_ddp.py")
FAST = ["--max-seq-len", "32", "--batch-size", "4", "--log-every", "1", "--eval-every", "1000", "--log-to", "stdout"]


def env():
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def run(args, nproc=1, timeout=480):
    cmd = [sys.executable, SCRIPT, *args] if nproc == 1 else \
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc), SCRIPT, *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env(), cwd=ROOT)


def summary(out_dir):
    with open(os.path.join(out_dir, "summary.json")) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def tok_dir(tokenizer, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tok"))
    tokenizer.save_pretrained(path)
    return path


@pytest.mark.slow
@pytest.mark.parametrize("accum", [2])
def test_ddp_two_ranks_with_accumulation_equal_one_big_batch(accum):
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                             os.path.join(ROOT, "tests", "_ddp_equivalence.py"), str(accum)],
                            capture_output=True, text=True, timeout=480, env=env())
    found = re.findall(r"RESULT clip=(\S+) max_diff=(\S+) moved=(\S+)", result.stdout)
    assert [clip for clip, _, _ in found] == ["0.0", "0.5"], result.stdout + result.stderr
    for clip, max_diff, moved in found:
        assert float(moved) > 1e-3, clip  # the weights really changed...
        assert float(max_diff) < 1e-5, clip  # ...and identically (fp32 sums in another order)


@pytest.mark.slow
@pytest.mark.parametrize("nproc,num_workers", [(2, 0), (3, 2)])
def test_uneven_shards_finish_in_step(tmp_path, tok_dir, nproc, num_workers):
    # One huge document (most of the bytes) and a few small ones: shards are as uneven as
    # sharding by documents allows, some ranks may hold nothing at all.
    path = write_corpus(tmp_path / "uneven.txt", 5, skew=[400, 3, 2, 2, 1])
    out = str(tmp_path / "run")
    result = run(["--corpus", path, "--tokenizer", tok_dir, "--eval-corpus", "none", "--out-dir", out,
                  "--num-workers", str(num_workers), "--epochs", "2", "--accum-steps", "2", *FAST], nproc=nproc)
    assert result.returncode == 0, result.stderr[-3000:]
    s = summary(out)
    assert s["world_size"] == nproc and s["epochs_done"] == 2
    assert s["steps"] == s["planned_steps"] == s["estimate"]["total_steps"]
    unused = s["unused_samples_per_epoch"]
    assert len(unused) == 2 and all(len(u) == nproc for u in unused)
    assert max(max(u) for u in unused) > 20  # the big rank had to leave data: it was really uneven
    assert len(re.findall(r"epoch \d ended at step", result.stdout)) == 2


@pytest.mark.slow
def test_one_document_two_ranks_no_hang(tmp_path, tok_dir):
    path = write_corpus(tmp_path / "one.txt", 1, skew=[40])
    out = str(tmp_path / "run")
    result = run(["--corpus", path, "--tokenizer", tok_dir, "--eval-corpus", path, "--out-dir", out, *FAST], nproc=2)
    assert result.returncode == 0, result.stderr[-3000:]
    s = summary(out)
    assert s["steps"] == 0 and s["unused_samples_per_epoch"][0][0] + s["unused_samples_per_epoch"][0][1] > 0
    assert "eval/mlm_loss" in s["eval"]  # eval is sharded too: the rank without data adds zeros


@pytest.mark.slow
def test_bf16_autocast_on_cpu_and_tensorboard(tmp_path, corpus, tok_dir):
    out = str(tmp_path / "run")
    result = run(["--corpus", corpus, "--tokenizer", tok_dir, "--eval-corpus", corpus, "--out-dir", out,
                  "--amp", "--amp-dtype", "bf16", "--max-steps", "6", "--num-workers", "0", "--objective", "mlm",
                  *FAST[:-2], "--log-to", "stdout,tensorboard"])
    assert result.returncode == 0, result.stderr[-3000:]
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
def test_default_corpus_loss_falls(tmp_path):
    out = str(tmp_path / "run")
    result = run(["--out-dir", out, "--max-steps", "60", "--log-every", "10", "--eval-every", "1000",
                  "--log-to", "stdout", "--lr", "2e-3", "--num-workers", "0"])
    assert result.returncode == 0, result.stderr[-3000:]
    losses = [float(x) for x in re.findall(r"train/mlm_loss (\S+),", result.stdout)]
    assert len(losses) == 6 and losses[-1] < losses[0] - 1.0, losses  # visibly learning
    s = summary(out)
    assert s["eval"]["eval/mlm_loss"] < losses[0] and 0.3 < s["eval"]["eval/nsp_accuracy"] < 1
    assert "effective batches/hour" in result.stdout and "estimated total time" in result.stdout


@pytest.mark.slow
def test_steady_rates_leave_out_the_start_and_the_evals(tmp_path, corpus, tok_dir):
    out = str(tmp_path / "run")
    # --epochs 100000: --max-steps ends the run, and only the epochs it reaches are estimated
    result = run(["--corpus", corpus, "--tokenizer", tok_dir, "--eval-corpus", corpus, "--out-dir", out,
                  "--max-steps", "12", "--epochs", "100000", "--num-workers", "0", *FAST[:-4], "--eval-every", "2"])
    assert result.returncode == 0, result.stderr[-3000:]
    s = summary(out)
    # ~33 steps per epoch at this batch: one epoch reaches step 12, one more is the margin
    assert s["estimate"]["epochs"] <= 2 and s["planned_steps"] == 12
    assert os.path.getsize(os.path.join(out, "summary.json")) < 50_000  # was 20 MB: one entry per epoch
    assert s["steady_from_step"] == 5 and "steady rates from step 5 on" in result.stdout
    # six evals over the whole eval corpus are in the overall rates only
    assert s["tokens_per_sec"] > 1.5 * s["tokens_per_sec_overall"]
    assert s["steps_per_hour"] > 1.5 * s["steps_per_hour_overall"] and s["mfu"] > s["mfu_overall"] > 0
    assert s["tokens_per_sec_overall"] * s["time_s"] == pytest.approx(s["tokens_seen"], rel=1e-6)


@pytest.mark.slow
def test_empty_eval_set_warns_and_skips(tmp_path, corpus, tok_dir):
    blank = tmp_path / "blank.txt"
    blank.write_text("\n\n")
    out = str(tmp_path / "run")
    result = run(["--corpus", corpus, "--tokenizer", tok_dir, "--eval-corpus", str(blank), "--out-dir", out,
                  "--max-steps", "2", "--eval-every", "1", *FAST[:-4], "--log-to", "stdout", "--num-workers", "0"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert "warning: no evaluation" in result.stderr and summary(out)["eval"] == {}


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
            (["--model-size", "huge"], "invalid choice")]


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
def test_bad_input_one_line_errors(tmp_path, corpus, tok_dir):
    """End to end, one case of each place (END_TO_END): exit code 2, one line, no traceback."""
    base = ["--corpus", corpus, "--tokenizer", tok_dir, "--out-dir", str(tmp_path / "o")]
    cases = [(extra, message) for extra, message in bad_input_cases(tmp_path) if extra[0] in END_TO_END]
    assert len(cases) == len(END_TO_END)
    # mlflow is hidden (as when it is not installed), so that the verdict does not depend on this machine
    hidden = tmp_path / "hidden" / "mlflow"
    hidden.mkdir(parents=True)
    (hidden / "__init__.py").write_text("raise ImportError(\"No module named 'mlflow'\")\n")
    procs = [subprocess.Popen([sys.executable, SCRIPT, *base, *extra], stderr=subprocess.PIPE, text=True,
                              env={**env(), "PYTHONPATH": str(hidden.parent)}) for extra, _ in cases]
    for proc, (extra, message) in zip(procs, cases, strict=True):
        _, stderr = proc.communicate(timeout=300)
        assert proc.returncode == 2, (extra, stderr)
        assert message in stderr and "Traceback" not in stderr, (extra, stderr)
        assert len(stderr.strip().splitlines()) == 1, (extra, stderr)


@pytest.mark.slow
def test_bad_tokenizer_under_torchrun_does_not_hang(tmp_path, corpus):
    result = run(["--corpus", corpus, "--tokenizer", str(tmp_path), "--out-dir", str(tmp_path / "o")], nproc=2,
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
def test_rank0_preparation_outlasts_the_collective_timeout(tmp_path, corpus):
    """Rank 0 trains the tokenizer and counts the steps (hours on a big corpus) while rank 1 waits:
    --dist-timeout bounds only the collectives, not that wait. Here the preparation sleeps 25 s on
    purpose and --dist-timeout is 0.25 min (15 s), far above what a training collective needs under
    load: a rank that waited for rank 0 with --dist-timeout fails, whatever the machine's load."""
    patch = tmp_path / "slow_preparation"
    patch.mkdir()
    (patch / "sitecustomize.py").write_text(SLOW_PREPARATION.format(seconds=25))
    out = str(tmp_path / "run")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", SCRIPT,
           "--corpus", corpus, "--vocab-size", "300", "--out-dir", out, *FAST, "--max-steps", "2",
           "--eval-corpus", "none", "--num-workers", "0", "--dist-timeout", "0.25"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT,
                            env={**env(), "BERT_DDP_CACHE": str(tmp_path / "cache"),
                                 "PYTHONPATH": os.pathsep.join([str(patch), ROOT])})
    assert result.returncode == 0, result.stderr[-3000:]
    # the preparation really outlasted the timeout, on rank 0 alone
    assert re.findall(r"rank \d: the preparation sleeps", result.stderr) == ["rank 0: the preparation sleeps"], \
        result.stderr[-3000:]
    assert summary(out)["steps"] == 2


def test_lr_plan_continues_and_never_jumps_up():
    plan = P.LRPlan(total=100, warmup=10, batch=64, steps_per_epoch=50.0, decay_from=(10, 1.0))
    curve = [P.lr_factor(plan, pos) for pos in range(101)]
    assert curve[0] == 0.1 and curve[9] == 1.0 and curve[10] == 1.0 and curve[55] == 0.5 and curve[100] == 0.0
    at_60 = P.lr_factor(plan, 60)

    class Flags:
        epochs, max_steps, budget = 2, None, None

    # at plan position 60: more epochs; --max-steps at twice the planned batch (a step counts 2); fewer steps
    for epochs, max_steps, step, batch, total in ((4, None, 60, 64, 200), (2, 70, 55, 128, 90), (2, 65, 60, 64, 65)):
        Flags.epochs, Flags.max_steps = epochs, max_steps
        new = P.replan(plan, 60, step, Flags, batch)
        assert new.total == total
        after = [P.lr_factor(new, pos) for pos in range(60, 301)]
        assert after[0] == pytest.approx(at_60)  # continues from today's LR...
        assert all(a >= b for a, b in zip(after, after[1:], strict=False)) and after[-1] == 0  # ...to 0, never up
    Flags.epochs, Flags.max_steps = 2, None  # during warmup the warmup is kept
    assert P.lr_factor(P.replan(plan, 5, 5, Flags, 64), 5) == curve[5]


def test_fp16_overflow_step_is_reported_and_leaves_the_weights(corpus, tokenizer):
    import copy

    import data_stream
    stream = data_stream.BertPretrainStream(corpus, tokenizer, max_seq_len=32, batch_size=4, rank=0, world_size=1)
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
        overflowed = P.train_step(trainer, [batch], masked, 4, 1, 1.0, 1e-3).skipped
        assert bool(overflowed) == skipped  # a device tensor: read here, in the loop only at log steps
        unchanged = all(torch.equal(before[k], v) for k, v in model.state_dict().items())
        assert unchanged == skipped


def test_clipping_bounds_the_applied_gradient_measured_unscaled(corpus, tokenizer):
    """SGD at lr 1 makes the weight update the applied gradient: with --clip 0 its norm is the raw
    norm; with --clip 0.01 it is 0.01. Under fp16's GradScaler (scale 4096) the norm is measured
    and clipped on the unscaled gradients: the same numbers."""
    import data_stream
    stream = data_stream.BertPretrainStream(corpus, tokenizer, max_seq_len=32, batch_size=4, rank=0, world_size=1)
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
            raw_norm = P.train_step(trainer, [batch], masked, 4, 1, clip, 1.0).grad_norm
            applied = sum(float(((p.detach() - b) ** 2).sum()) for p, b in zip(model.parameters(), before,
                                                                                 strict=True)) ** 0.5
            found[loss_scale, clip] = float(raw_norm), applied
    raw, applied = found[None, 0.0]
    assert raw > 0.1 and applied == pytest.approx(raw, rel=1e-4)  # no clipping: the whole gradient
    for key, (raw_norm, applied) in found.items():
        assert raw_norm == pytest.approx(raw, rel=1e-4), key  # reported before clipping, unscaled
        assert applied == pytest.approx(raw if key[1] == 0 else 0.01, rel=1e-4), key


def logged(stdout, name):
    """{step: value} of one scalar in the stdout log."""
    return {int(step): float(v) for step, v in re.findall(rf"^step (\d+): .*?{name} ([^,\s]+)", stdout, re.M)}


def planned_lr(lr, total, warmup, step):
    """The documented schedule, written out independently: step k runs at plan position k - 1."""
    pos = step - 1
    return lr * (pos + 1) / warmup if pos < warmup else lr * (total - pos) / (total - warmup)


def lr_run_args(corpus, tok_dir, out):
    return ["--corpus", corpus, "--tokenizer", tok_dir, "--eval-corpus", "none", "--out-dir", out, *FAST,
            "--max-steps", "12", "--warmup", "0.25", "--lr", "1e-3", "--save-every", "4", "--keep-last", "5",
            "--num-workers", "0"]


@pytest.fixture(scope="module")
def lr_run(tmp_path_factory, corpus, tok_dir):
    """One finished fp32 run of 12 steps (a checkpoint every 4), shared by the tests that resume it:
    each resumes its own copy. Returns (out dir, its stdout)."""
    out = str(tmp_path_factory.mktemp("lr_run") / "run")
    first = run(lr_run_args(corpus, tok_dir, out))
    assert first.returncode == 0, first.stderr[-3000:]
    return out, first.stdout


def copy_of(run_dir, tmp_path):
    out = str(tmp_path / "run")
    shutil.copytree(run_dir, out)
    return out


@pytest.mark.slow
def test_logged_lr_is_the_plan_every_step_and_after_a_resume(tmp_path, corpus, tok_dir, lr_run):
    """12 steps, --warmup 0.25: 3 warmup steps to the peak, linear decay to 0 at step 12; a run
    resumed from step 4 logs the same LR at every step."""
    out = copy_of(lr_run[0], tmp_path)
    args = lr_run_args(corpus, tok_dir, out)
    lrs = logged(lr_run[1], "train/lr")
    expected = {k: planned_lr(1e-3, 12, 3, k) for k in range(1, 13)}
    assert lrs.keys() == expected.keys() and max(lrs.values()) == pytest.approx(1e-3, rel=1e-3)
    assert all(lrs[k] == pytest.approx(expected[k], rel=1e-3, abs=1e-9) for k in expected), (lrs, expected)
    resumed = run([*args, "--resume", os.path.join(out, "checkpoints", "step_000004")])
    assert resumed.returncode == 0 and "resumed from" in resumed.stdout, resumed.stderr[-3000:]
    assert logged(resumed.stdout, "train/lr") == {k: lrs[k] for k in range(5, 13)}


@pytest.mark.slow
def test_fp16_with_grad_scaler_on_cpu_skips_overflows_and_resumes_the_scale(tmp_path, corpus, tok_dir):
    """fp16 autocast + GradScaler on the CPU (tests/_fp16_cpu.py), starting at a loss scale of 1.6e6
    so that the first steps overflow: they are skipped (the weights stay) but count as steps, as
    in the Trainer: knowing a skip on the host would cost a sync per step, so the count lives on the
    device and is read at log steps. The scale falls by halves, it is saved with the checkpoint, and
    a run resumed in the middle of the skips continues with it, step for step."""
    out = str(tmp_path / "run")
    helper = [sys.executable, os.path.join(ROOT, "tests", "_fp16_cpu.py"), "1.6e6"]
    args = ["--corpus", corpus, "--tokenizer", tok_dir, "--eval-corpus", "none", "--out-dir", out, *FAST,
            "--max-steps", "8", "--warmup", "0.5", "--lr", "1e-3", "--save-every", "3", "--num-workers", "0"]
    first = subprocess.run([*helper, *args], capture_output=True, text=True, timeout=480, env=env(), cwd=ROOT)
    assert first.returncode == 0, first.stderr[-3000:]
    s, scales = summary(out), logged(first.stdout, "train/loss_scale")
    skips = s["skipped_steps"]
    assert 3 <= skips < 8 and s["steps"] == 8 and s["samples_seen"] == 8 * 4, s
    assert f"{skips} step(s) skipped for an inf/NaN gradient (fp16 overflows: the loss scale is now" in first.stdout
    # the first step overflowed; each skipped step halved the scale and every other step kept it,
    # so the count read from the device at the end is the number of halvings
    assert sorted(scales) == list(range(1, 9)) and scales[1] == pytest.approx(1.6e6 / 2, rel=1e-3), scales
    assert all(scales[k] / scales[k - 1] in (pytest.approx(1.0), pytest.approx(0.5)) for k in range(2, 9)), scales
    assert 1.6e6 / scales[8] == pytest.approx(2 ** skips, rel=1e-3), (scales, skips)
    lrs = logged(first.stdout, "train/lr")
    assert all(lrs[k] == pytest.approx(planned_lr(1e-3, 8, 4, k), rel=1e-3) for k in lrs), lrs
    trainer = torch.load(os.path.join(out, "checkpoints", "step_000008", "trainer.pt"), weights_only=True)
    assert trainer["scaler"]["scale"] == pytest.approx(scales[8], rel=1e-3)
    again = subprocess.run([*helper, *args, "--resume", os.path.join(out, "checkpoints", "step_000003")],
                           capture_output=True, text=True, timeout=480, env=env(), cwd=ROOT)
    assert again.returncode == 0, again.stderr[-3000:]
    assert 2 ** summary(out)["skipped_steps"] == pytest.approx(scales[3] / scales[8], rel=1e-3)
    for name in ("train/loss_scale", "train/loss", "train/lr"):  # the same steps 4-8 (a skipped one's loss: nan)
        assert str(logged(again.stdout, name)) == str({k: v for k, v in logged(first.stdout, name).items() if k > 3})



@pytest.mark.slow
def test_two_rank_eval_equals_one_rank_eval(tmp_path, corpus, tok_dir):
    """Eval metrics are global: 2 ranks, each holding part of the eval set, report what 1 rank
    reports (--lr 0 keeps the initial weights, which the seed makes equal)."""
    eval_corpus = write_corpus(tmp_path / "eval.txt", 24, seed=5)
    results = []
    for nproc in (1, 2):
        out = str(tmp_path / f"run{nproc}")
        result = run(["--corpus", corpus, "--tokenizer", tok_dir, "--eval-corpus", eval_corpus, "--out-dir", out,
                      *FAST, "--max-steps", "1", "--lr", "0", "--num-workers", "0"], nproc=nproc)
        assert result.returncode == 0, result.stderr[-3000:]
        results.append(summary(out)["eval"])
    one, two = results
    assert one.keys() == {"eval/mlm_loss", "eval/perplexity", "eval/mlm_accuracy", "eval/nsp_loss",
                          "eval/nsp_accuracy"}
    assert all(two[k] == pytest.approx(one[k], rel=1e-4) for k in one), (one, two)


@pytest.mark.slow
def test_resize_resume_keeps_the_lr_plan_across_a_chain(tmp_path, corpus, tok_dir):
    """1 rank for part of an epoch, SIGKILL; resumed on 2 ranks, SIGKILL again; resumed on 2 ranks to
    the end. The plan (in planned steps) continues through every hop: after the warmup the logged LR
    never rises, and the run ends at the plan's end with the LR at ~0. (A position taken from the
    checkpoint's step, not from its planned batches, passes the first hop and fails the second: the
    LR jumps back up and the data ends with the plan unfinished.)"""
    from test_checkpoints import crash_at, run_until
    out = str(tmp_path / "run")
    ckpts = os.path.join(out, "checkpoints")
    args = [SCRIPT, "--corpus", corpus, "--tokenizer", tok_dir, "--eval-corpus", "none", "--out-dir", out,
            "--epochs", "1", "--max-seq-len", "32", "--batch-size", "8", "--num-workers", "0", "--log-every", "1",
            "--log-to", "stdout", "--save-every", "20"]
    two_ranks = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", *args]
    rc, first, _ = run_until([sys.executable, *args], crash_at(r"^step 45:"))
    assert rc != 0 and "step 45:" in first
    rc, second, err = run_until(two_ranks, crash_at(r"^step 64:"))
    assert rc != 0 and "step 64:" in second and f"resumed from {ckpts}/step_000040" in second, err[-3000:]
    assert "a step now counts as 2 planned steps" in err, err[-3000:]
    rc, third, err = run_until(two_ranks)
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


def test_gpu_peaks_pick_the_most_specific_name_and_the_math_used():
    """L40/L40S are not L4, H100 PCIe is not SXM, fp32 and TF32 have their own peaks, unknown is None."""
    bf16, fp16 = torch.bfloat16, torch.float16
    assert M.gpu_peak("NVIDIA L4", bf16, False) == 121e12
    assert M.gpu_peak("NVIDIA L40", bf16, False) == 181e12
    assert M.gpu_peak("NVIDIA L40S", fp16, False) == 362e12
    assert M.gpu_peak("NVIDIA H100 PCIe", bf16, False) == 756e12
    assert M.gpu_peak("NVIDIA H100 80GB HBM3", bf16, False) == 989e12
    assert M.gpu_peak("NVIDIA A10G", bf16, False) == 70e12
    assert M.gpu_peak("NVIDIA A100-SXM4-80GB", bf16, False) == 312e12
    assert M.gpu_peak("NVIDIA A100-SXM4-80GB", None, True) == 156e12  # fp32 run, TF32 matmuls
    assert M.gpu_peak("NVIDIA A100-SXM4-80GB", None, False) == 19.5e12  # fp32 run, full-precision matmuls
    assert M.gpu_peak("Some Future GPU", bf16, False) is None
    # whole words, the longest key first: an H200 NVL has its own figures, a V100 PCIe its own, and
    # an RTX A1000 is no A100, a T400 no T4
    assert M.gpu_peak("NVIDIA H200 NVL", bf16, False) == 835e12
    assert M.gpu_peak("NVIDIA H200", bf16, False) == 989e12
    assert M.gpu_peak("NVIDIA GB200", bf16, False) == 2500e12
    assert M.gpu_peak("Tesla V100-PCIE-16GB", fp16, False) == 112e12
    assert M.gpu_peak("Tesla V100-SXM2-32GB", fp16, False) == 125e12
    assert M.gpu_peak("Tesla T4", fp16, False) == 65e12
    assert M.gpu_peak("NVIDIA RTX A1000", bf16, False) is None
    assert M.gpu_peak("NVIDIA T400 4GB", fp16, False) is None


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


@pytest.mark.slow
def test_a_resume_may_switch_precision(tmp_path, corpus, tok_dir, lr_run):
    """fp32 checkpoint resumed with fp16 + GradScaler (a disabled scaler saved {}: loading it into an
    enabled one used to raise), and that fp16 checkpoint resumed in fp32: both run on, each says so."""
    out = copy_of(lr_run[0], tmp_path)  # fp32, 12 steps, a checkpoint every 4
    helper = [sys.executable, os.path.join(ROOT, "tests", "_fp16_cpu.py"), "1024"]
    args = lr_run_args(corpus, tok_dir, out)
    step = lambda n: ["--resume", os.path.join(out, "checkpoints", f"step_00000{n}")]  # noqa: E731
    # a full plan's LR is 0 at its end, so each resumes mid-way
    fp16 = subprocess.run([*helper, *args, *step(4)], capture_output=True, text=True,
                          timeout=480, env=env(), cwd=ROOT)
    assert fp16.returncode == 0, fp16.stderr[-3000:]
    assert "resumed from" in fp16.stdout and "a fresh GradScaler starts" in fp16.stderr
    assert logged(fp16.stdout, "train/loss_scale")  # fp16 really ran
    back = run([*args, *step(8)])  # the fp16 run's checkpoint
    assert back.returncode == 0 and "resumed from" in back.stdout, back.stderr[-3000:]
    assert summary(out)["steps"] == 12


def pair_keys(batch):
    """(pair, position in the pair) of each masked position of a batch from sparse_targets (whose
    positions count the real tokens: real_pos says where they are in the rows)."""
    pos, cls_pos = batch["masked_pos"], batch["cls_pos"]
    if "real_pos" in batch:
        pos, cls_pos = batch["real_pos"][pos], batch["real_pos"][cls_pos]
    if "sequence_ids" in batch:
        pair = batch["sequence_ids"].flatten()[pos]
    else:
        pair = pos // batch["input_ids"].shape[1]
    return list(zip(pair.tolist(), (pos - cls_pos[pair]).tolist(), strict=True))


@pytest.mark.parametrize("whole_word", [False, True])
def test_packed_pairs_give_each_pair_the_logits_of_its_own_row(corpus, tokenizer, whole_word):
    """Issue 37: pairs packed several to a row (block-diagonal attention, positions from 0 per pair, NSP
    from each pair's [CLS]) give, per pair, in eval mode and fp32, the MLM logits at its masked positions
    and the NSP logits of the same pairs each in a padded row of its own, within 1e-4; the masks and
    targets are the same too. And packing fills rows: fewer rows than pairs, less padding."""
    import data_stream
    torch.manual_seed(0)
    model = M.Pretraining(M.model_from(M.new_architecture("tiny", len(tokenizer), 128, tokenizer.pad_token_id),
                                       "nsp", 0.1)).eval()
    streams = [data_stream.BertPretrainStream(corpus, tokenizer, max_seq_len=96, batch_size=12, rank=0, world_size=1,
                                              whole_word_mask=whole_word, pack_pairs=pack, seed=3, short_seq_prob=0.6)
               for pack in (False, True)]
    rows = []
    with torch.no_grad():
        for plain, packed in itertools.islice(zip(*streams, strict=True), 6):
            outs = []
            for raw in (plain, packed):
                batch, counts = M.prepare(M.sparse_targets(raw), torch.device("cpu"))
                logits, nsp = model.logits(**{k: v for k, v in batch.items()
                                              if k not in ("masked_targets", "next_sentence_label")})
                order = sorted(range(len(logits)), key=pair_keys(batch).__getitem__)
                outs.append((sorted(pair_keys(batch)), logits[order], batch["masked_targets"][order], nsp,
                             batch["next_sentence_label"], counts))
                rows.append(len(batch["input_ids"]))
            (keys, logits, targets, nsp, labels, counts), (pkeys, plogits, ptargets, pnsp, plabels, pcounts) = outs
            assert keys == pkeys and torch.equal(targets, ptargets) and torch.equal(labels, plabels)
            assert torch.allclose(logits, plogits, atol=1e-4) and torch.allclose(nsp, pnsp, atol=1e-4)
            assert (counts["num_samples"], counts["num_tokens"], counts["num_attended"]) == \
                   (pcounts["num_samples"], pcounts["num_tokens"], pcounts["num_attended"])
            assert pcounts["num_computed"] <= counts["num_computed"]
    assert sum(rows[1::2]) < 0.8 * sum(rows[0::2])  # fewer rows


def test_no_host_read_and_the_stock_model_s_math():
    """prepare() passes no mask for an unpadded batch and a 4-D boolean one for a padded batch (the
    linear layers see its real tokens only, the last layer's feed-forward only what the heads read):
    a forward + backward then reads nothing back from the device, and its loss sums are those of
    Hugging Face's own BertForPreTraining forward with the 2-D mask (which reads the mask back)."""
    import torch.nn.functional as F
    torch.manual_seed(0)
    model = M.Pretraining(M.model_from(M.new_architecture("tiny", 300, 32, 0), "nsp", 0.0))
    ids = torch.randint(5, 300, (4, 16))
    reads, originals = [0], {name: getattr(torch.Tensor, name) for name in ("__bool__", "item", "tolist")}

    def spy(name):
        def read(self, *a, **k):
            reads[0] += 1
            return originals[name](self, *a, **k)
        return read

    def forward_backward(forward):
        for name in originals:
            setattr(torch.Tensor, name, spy(name))
        reads[0] = 0
        try:
            out = forward()
            out.sum().backward()
        finally:
            for name, f in originals.items():
                setattr(torch.Tensor, name, f)
        return out.detach(), reads[0]

    def stock(raw):  # the Hugging Face model's own forward, its losses summed as ours
        out = model.hf(input_ids=raw["input_ids"], token_type_ids=raw["token_type_ids"],
                       attention_mask=raw["attention_mask"])
        chosen = raw["labels"] != -100
        logits, nsp = out.prediction_logits[chosen], out.seq_relationship_logits
        return torch.stack([F.cross_entropy(logits, raw["labels"][chosen], reduction="sum"),
                            (logits.argmax(-1) == raw["labels"][chosen]).sum().float(),
                            F.cross_entropy(nsp, raw["next_sentence_label"], reduction="sum"),
                            (nsp.argmax(-1) == raw["next_sentence_label"]).sum().float()])

    for padded in (False, True):
        mask = torch.ones(4, 16, dtype=torch.long)
        if padded:
            mask[1, 10:], mask[3, 5:] = 0, 0
        labels = torch.full((4, 16), -100)
        labels[0, 1], labels[1, 4], labels[2, 2], labels[3, 3] = 7, 8, 9, 10
        raw = {"input_ids": ids * mask, "token_type_ids": (torch.arange(16) > 7).long().expand(4, -1),
               "attention_mask": mask, "labels": labels, "next_sentence_label": torch.tensor([0, 1, 0, 1])}
        batch, counts = M.prepare(M.sparse_targets(dict(raw)), torch.device("cpu"))
        assert counts["num_tokens"] == int(mask.sum()) and ("attention_mask" in batch) == padded
        out, n_reads = forward_backward(lambda batch=batch: model(**batch))
        assert n_reads == 0, (padded, n_reads)
        reference, stock_reads = forward_backward(lambda raw=raw: stock(raw))
        assert stock_reads >= 1 and torch.allclose(out, reference, atol=1e-5), (out, reference)
    # packed pairs: the block-diagonal mask is built on the device from sequence_ids
    sequence = torch.tensor([[0] * 6 + [1] * 10, [2] * 9 + [-1] * 7, [3] * 16, [4] * 4 + [5] * 12])
    raw = {"input_ids": ids, "token_type_ids": torch.zeros_like(ids), "attention_mask": (sequence >= 0).long(),
           "labels": labels, "position_ids": torch.zeros_like(ids), "sequence_ids": sequence,
           "next_sentence_label": torch.tensor([0, 1, 0, 1, 1, 0]), "cls_pos": torch.tensor([0, 6, 16, 32, 48, 52])}
    batch, counts = M.prepare(M.sparse_targets(raw), torch.device("cpu"))
    assert "attention_mask" not in batch and counts["num_attended"] == 36 + 100 + 81 + 256 + 16 + 144
    assert forward_backward(lambda: model(**batch))[1] == 0


@pytest.mark.slow  # dynamo compiles: seconds of work
def test_compile_does_not_recompile_as_batch_shapes_vary(corpus, tokenizer):
    """--compile: rows (the last batches of an epoch), masked-token counts and a mask or none vary;
    with the varying sizes marked dynamic dynamo compiles once per mask kind, never per size. Also
    the edge batches dynamo specialises: one row, and 0 or 1 masked tokens. Packed pairs: one graph."""
    from torch._dynamo.testing import CompileCounter

    import data_stream
    torch._dynamo.reset()
    counter = CompileCounter()  # a backend that counts the graphs dynamo hands it, and runs them eagerly
    model = M.Pretraining(M.model_from(M.new_architecture("tiny", len(tokenizer), 64, tokenizer.pad_token_id),
                                       "nsp", 0.0))
    compiled = torch.compile(model, backend=counter)
    kinds = []
    raws = []
    for batch_size in (8, 5, 8, 3, 7, 2, 1):
        stream = data_stream.BertPretrainStream(corpus, tokenizer, max_seq_len=64, batch_size=batch_size, rank=0,
                                                world_size=1)
        raws += list(itertools.islice(stream, 2))
    for keep in (0, 1):  # batches with no masked token, and with one
        raw = {k: v.clone() if torch.is_tensor(v) else v for k, v in raws[0].items()}
        masked_at = (raw["labels"] != -100).nonzero()
        raw["labels"].fill_(-100)
        for row, col in masked_at[:keep].tolist():
            raw["labels"][row, col] = raws[0]["labels"][row, col]
        raws.append(raw)
    for raw in raws:
        batch, counts = M.prepare(M.sparse_targets(raw), torch.device("cpu"), dynamic=True)
        compiled(**batch)[0].backward()
        kinds.append((counts["num_samples"], counts["num_masked"], "attention_mask" in batch))
    assert len(set(kinds)) >= 11 and {mask for *_, mask in kinds} == {True, False}
    assert {1} <= {rows for rows, *_ in kinds} and {0, 1} <= {masked for _, masked, _ in kinds}, kinds
    assert counter.frame_count == 2  # without the marks: 3 here (dynamo's automatic dynamic after a recompile)
    # packed pairs: rows, width and pairs vary (a lone pair in one row too); every batch has sequence_ids
    torch._dynamo.reset()
    counter = CompileCounter()
    compiled = torch.compile(model, backend=counter)
    shapes = set()
    for batch_size in (8, 5, 1, 3, 16):
        stream = data_stream.BertPretrainStream(corpus, tokenizer, max_seq_len=64, batch_size=batch_size, rank=0,
                                                world_size=1, pack_pairs=True, short_seq_prob=0.5)
        for raw in itertools.islice(stream, 2):
            batch, counts = M.prepare(M.sparse_targets(raw), torch.device("cpu"), dynamic=True)
            compiled(**batch)[0].backward()
            shapes.add((tuple(raw["input_ids"].shape), counts["num_samples"]))
    assert len({rows for (rows, _), _ in shapes}) >= 4 and {1} <= {n for _, n in shapes}, shapes
    assert counter.frame_count == 1

