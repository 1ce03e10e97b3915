"""Faults long runs meet (issue 39): a full disk, a second job in the same out dir, a loss that turns NaN.
Every process is bounded by a timeout; the disk is a small tmpfs in a mount namespace of the test's own."""
import json
import os
import re
import signal
import subprocess
import threading
import time

import pytest
import torch
from conftest import (
    ROOT,
    TESTS,
    Launch,
    common,
    crash_at,
    env,
    final_weights,
    kill_all,
    plain,
    run,
    run_main,
    same_weights,
    summary,
    torchrun,
    wait_for,
)

import checkpoints

INJECT = os.path.join(TESTS, "_inject.py")
ONE_LINE = re.compile(r"^pretrain_ddp.py: error: ", re.M)


def folder_bytes(path):
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def errors_of(err):
    """The error lines of a run's stderr, which must hold no traceback of ours (torchrun prints its own
    on a failed child), nor multiprocessing's warning of semaphores left behind (a DataLoader's queues)."""
    assert not re.search(r'File "[^"]*(pretrain_ddp|data_stream|estimate_steps)\.py"', err), err[-3000:]
    assert "resource_tracker" not in err, err[-3000:]
    return [line for line in err.splitlines() if ONE_LINE.match(line)]


# 2 ranks with a DataLoader worker each, 14 steps, a checkpoint every 4: the full disk's 2-rank case and the
# SIGKILLed torchrun resume into the state of two_ranks_reference
TWO_RANKS = ["--num-workers", "1", "--save-every", "4", "--max-steps", "14"]


# 1 rank, 8 steps, a checkpoint every 4: the full disk's 1-rank case resumes into the state of one_rank_reference
ONE_RANK = ["--max-steps", "8", "--save-every", "4"]


@pytest.fixture(scope="module")
def one_rank_reference(tmp_path_factory, corpus, tok_dir):
    """ONE_RANK never interrupted, started as `python pretrain_ddp.py ... &` by a shell that ends at once (as a
    closed terminal or nohup leaves it). Returns (its out dir, its log)."""
    root = tmp_path_factory.mktemp("one_rank")
    out, log = str(root / "ref"), root / "log"
    command = " ".join(plain(*common(corpus, tok_dir, out), *ONE_RANK))
    shell = subprocess.run(["sh", "-c", f"{command} > {log} 2>&1 & echo $!"], capture_output=True, text=True,
                           env=env(), cwd=ROOT, timeout=60)
    pid = int(shell.stdout)
    deadline = time.time() + 240
    while os.path.exists(f"/proc/{pid}") and time.time() < deadline:
        time.sleep(0.5)
    if os.path.exists(f"/proc/{pid}"):
        os.kill(pid, signal.SIGKILL)
    return out, log


