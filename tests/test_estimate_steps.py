"""estimate_steps.py against the real stream: its exact counts must equal what DataLoaders yield."""
import os

import pytest
from conftest import ROOT, Launch, check_against_stream, make_stream, plain, wait_for, write_corpus

import estimate_steps as es

SKEW = [300] + [2, 2, 1] * 13  # one document holds most of the bytes: shards are very uneven


@pytest.mark.parametrize("world_size,num_workers,objective,batch_size,epochs", [
    (1, 0, "nsp", 4, 2), (2, 2, "nsp", 8, 1), (3, 0, "mlm", 4, 2), (4, 2, "mlm", 16, 1),
    (4, 0, "nsp", 16, 2), (3, 2, "nsp", 4, 1), (2, 2, "mlm", 32, 2)])
def test_exact_equals_the_stream(corpus, tokenizer, world_size, num_workers, objective, batch_size, epochs):
    real = check_against_stream(corpus, tokenizer, world_size, num_workers, objective, batch_size, epochs)
    assert sum(map(len, real[0])) >= 8  # enough batches for the comparison to mean something


@pytest.mark.parametrize("world_size,num_workers,objective,batch_size,epochs", [
    (2, 2, "nsp", 4, 2), (3, 0, "mlm", 4, 1), (4, 2, "nsp", 4, 1), (2, 0, "mlm", 2, 2)])
def test_exact_equals_the_stream_on_uneven_shards(tmp_path_factory, tokenizer, world_size, num_workers, objective,
                                                   batch_size, epochs):
    path = tmp_path_factory.getbasetemp() / "skew.txt"
    if not path.exists():
        write_corpus(path, len(SKEW), seed=5, skew=SKEW)
    real = check_against_stream(str(path), tokenizer, world_size, num_workers, objective, batch_size, epochs)
    sizes = [sum(b) for ranks in real for b in ranks]
    assert max(sizes) > 3 * min(sizes)  # really uneven


@pytest.mark.slow  # subprocesses, or seconds of work
def test_sample_mode_interval_holds_the_exact_answer(tmp_path, tokenizer):
    path = write_corpus(tmp_path / "big.txt", 3000, seed=11)
    for objective, world_size, num_workers, max_rel_err in (("nsp", 4, 2, 0.03), ("mlm", 1, 0, 0.01)):
        stream = make_stream(path, tokenizer, objective=objective, max_seq_len=64)
        kw = dict(world_size=world_size, num_workers=num_workers, batch_size=8, accum_steps=2, epochs=2)
        exact = es.estimate(stream, mode="exact", **kw)
        sample = es.estimate(stream, mode="sample", sample_docs=500, **kw)
        assert sample["mode"] == "sample" and sample["docs_read"] == 500 and sample["per_epoch"] is None
        for key in ("total_steps", "samples_per_epoch"):
            lo, hi = sample[f"{key}_ci"]
            assert lo <= exact[key] <= hi, (objective, key, exact[key], lo, hi)
            assert (hi - lo) / exact[key] < 0.1  # an interval that says something
            assert abs(sample[key] / exact[key] - 1) < max_rel_err, (objective, key, sample[key], exact[key])
        assert abs(sample["tokens"] / exact["tokens"] - 1) < 0.02
        assert abs(sample["sentences"] / exact["sentences"] - 1) < 0.02


def test_impossible_settings_give_zero_steps_and_a_note(corpus, tokenizer):
    stream = make_stream(corpus, tokenizer)
    r = es.estimate(stream, world_size=2, num_workers=0, batch_size=100_000, accum_steps=2, epochs=2, warmup=0.5)
    assert (r["steps_per_epoch"], r["total_steps"], r["warmup_steps"]) == (0, 0, 0)
    assert r["micro_batches_per_rank_min"] == 1 and "--accum-steps 2" in r["note"]
    r = es.estimate(stream, world_size=200, num_workers=0, batch_size=1, accum_steps=1, epochs=1)
    assert r["total_steps"] == 0 and r["samples_per_rank_min"] == 0 and "no samples" in r["note"]
    assert es.estimate(stream, 1, 0, 4, 1, 1)["note"] is None
    assert "note:" in es.format_report(r) and "\n" not in r["note"]


def cli(*args):
    """estimate_steps.py with these arguments, started now (wait_for waits for it)."""
    return Launch(plain(*args, script=os.path.join(ROOT, "estimate_steps.py")))


