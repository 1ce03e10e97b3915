"""Checkpoints: atomic saves, exact resume after SIGKILL, damaged checkpoints, torchrun restarts,
safe loading, Hugging Face export. Every process is bounded by a timeout."""
import glob
import hashlib
import io
import json
import os
import pickle
import re
import shutil
import signal
import struct
import zipfile

import pytest
import torch
from conftest import (
    ROOT,
    common,
    copy_of,
    crash_at,
    final_weights,
    make_stream,
    plain,
    processes_of,
    release_out_dir_locks,
    run,
    run_main,
    same_weights,
    summary,
    torchrun,
    write_corpus,
)

import checkpoints
import estimate_steps
import model as M
import pretrain_ddp as P
from estimate_steps import lr_factor

CLEAN = ["--num-workers", "0", "--save-every", "2", "--keep-last", "10", "--max-steps", "12"]


@pytest.fixture(scope="module")
def clean_run(tmp_path_factory, corpus, tok_dir):
    """One finished 1-rank run (12 steps, a checkpoint every 2, all kept), shared: a test that resumes,
    damages or rolls it back works on its own copy (copy_of), the HF export test only reads it."""
    out = str(tmp_path_factory.mktemp("clean") / "run")
    run_main(*common(corpus, tok_dir, out), *CLEAN)
    return out


@pytest.mark.slow
def test_sigkill_anywhere_then_resume_is_bitwise_exact(tmp_path, tok_dir):
    """2 ranks with 2 DataLoader workers each, SIGKILL between two saves after the epoch boundary
    (reshuffle, new loaders); the newest checkpoint damaged and a half-written one left behind: the
    resume takes the one before (mid-epoch 0, before the boundary), and the run ends bitwise equal to
    an uninterrupted one. (A kill before the boundary, with its resume, used to run first: the final
    resume from mid-epoch 0 covers it, and the launch cost ~15 s of the suite.)"""
    # 40 documents: 9-12 steps per epoch (the test's 120 would take ~33, and this test 2.5x longer)
    corpus = write_corpus(tmp_path / "corpus.txt", 40)
    args = ["--num-workers", "2", "--batch-size", "8", "--accum-steps", "2", "--epochs", "2", "--save-every", "4",
            "--max-steps", "16"]
    ref = str(tmp_path / "ref")
    rc, out, err = run(torchrun(2, *common(corpus, tok_dir, ref), *args))
    assert rc == 0, err[-3000:]
    assert re.search(r"epoch 0 ended at step (9|10|11|12)\b", out), out[-3000:]  # before the save at 12
    killed = str(tmp_path / "killed")
    cmd = torchrun(2, *common(corpus, tok_dir, killed), *args)
    rc, out, _ = run(cmd, crash_at(r"^step 1[3-5]:"))  # after the epoch boundary and the save at 12
    assert rc != 0 and re.search(r"^step 1[3-5]:", out, re.M) and "epoch 0 ended at step" in out
    # Damage the newest checkpoint and leave a half-written one behind, as a kill during a save would.
    ckpts = sorted(glob.glob(os.path.join(killed, "checkpoints", "step_*")))
    with open(os.path.join(ckpts[-1], "trainer.pt"), "r+b") as f:
        f.seek(200)
        f.write(b"\x00garbage\x00")
    os.makedirs(os.path.join(killed, "checkpoints", ".tmp-step_000099"))
    with open(os.path.join(killed, "checkpoints", ".tmp-step_000099", "trainer.pt"), "wb") as f:
        f.write(b"half a file")
    rc, out, err = run(cmd)
    assert rc == 0, err[-3000:]
    assert "is damaged (trainer.pt does not match its checksum)" in err
    assert f"resumed from {ckpts[-2]}" in out  # the previous complete one
    assert same_weights(final_weights(ref), final_weights(killed))
    assert summary(killed)["steps"] == summary(ref)["steps"] == 16
    assert summary(killed)["samples_seen"] == summary(ref)["samples_seen"]