@pytest.fixture(scope="module")
def two_ranks_reference(tmp_path_factory, corpus, tok_dir):
    """The out dir of TWO_RANKS never interrupted, without DataLoader workers: a rank reads the same shards with
    none as with one (the runs compared with it have one), and two forkservers fewer cost the suite ~5 s."""
    out = str(tmp_path_factory.mktemp("two_ranks") / "ref")
    rc, _, err = run(torchrun(2, *common(corpus, tok_dir, out), *TWO_RANKS, "--num-workers", "0"))
    assert rc == 0, err[-3000:]
    return out


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [1, 2])
def test_a_full_disk_stops_in_one_line_and_loses_nothing(tmp_path, request, corpus, tok_dir, nproc):
    """The out dir on a tmpfs that holds the first checkpoint, not the second: one line naming the
    checkpoint, the file system, its free and the needed space and the checkpoint kept; every rank
    stops (code 2); no half-written folder. Then room for the checkpoints but not the Hugging Face
    export (1 rank): the final checkpoint is saved, the export is one line. With room, the same
    command resumes and ends bitwise equal to a run that never lacked it."""
    if nproc == 2:  # 2 ranks with a DataLoader worker each: their queues' semaphores are freed on the error path too
        args, ref = TWO_RANKS, request.getfixturevalue("two_ranks_reference")
    else:
        args, ref = ONE_RANK, request.getfixturevalue("one_rank_reference")[0]
    with open(os.path.join(ref, "checkpoints", "latest")) as f:  # every checkpoint of the run is the size of this
        ckpt = folder_bytes(os.path.join(ref, "checkpoints", f.read()))
    base = folder_bytes(os.path.join(ref, "tokenizer")) + 200_000
    sizes = [base + int(1.5 * ckpt), base + int(2.3 * ckpt)] if nproc == 1 else [base + int(1.5 * ckpt)]
    mount, logs = str(tmp_path / "disk"), tmp_path / "logs"
    os.makedirs(mount)
    os.makedirs(logs)
    cmd = common(corpus, tok_dir, os.path.join(mount, "run"), *args)
    cmd = " ".join(torchrun(2, *cmd) if nproc == 2 else plain(*cmd))
    script = [f"mount -t tmpfs -o size={sizes[0]} tmpfs {mount}"]
    for k, size in enumerate([*sizes[1:], 200_000_000]):  # each run on the disk it got, then a bigger one
        script += [f"{cmd} > {logs}/{k}.out 2> {logs}/{k}.err; echo $? > {logs}/{k}.rc",
                   f"ls -a {mount}/run {mount}/run/checkpoints > {logs}/{k}.ls",
                   f"mount -o remount,size={size} {mount}"]
    script += [f"{cmd} > {logs}/{len(sizes)}.out 2> {logs}/{len(sizes)}.err; echo $? > {logs}/{len(sizes)}.rc",
               f"cp -r {mount}/run {tmp_path}/run"]
    done = run(["unshare", "-rm", "sh", "-c", "; ".join(script)], timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]

    def log(k, kind):
        return (logs / f"{k}.{kind}").read_text()
    assert log(0, "rc").strip() == ("2" if nproc == 1 else "1"), log(0, "err")[-3000:]  # torchrun's: 1
    [line] = errors_of(log(0, "err"))  # said once, by rank 0
    assert re.search(rf"cannot write checkpoint step_000008 into {mount}/run/checkpoints: No space left on device "
                     rf"on the file system at {mount} \([\d,]+ MB free, about [\d,]+ MB needed\); "
                     rf"{mount}/run/checkpoints/step_000004 is the newest complete checkpoint: free space", line), line
    assert ".tmp-step_000008" not in log(0, "ls") and "step_000008" not in log(0, "ls")
    if nproc == 2:
        for k in range(2):  # every rank stopped by itself, with code 2 (torchrun's report)
            assert re.search(rf"rank\s*: {k} \(local_rank: {k}\)\s*exitcode\s*: 2 ", log(0, "err")), log(0, "err")
    else:
        assert log(1, "rc").strip() == "2", log(1, "err")[-3000:]
        [line] = errors_of(log(1, "err"))
        assert "resumed from" in log(1, "out") and "saved" in log(1, "out")
        assert re.search(rf"cannot write the Hugging Face export {mount}/run/hf: No space left on device .*the "
                         "checkpoint holds the weights", line), line
        assert ".tmp-hf" not in log(1, "ls") and "hf" not in log(1, "ls").split()
    last = len(sizes)
    assert log(last, "rc").strip() == "0", log(last, "err")[-3000:]
    assert same_weights(final_weights(ref), final_weights(str(tmp_path / "run")))
    assert os.path.isfile(os.path.join(tmp_path, "run", "hf", "config.json"))


@pytest.mark.slow
def test_a_second_job_in_a_busy_out_dir_stops_before_it_trains(tmp_path, corpus, tok_dir):
    """Rank 0 holds a lock on the out dir: a second job into it stops within seconds, in one line
    naming the out dir and the holder; once the first is SIGKILLed (the kernel drops its lock), a
    job starts normally and resumes what it left."""
    out = str(tmp_path / "run")
    saved = threading.Event()
    first = Launch(plain(*common(corpus, tok_dir, out), "--max-steps", "100000", "--save-every", "3"),
                   lambda line, proc: line.startswith("saved") and saved.set())
    try:
        assert saved.wait(300), "no checkpoint within 300 s"  # training, and a checkpoint to resume
        t0 = time.time()
        rc, stdout, err = run(torchrun(2, *common(corpus, tok_dir, out), "--max-steps", "5"), timeout=120)
        took = time.time() - t0
        assert rc == 1 and "step 1:" not in stdout, stdout + err  # torchrun's code for a failed rank
        [line] = errors_of(err)
        assert re.search(rf"--out-dir {out} is in use by another job \(held by host \S+, pid \d+, since [\d-]+ "
                         r"[\d:]+\): let it finish or stop it, or give another --out-dir", line), line
        assert took < 60, took
    finally:
        kill_all(first.proc, first.proc.args)
    wait_for([first])  # and every process of the first job is gone within 30 s
    assert "resumed from" in run_main(*common(corpus, tok_dir, out), "--max-steps", "5").stdout


