"""DataLoader workers and the way out (issue 28): workers never forked from a rank that runs
threads, one eval loader for the run, a hung worker ends the run in one line."""
import os
import subprocess
import sys

import pytest
import torch
from conftest import FAST, ROOT, TESTS, make_stream, plain, run

import pretrain_ddp as P


def test_workers_start_from_a_forkserver_and_the_eval_loader_persists(corpus, tokenizer):
    """A child forked from a process that runs threads (gloo, TensorBoard, OpenMP, pin-memory) can
    hang on a lock one of them held (seen: an eval worker, 1 job in 30 under load). Workers come
    from a forkserver that preloads torch and the stream's modules; the eval loader keeps its workers."""
    stream = make_stream(corpus, tokenizer)
    train = P.make_loader(stream, 1, torch.device("cpu"), 60)
    evals = P.make_loader(stream, 1, torch.device("cpu"), 60, persistent=True)
    assert train.multiprocessing_context.get_start_method() == "forkserver" and train.timeout == 60
    assert not train.persistent_workers and evals.persistent_workers
    first = next(iter(evals))
    workers = evals._iterator._workers
    again = next(iter(evals))  # a second pass (the next eval) reuses the same worker processes
    assert evals._iterator._workers is workers and all(w.is_alive() for w in workers)
    assert torch.equal(first["input_ids"], again["input_ids"])
    assert P.make_loader(stream, 0, torch.device("cpu"), 60).timeout == 0  # no worker: nothing to wait for


@pytest.mark.slow  # a process, and a DataLoader worker from a forkserver
def test_workers_take_our_modules_not_the_working_directory_s(corpus, tok_dir, tmp_path):
    """The forkserver finds modules from the working directory first: a data_stream.py or model.py there (a
    user's project has one) must not become the workers' (it did: the stream's module was preloaded). The
    workers unpickle the collate function, model.sparse_targets, so they import model.py too."""
    for name in ("data_stream", "model", "workers"):
        (tmp_path / f"{name}.py").write_text(f"raise SystemExit('the working directory {name}.py')\n")
    code = ("import sys, torch\n"
            f"sys.path.insert(0, {ROOT!r})\n"
            "import data_stream as ds, model, workers\n"
            f"s = ds.BertPretrainStream({corpus!r}, ds.get_tokenizer({tok_dir!r}), ds.StreamSettings(max_seq_len=32))\n"
            "print(next(iter(workers.make_loader(s, 1, False, 60, model.sparse_targets)))['num_samples'])\n")
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "PYTHONPATH": ""})
    assert result.returncode == 0 and int(result.stdout.split()[-1]) >= 32, result.stderr[-2000:]


@pytest.mark.slow
def test_a_hung_worker_ends_the_run_in_one_line(tmp_path, corpus, tok_dir):
    """A worker that never sends a batch: the rank stops after --dist-timeout (0.05 min here) with one
    line, not a silent hang (before: forever). The verdict does not depend on load: the worker never
    answers, so the run fails either way, and the test's own limit is far above the timeout."""
    code, _, stderr = run(plain("--corpus", corpus, "--tokenizer", tok_dir, "--out-dir", str(tmp_path / "o"), *FAST,
                                "--max-steps", "2", "--eval-corpus", "none", "--num-workers", "1",
                                "--dist-timeout", "0.05"),
                          env={"PYTHONPATH": os.pathsep.join([os.path.join(TESTS, "hang_in_worker"), ROOT])})
    errors = [line for line in stderr.splitlines() if "error" in line]
    assert code == 1 and "Traceback" not in stderr, stderr[-3000:]
    assert len(errors) == 1 and "no batch from this rank's DataLoader workers within --dist-timeout" in errors[0], \
        stderr[-3000:]