def damage_tensor_bytes(path):
    """Overwrite 16 bytes in the middle of a largest tensor's storage in a torch.save file (the first
    one saved: a weight, not its optimizer state): torch.load does not check the zip's CRCs, so only
    the checkpoint's own checksum can see it."""
    with zipfile.ZipFile(path) as z:
        info = max((i for i in z.infolist() if "/data/" in i.filename),
                   key=lambda i: (i.file_size, -int(i.filename.rsplit("/", 1)[1])))
    with open(path, "r+b") as f:
        f.seek(info.header_offset)
        name_length, extra_length = struct.unpack("<HH", f.read(30)[26:30])  # the local header
        f.seek(info.header_offset + 30 + name_length + extra_length + info.file_size // 8 * 4)
        f.write(struct.pack("<4f", 1234.5, -1234.5, 1234.5, -1234.5))


@pytest.mark.slow
def test_damage_only_the_checksum_sees_is_refused(tmp_path, corpus, tok_dir, clean_run):
    """Bytes overwritten inside a weight tensor of trainer.pt load without complaint (wrong weights,
    silently); the checksum refuses them: --resume PATH is one error line, --resume auto warns and
    resumes the checkpoint before."""
    out = copy_of(clean_run, tmp_path)
    ckpts = os.path.join(out, "checkpoints")
    base = plain(*common(corpus, tok_dir, out), *CLEAN)
    trainer = os.path.join(ckpts, "step_000012", "trainer.pt")
    before = torch.load(trainer, weights_only=True)["model"]
    damage_tensor_bytes(trainer)
    after = torch.load(trainer, weights_only=True)["model"]  # loads: only the values differ
    assert any(not torch.equal(before[k], after[k]) for k in before)  # wrong weights, and not a word about it
    rc, _, err = run([*base, "--resume", os.path.join(ckpts, "step_000012")])
    assert rc == 2 and err.strip().splitlines() == [
        f"pretrain_ddp.py: error: --resume {ckpts}/step_000012 cannot be used: trainer.pt does not match its "
        "checksum"], err[-3000:]
    _, stdout, err = run_main(*base[2:])
    assert f"resumed from {ckpts}/step_000010 at step 10" in stdout, stdout[-2000:] + err[-3000:]
    assert f"warning: checkpoint {ckpts}/step_000012 is damaged (trainer.pt does not match its checksum)" in err


@pytest.mark.slow
def test_keep_last_keeps_the_newest_a_rerun_resumes_and_changed_settings_are_refused(tmp_path, corpus, tok_dir,
                                                                                     clean_run):
    out = copy_of(clean_run, tmp_path)  # finished at step 12, a checkpoint every 2 steps, all kept
    base = plain(*common(corpus, tok_dir, out), *CLEAN, "--keep-last", "2")
    # Starting the finished run again: resumes at its end, saves the same step again, fine; 2 are kept.
    _, stdout, err = run_main(*base[2:])
    assert "resumed from" in stdout, err[-3000:]
    names = sorted(os.listdir(os.path.join(out, "checkpoints")))
    assert names == ["latest", "step_000010", "step_000012"]
    assert open(os.path.join(out, "checkpoints", "latest")).read() == "step_000012"
    # Refusals, found where rank 0 plans the run (plan_run: one of USER_ERRORS, which __main__ turns into one
    # line and exit code 2, as test_damage_only_the_checksum_sees_is_refused sees end to end).
    for extra, messages in ((["--max-seq-len", "64"], ["max_seq_len (checkpoint 32, now 64)"]),
                            (["--resume", "none"], ["holds checkpoints"]),
                            # the finished run's LR is 0: more steps would not train; the error says what to do
                            (["--max-steps", "14"], ["its LR had decayed to 0", f"--init-from {out}"])):
        with pytest.raises(P.USER_ERRORS) as error:
            P.plan_run(P.parse_args([*base[2:], *extra]), torch.device("cpu"), None, P.Rank0Only())
        assert all(m in str(error.value) for m in messages) and "\n" not in str(error.value), (extra, error.value)
        release_out_dir_locks()  # this process planned in the out dir: the runs below take its lock again
    # (A resume on another world size, with its warning: test_resize_resume_keeps_the_lr_plan_across_a_chain.)
    run_main(*base[2:], "--resume", "none", "--overwrite", "--max-steps", "3")
    assert summary(out)["steps"] == 3
    assert sorted(os.listdir(os.path.join(out, "checkpoints"))) == ["latest", "step_000002", "step_000003"]


class Exploit:
    def __reduce__(self):
        return (os.system, (f"touch {os.environ['PWNED_PATH']}",))


def test_loading_never_executes_pickled_code(tmp_path, monkeypatch):
    pwned = tmp_path / "pwned"
    monkeypatch.setenv("PWNED_PATH", str(pwned))
    ckpt = tmp_path / "step_000001"
    ckpt.mkdir()
    for name in ("trainer.pt", "ranks.pt"):
        (ckpt / name).write_bytes(pickle.dumps({"model": Exploit()}))
    digests = {n: hashlib.sha256((ckpt / n).read_bytes()).hexdigest() for n in ("trainer.pt", "ranks.pt")}
    (ckpt / "manifest.json").write_text(json.dumps({"meta": {}, "sha256": digests}))
    loaded, problem = checkpoints.read_checkpoint(str(ckpt))
    assert loaded is None and problem and not pwned.exists()
    for path in glob.glob(os.path.join(ROOT, "*.py")):  # and no other load path exists
        for line in open(path):
            if "torch.load(" in line:
                assert "weights_only=True" in line, (path, line)


@pytest.mark.slow
def test_torchrun_max_restarts_resumes_after_a_killed_rank_and_finishes(tmp_path, corpus, tok_dir):
    out = str(tmp_path / "run")
    cmd = torchrun(2, *common(corpus, tok_dir, out), "--save-every", "3", "--max-steps", "14",
                   agent=("--max-restarts", "2"))
    killed = []

    def kill_rank1(line, proc):
        if not killed and line.startswith("step 7:"):
            for pid in processes_of(out):  # one worker dies: rank 1 of this run
                try:
                    environ = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
                except OSError:
                    continue
                if b"RANK=1" in environ:
                    os.kill(pid, signal.SIGKILL)
                    killed.append(pid)
        return False

    rc, stdout, err = run(cmd, kill_rank1, timeout=300)
    assert killed and rc == 0, err[-3000:]
    assert "resumed from" in stdout
    assert summary(out)["steps"] == 14


@pytest.mark.slow
def test_the_hf_export_loads_offline_and_gives_the_training_model_s_mlm_logits(corpus, clean_run):
    out = clean_run  # read only
    from transformers import AutoModelForMaskedLM, AutoTokenizer, pipeline
    hf_dir = os.path.join(out, "hf")
    mlm = AutoModelForMaskedLM.from_pretrained(hf_dir, local_files_only=True).eval()
    tokenizer = AutoTokenizer.from_pretrained(hf_dir, local_files_only=True)
    fill = pipeline("fill-mask", model=mlm, tokenizer=tokenizer)
    answers = fill("the river [MASK] the stone .")
    assert len(answers) == 5 and all("token_str" in a for a in answers)
    # The exported model's MLM logits are the training model's (whose head runs sparsely).
    trained = M.Pretraining(M.model_from(M.new_architecture("tiny", len(tokenizer), 32, tokenizer.pad_token_id),
                                         "nsp", 0.1))
    trained.hf.load_state_dict(final_weights(out))
    trained.eval()
    stream = make_stream(corpus, tokenizer, max_seq_len=32, batch_size=8)
    batch = M.prepare(M.sparse_targets(next(iter(stream))), torch.device("cpu"))[0]
    with torch.no_grad():
        full = mlm(input_ids=batch["input_ids"], token_type_ids=batch["token_type_ids"],
                   attention_mask=batch.get("attention_mask")).logits
        hidden = trained.hf.bert(input_ids=batch["input_ids"], token_type_ids=batch["token_type_ids"],
                                 attention_mask=batch.get("attention_mask")).last_hidden_state
        sparse = trained.hf.cls.predictions(hidden.flatten(0, 1)[batch["masked_pos"]])
        sums = trained(**batch)
    assert torch.allclose(full.flatten(0, 1)[batch["masked_pos"]], sparse, atol=1e-5)
    expected = torch.nn.functional.cross_entropy(sparse, batch["masked_targets"], reduction="sum")
    assert torch.allclose(sums[0], expected, atol=1e-4)


@pytest.mark.slow
def test_sigterm_to_the_job_stops_every_rank_at_the_same_step_and_saves(tmp_path, corpus, tok_dir):
    """SIGTERM to the job's process group, as Slurm's scancel and `timeout` send it: torchrun, the ranks
    and their forkservers get it. Every rank stops at the same step, saves, and runs the last eval with
    the eval loader's workers of step 4 (which waited forever once the signal had killed the forkserver);
    the same command goes on from the checkpoint."""
    out = str(tmp_path / "run")
    eval_corpus = write_corpus(tmp_path / "eval.txt", 24, seed=5)  # a fifth of the corpus: shorter evals
    cmd = torchrun(2, *common(corpus, tok_dir, out), "--num-workers", "1", "--save-every", "1000", "--max-steps",
                   "100000", "--epochs", "50", "--eval-corpus", eval_corpus, "--eval-every", "4")
    def stop_at_step_5(line, proc):
        if line.startswith("step 5:"):
            os.killpg(proc.pid, signal.SIGTERM)  # its own session (run): only this job's processes
        return False

    _, text, _ = run(cmd, stop_at_step_5, timeout=200)
    stopped_at = int(re.search(r"stopped by signal at step (\d+) on every rank", text).group(1))
    s = summary(out)
    assert s["stopped_by_signal"] and s["steps"] == stopped_at >= 5
    assert stopped_at % 4 == 0 or re.search(rf"^step {stopped_at}: eval/mlm_loss", text, re.M), text[-3000:]
    assert open(os.path.join(out, "checkpoints", "latest")).read() == checkpoints.step_name(stopped_at)
    rc, again, err2 = run([*cmd, "--max-steps", str(stopped_at + 2)])
    assert rc == 0 and f"at step {stopped_at}," in again and summary(out)["steps"] == stopped_at + 2, err2[-2000:]


@pytest.mark.slow
def test_a_rollback_moves_newer_checkpoints_aside_and_resume_auto_follows_it(tmp_path, corpus, tok_dir, clean_run,
                                                                             capsys):
    out = copy_of(clean_run, tmp_path)  # --max-steps 12, a checkpoint every 2 steps, --keep-last 10
    base = plain(*common(corpus, tok_dir, out), "--num-workers", "0", "--save-every", "2", "--keep-last", "10")
    ckpts = os.path.join(out, "checkpoints")
    _, stdout, err = run_main(*base[2:], "--max-steps", "6", "--resume", os.path.join(ckpts, "step_000004"))
    assert f"resumed from {ckpts}/step_000004" in stdout, err[-3000:]
    assert f"step 6, 8, 10, 12 are newer than the timeline resumed here (step 4); moved to {ckpts}/abandoned" in err
    assert sorted(os.listdir(os.path.join(ckpts, "abandoned"))) == [f"step_0000{s:02d}" for s in (6, 8, 10, 12)]
    # A complete checkpoint newer than `latest` (a crash between the rename and the pointer, or a copy
    # put back by hand) is not the timeline either: --resume auto takes the rollback's step 6, not 12.
    shutil.copytree(os.path.join(ckpts, "abandoned", "step_000012"), os.path.join(ckpts, "step_000012"))
    assert summary(out)["steps"] == 6
    capsys.readouterr()
    path, loaded = checkpoints.choose_checkpoint(ckpts, "auto", False)  # what rank 0's plan_run resumes
    assert path == f"{ckpts}/step_000006" and loaded["meta"]["step"] == 6, path
    assert "step 12 are newer than the timeline resumed here (step 6)" in capsys.readouterr().err


@pytest.mark.slow
def test_resume_refuses_another_tokenizer_or_a_changed_corpus(tmp_path, corpus, tok_dir, clean_run):
    """Where rank 0 plans the run (plan_run: one of USER_ERRORS, which __main__ turns into one line and exit code
    2, as test_damage_only_the_checksum_sees_is_refused sees end to end): another tokenizer is refused; a changed
    corpus is refused unless --allow-corpus-change, which restarts the epoch on it; then it is the run's."""
    import data_stream
    text = str(tmp_path / "corpus.txt")
    shutil.copy(corpus, text)  # the corpus the shared run trained on (its fingerprint is of the contents)
    out = copy_of(clean_run, tmp_path)
    base = plain(*common(text, tok_dir, out), *CLEAN)  # resuming a finished run: 0 steps to go
    other_dir = str(tmp_path / "other_tok")  # same size, another vocabulary
    data_stream.get_tokenizer(None, [write_corpus(tmp_path / "other.txt", 60, seed=7)], 300).save_pretrained(other_dir)
    kept = data_stream.get_tokenizer(os.path.join(out, "tokenizer"))
    other = data_stream.get_tokenizer(other_dir)
    with pytest.raises(P.USER_ERRORS) as error:
        P.plan_run(P.parse_args([*base[2:], "--tokenizer", other_dir]), torch.device("cpu"), None, P.Rank0Only())
    assert "\n" not in str(error.value), error.value
    assert f"it trained with tokenizer {data_stream.tokenizer_hash(kept)}, this run's (--tokenizer {other_dir}) is " \
           f"{data_stream.tokenizer_hash(other)}" in str(error.value), error.value
    release_out_dir_locks()
    with open(text, "a") as f:
        f.write("\na new document .\nwith two sentences .\n")
    with pytest.raises(P.USER_ERRORS) as error:
        P.plan_run(P.parse_args(base[2:]), torch.device("cpu"), None, P.Rank0Only())
    assert "the corpus changed" in str(error.value) and "--allow-corpus-change" in str(error.value), error.value
    release_out_dir_locks()
    _, stdout, err = run_main(*base[2:], "--allow-corpus-change")
    assert "epoch 0 restarts on the new corpus" in err and "resumed from" in stdout, err[-3000:]
    resumed, _ = P.plan_run(P.parse_args(base[2:]), torch.device("cpu"), None, P.Rank0Only())
    assert resumed.resume_path and not resumed.corpus_changed  # the new corpus is the run's now


class Crash(Exception):
    pass


def crash_on_call(monkeypatch, k):
    """Make the k-th file-system step of a save raise Crash; a crashing _write leaves half its file."""
    real_write, real_rename, real_rmtree, real_fsync = checkpoints._write, os.rename, shutil.rmtree, \
        checkpoints._fsync_dir
    real_replace = os.replace
    calls = []

    def hook(real, *a, half=False, **kw):
        calls.append(1)
        if len(calls) == k:
            if half:
                buffer = io.BytesIO()
                a[1](buffer)
                with open(a[0], "wb") as f:
                    f.write(buffer.getvalue()[:len(buffer.getvalue()) // 2])
            raise Crash
        return real(*a, **kw)

    monkeypatch.setattr(checkpoints, "_write", lambda *a: hook(real_write, *a, half=True))
    monkeypatch.setattr(os, "rename", lambda *a: hook(real_rename, *a))
    monkeypatch.setattr(os, "replace", lambda *a: hook(real_replace, *a))  # the latest pointer's atomic_write
    monkeypatch.setattr(shutil, "rmtree", lambda *a, **kw: hook(real_rmtree, *a, **kw))
    monkeypatch.setattr(checkpoints, "_fsync_dir", lambda *a: hook(real_fsync, *a))


def test_a_save_that_dies_midway_never_costs_a_complete_checkpoint(tmp_path, monkeypatch):
    """Die at every file-system step of a save (half of a file written, before each rename, fsync
    and delete), saving a new step and re-saving an existing one: --resume auto then resumes a
    complete checkpoint (the new one or the one before), and every checkpoint that was complete
    before the save still is."""
    def files(value):
        return {"trainer.pt": {"w": torch.full((256,), value)}, "ranks.pt": [{"value": value}]}

    def complete(root):
        """{step: the value its files hold} for every complete checkpoint."""
        found = {}
        for d in os.listdir(root):
            loaded, _ = checkpoints.read_checkpoint(os.path.join(root, d))
            if checkpoints.step_of(d) is not None and loaded is not None:
                assert torch.equal(loaded["trainer.pt"]["w"], torch.full((256,), loaded["meta"]["value"]))
                found[checkpoints.step_of(d)] = loaded["meta"]["value"]
        return found

    pristine = str(tmp_path / "pristine")
    checkpoints.save_checkpoint(pristine, 4, files(4.0), {"step": 4, "value": 4.0}, keep_last=5)
    checkpoints.save_checkpoint(pristine, 8, files(8.0), {"step": 8, "value": 8.0}, keep_last=5)
    for step, value in ((12, 12.0), (8, 8.5)):  # a new step; the same step again (a resumed run's final save)
        for k in range(1, 100):
            root = str(tmp_path / f"crash_{step}_{k}")
            shutil.copytree(pristine, root)
            crash_on_call(monkeypatch, k)
            try:
                checkpoints.save_checkpoint(root, step, files(value), {"step": step, "value": value}, keep_last=5)
                break  # k is past the save's last step
            except Crash:
                pass
            finally:
                monkeypatch.undo()
            saved = complete(root).get(step) == value  # the new one made it to its place
            path, loaded = checkpoints.choose_checkpoint(root, "auto", False)
            assert loaded is not None, (step, k)
            expected = {(step, value)} if saved else {(8, 8.0), (step, value)}
            assert (loaded["meta"]["step"], loaded["meta"]["value"]) in expected, (step, k, path)
            after = complete(root)
            assert after[4] == 4.0 and after.get(8) in (8.0, 8.5), (step, k, after)
        assert k > 8, k  # every write, rename, fsync and delete of the save was a crash point


def test_the_meta_of_a_checkpoint_written_before_the_typed_state_reads_back_unchanged():
    """Checkpoints keep Progress and the LR plan as plain values under the names they always had (issue 44):
    the meta that the version before wrote (fixture: 9567972's; its checkpoint, resumed by this version, ends
    bitwise equal to a run never stopped: BENCHMARKS.md section 20) reads into the records and writes back the
    same, with a --budget plan too."""
    import dataclasses
    with open(os.path.join(ROOT, "tests", "fixtures", "checkpoint_meta_9567972.json")) as f:
        meta = json.load(f)["meta"]
    progress = P.Progress.from_meta(meta)
    assert progress.step == 10 and progress.plan_pos == meta["plan_pos"]
    assert dataclasses.asdict(progress) == {k: meta[k] for k in dataclasses.asdict(progress)}
    budget = {"seconds": 20.0, "step_s": 0.1, "train_step_s": 0.08, "calibration_s": 3.0, "steps_fit": 170,
              "limit": "budget"}
    for plan in (meta["plan"], {**meta["plan"], "budget": budget}):
        typed = estimate_steps.LRPlan.from_dict(plan)
        assert json.loads(json.dumps(dataclasses.asdict(typed))) == {"budget": None, **plan}
        assert lr_factor(typed, 1) == 1.0 and lr_factor(typed, 30) == 0.0  # warmup 2, linear to 0 at 30