@pytest.mark.slow
def test_nan_gradients_are_skipped_by_every_rank_and_repeated_ones_roll_back(tmp_path, corpus, tok_dir):
    """A NaN loss on rank 1 alone at step 3 makes every rank's all-reduced gradient NaN: every rank skips
    that step (the weights stay finite, the step still counts). NaN at steps 9-12: after 3 in a row the
    ranks roll back together to the checkpoint of step 8 (at step 11, a log step) and go on with the data
    after it; the run finishes finite. The report counts 5 skipped steps and 1 rollback."""
    out = str(tmp_path / "run")
    rc, stdout, err = run(torchrun(2, *common(corpus, tok_dir, out), "--max-steps", "16", "--save-every", "4",
                                   "--rollback-after", "3", script=INJECT), env={"INJECT": "nan_grad=1:3,9,10,11,12"})
    assert rc == 0, err[-3000:]
    assert re.search(rf"^3 steps in a row up to step 11 had a non-finite loss \(skipped\): rolled the weights and "
                     rf"optimizer back to {out}/checkpoints/step_000008; the data goes on after step 11 \(the "
                     r"batches since step 8 are not replayed\)$", stdout, re.M), stdout[-3000:]
    s = summary(out)
    assert s["steps"] == 16 and s["skipped_steps"] == 5 and s["rollbacks"] == 1
    assert all(torch.isfinite(t).all() for t in final_weights(out).values())
    losses = [float(v) for v in re.findall(r"train/loss ([^,]+),", stdout)]
    assert len(losses) == 16 and sum(x != x for x in losses) == 5  # the skipped steps' own loss


@pytest.mark.slow
def test_what_a_rollback_cannot_mend_stops_the_run_and_non_finite_weights_are_never_saved(tmp_path, corpus, tok_dir):
    """NaN from step 2 on with no checkpoint yet (none is saved of weights that give a NaN loss): one line, a
    non-zero exit. Weights made NaN after step
    5: the save at step 6 is refused in one line (a NaN checkpoint would rotate the good ones out) and
    the newest checkpoint stays the one of step 3."""
    cases = {"nan_grad=0:" + ",".join(map(str, range(2, 30))): (["--rollback-after", "3", "--max-steps", "20"],
                                                               r"steps in a row up to step \d+ had a non-finite loss "
                                                               r"\(skipped\), and there is no checkpoint to roll back "
                                                               r"to: lower --lr"),
             "nan_weights=5": (["--max-steps", "12", "--save-every", "3"],
                               r"the weights at step 6 are not finite: not saved; \S+/checkpoints/step_000003 is the "
                               r"newest complete checkpoint")}
    for k, (inject, (flags, expected)) in enumerate(cases.items()):
        out = str(tmp_path / f"run{k}")
        rc, _, err = run(plain(*common(corpus, tok_dir, out), *flags, script=INJECT), env={"INJECT": inject})
        assert rc == 2, err[-3000:]
        [line] = errors_of(err)
        assert re.search(expected, line), line
    assert open(os.path.join(tmp_path, "run1", "checkpoints", "latest")).read() == "step_000003"
    assert sorted(os.listdir(os.path.join(tmp_path, "run1", "checkpoints"))) == ["latest", "step_000003"]