@pytest.mark.slow  # subprocesses, or seconds of work
def test_cli_table_notes_zero_steps(corpus, tok_dir):
    """As a process (--json, from a copy of the estimator's two files: test_copies.py)."""
    common = ["--corpus", corpus, "--tokenizer", tok_dir, "--max-seq-len", "32", "--world-size", "2",
              "--num-workers", "2", "--epochs", "2", "--warmup", "0.1"]
    code, out, err = wait_for([cli(*common, "--batch-size", "100000", "--accum-steps", "3", "--mode", "exact")], 300)[0]
    assert code == 0, err
    rows = {line[:32].strip(): line[32:].strip() for line in out.splitlines()}  # label column, then value
    assert rows["total steps"] == "0" and rows["mode"].startswith("exact (--mode exact")
    assert "note: 0 optimizer steps" in out and "Traceback" not in err


def test_bad_estimator_input_is_one_line(tmp_path, tok_dir, capsys):
    """main() stops with one line (exit code 2 from argparse, before any corpus work; else a SystemExit with the
    line: exit code 1, no traceback); as a process: test_a_missing_corpus_in_a_process_is_one_line_on_stderr."""
    (tmp_path / "blank.txt").write_text("\n\n  \n")
    flags = ["--tokenizer", tok_dir]
    for args, message in ((["--corpus", str(tmp_path / "missing.txt"), *flags], "does not exist"),
                          (["--corpus", str(tmp_path / "blank.txt"), *flags], "holds no text"),
                          (["--corpus", str(tmp_path / "blank.txt"), "--tokenizer", str(tmp_path)], "--tokenizer")):
        with pytest.raises(SystemExit) as e:
            es.main(args)
        line = str(e.value.code)
        assert line.startswith("estimate_steps.py: error:") and message in line and "\n" not in line, (args, line)
    for args, message in ((["--batch-size", "0"], "--batch-size: 0 is out of range (allowed: x >= 1)"),
                          (["--epochs", "0"], "--epochs: 0 is out of range (allowed: x >= 1)"),
                          (["--accum-steps", "0"], "--accum-steps: 0 is out of range (allowed: x >= 1)"),
                          (["--world-size", "-1"], "--world-size: -1 is out of range (allowed: x >= 1)"),
                          (["--num-workers", "-1"], "--num-workers: -1 is out of range (allowed: x >= 0)"),
                          (["--warmup", "1.5"], "--warmup: 1.5 is out of range (allowed: 0 <= x <= 1)"),
                          (["--sample-docs", "1"], "--sample-docs: 1 is out of range (allowed: x >= 2)")):
        with pytest.raises(SystemExit) as e:  # checked by argparse, before any corpus work
            es.main(args)
        err = capsys.readouterr().err
        assert e.value.code == 2 and err == f"estimate_steps.py: error: argument {message} (see --help)\n", err


@pytest.mark.slow  # subprocesses, or seconds of work
def test_a_missing_corpus_in_a_process_is_one_line_on_stderr(tmp_path, tok_dir):
    code, _, err = wait_for([cli("--corpus", str(tmp_path / "missing.txt"), "--tokenizer", tok_dir)], 300)[0]
    assert code != 0 and "does not exist" in err and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1 and err.startswith("estimate_steps.py: error:"), err


def test_estimated_warmup_is_the_trainers(corpus, tokenizer):
    """One rule and one default: what estimate_steps.py prints is what pretrain_ddp.py plans."""
    import pretrain_ddp as P
    stream = make_stream(corpus, tokenizer)
    assert P.parse_args([]).warmup == es.WARMUP == 0.06
    for batch_size, epochs in ((4, 1), (32, 2), (100_000, 1)):  # ~15, ~4 and 0 steps
        for warmup in (0.0, 0.01, 0.06, 0.5, 1.0):
            args = P.parse_args(["--batch-size", str(batch_size), "--epochs", str(epochs), "--warmup", str(warmup),
                                 "--num-workers", "0"])
            plan, _ = P.new_lr_plan(args, stream)
            r = es.estimate(stream, 1, 0, batch_size, 1, epochs, warmup=warmup)
            assert r["warmup_steps"] == plan.warmup and r["total_steps"] == plan.total, (batch_size, warmup)
            assert (plan.warmup >= 1) == (warmup > 0 and plan.total > 0)