def loss_on_a_batch(checkpoint, tok_dir):
    """The MLM + NSP loss of a checkpoint's weights on one sentence pair."""
    from transformers import BertConfig, BertForPreTraining

    import data_stream
    meta = json.load(open(os.path.join(checkpoint, "manifest.json")))["meta"]
    model = BertForPreTraining(BertConfig(**meta["config"]["architecture"])).eval()
    model.load_state_dict(torch.load(os.path.join(checkpoint, "trainer.pt"), weights_only=True)["model"])
    batch = data_stream.get_tokenizer(tok_dir)("the river and the stone", "a garden in winter", return_tensors="pt")
    with torch.no_grad():
        return float(model(**batch, labels=batch["input_ids"], next_sentence_label=torch.tensor([0])).loss)


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [1, 2])
def test_a_loss_that_stays_nan_stops_the_run_and_no_checkpoint_left_gives_it(tmp_path, corpus, tok_dir, nproc):
    """Four good steps, then the run resumed with --lr 1e6: step 5 is applied and leaves finite weights that
    give a NaN loss from step 6 on. Those steps are skipped and no checkpoint of them is saved; the rollback
    to step 5's (saved before its loss was seen) is followed by NaN again, so the run stops in one line
    naming the checkpoint tried, non-zero, within 3 x --rollback-after steps of the first skipped step. That
    checkpoint is moved aside, `latest` names step 4's, no hf/ is written; every checkpoint left gives a
    finite loss on a batch."""
    out = str(tmp_path / "run")
    args = common(corpus, tok_dir, out, "--num-workers", "1", "--save-every", "1", "--rollback-after", "3",
                  "--max-steps", "40")
    rc, _, _ = run(torchrun(2, *args) if nproc == 2 else plain(*args), crash_at(r"^saved .*step_000004"))
    assert rc != 0
    rc, stdout, err = run(torchrun(2, *args, "--lr", "1e6") if nproc == 2 else plain(*args, "--lr", "1e6"))
    assert rc == (2 if nproc == 1 else 1), err[-3000:]  # torchrun's code for a failed rank: 1
    [line] = errors_of(err)
    ckpts = os.path.join(out, "checkpoints")
    found = re.search(rf"error: (?:rank 0 on \S+: )?(\d+) steps in a row up to step (\d+) had a non-finite loss "
                      rf"\(skipped\), and a rollback to {ckpts}/step_000005 did not help \(the steps after it were "
                      rf"skipped again\); it is moved to {ckpts}/abandoned/step_000005; a re-run resumes "
                      rf"{ckpts}/step_000004: lower --lr", line)
    assert found, line
    grad_norms = [float(v) for v in re.findall(r"train/grad_norm ([^,]+),", stdout)]
    first_skipped = 4 + next(k for k, v in enumerate(grad_norms, 1) if v != v)  # the log starts at step 5
    assert first_skipped == 6 and int(found[2]) - first_skipped < 3 * 3, (first_skipped, line)
    assert "not saved at step 6: the weights gave a non-finite loss in the last step" in stdout
    assert not os.path.exists(os.path.join(out, "hf"))
    assert open(os.path.join(ckpts, "latest")).read() == "step_000004"
    left = sorted(checkpoints.step_folders(ckpts).values())
    assert left == ["step_000003", "step_000004"], left  # --keep-last 3 rotated step 2 out at step 5
    assert all(loss_on_a_batch(os.path.join(ckpts, d), tok_dir) < 20 for d in left)  # finite, and trained
    damaged = loss_on_a_batch(os.path.join(ckpts, "abandoned", "step_000005"), tok_dir)
    assert not damaged < 1e3, damaged  # step 5's weights (NaN on the training batches)


@pytest.mark.slow
def test_a_sigkilled_torchrun_leaves_no_rank_behind_and_the_rerun_resumes_bitwise(tmp_path, corpus, tok_dir,
                                                                                  two_ranks_reference):
    """SIGKILL to torchrun's process group only (its ranks run in sessions of their own): the kernel sends
    every rank SIGTERM as its agent dies, so they stop together at the next step and save; every process
    of the job is gone within 30 s (run fails otherwise). The same command then resumes and ends
    bitwise equal to a run never interrupted."""
    out = str(tmp_path / "run")
    cmd = torchrun(2, *common(corpus, tok_dir, out), *TWO_RANKS, "--save-every", "1000")

    def kill_the_agent_at_step_5(line, proc):
        if line.startswith("step 5:"):
            os.killpg(proc.pid, signal.SIGKILL)  # torchrun's own session (run): not the ranks'
        return False
    rc, stdout, err = run(cmd, kill_the_agent_at_step_5)
    assert rc == -signal.SIGKILL, err[-3000:]
    stopped_at = int(re.search(r"stopped by signal at step (\d+) on every rank", stdout)[1])
    saved = f"{out}/checkpoints/{checkpoints.step_name(stopped_at)}"
    assert 5 <= stopped_at < 14 and f"saved {saved}" in stdout, stdout[-3000:]
    rc, stdout, err = run(cmd)
    assert rc == 0 and f"resumed from {out}/checkpoints/{checkpoints.step_name(stopped_at)}" in stdout, err[-3000:]
    assert same_weights(final_weights(two_ranks_reference), final_weights(out))


@pytest.mark.slow
def test_a_plain_run_outlives_the_shell_that_started_it(one_rank_reference):
    """Without torchrun there is no agent to die with: `python pretrain_ddp.py ... &` from a shell that then
    ends (a closed terminal, nohup) trains on to its end."""
    out, log = one_rank_reference
    assert summary(out)["steps"] == 8, log.read_text()[-3000:]
