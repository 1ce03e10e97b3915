"""Shared by every test module (none imports another): a generated corpus and a tokenizer trained on it, built
once per test run; the one launcher of the trainer and the other scripts (run), and main() in the test's own process
for the 1-rank runs a test only reads (run_main); the trainer's flags and what a run leaves behind; the data-stream
helpers several files use; and the order in which xdist hands the files out."""
import contextlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from typing import NamedTuple

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TESTS = os.path.join(ROOT, "tests")
sys.path.insert(0, ROOT)
# Never touch the user's cache (or CI's home): every cached artefact of the run goes here.
os.environ.setdefault("BERT_DDP_CACHE", tempfile.mkdtemp(prefix="bert_ddp_test_cache_"))
if os.environ.get("PYTEST_XDIST_WORKER"):
    # As many xdist workers as cores: torch's work in a worker takes one thread (two workers with a thread per
    # core each slow each other several times over); the processes the tests start get one too (env()).
    os.environ["OMP_NUM_THREADS"] = "1"
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(1)

WORDS = ("the a of to and in is was for on that with as by at from it an be this which or are "
         "river stone garden winter paper engine market signal window forest letter silver bridge "
         "music number orange planet rabbit season teacher valley yellow basket candle doctor "
         "empty finger guitar hollow island jacket kettle lemon meadow needle ocean pepper").split()
NUMBERS = "zero one two three four five six seven eight nine".split()


def marker(doc_id):
    """'docstart four two' for document 42: survives tokenization and decoding intact."""
    return "docstart " + " ".join(NUMBERS[int(c)] for c in str(doc_id))


def write_corpus(path, num_docs, seed=0, min_sents=1, max_sents=30, skew=None):
    """A corpus in BERT format; each document's first sentence is its marker."""
    rng = random.Random(seed)
    docs = []
    for d in range(num_docs):
        n = skew[d] if skew else rng.randint(min_sents, max_sents)
        sents = [marker(d) + " ."]
        sents += [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 25))) + " ." for _ in range(n - 1)]
        docs.append("\n".join(sents))
    with open(path, "w") as f:
        f.write("\n\n".join(docs) + "\n")
    return str(path)


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus") / "corpus.txt", 120)


@pytest.fixture(scope="session")
def small_corpus(tmp_path_factory):
    """The session corpus' first 40 documents (write_corpus draws them alike), for the tests that read a corpus
    many times over with DataLoader workers: ~50 batches of 4 per rank of 2, where they need 10."""
    return write_corpus(tmp_path_factory.mktemp("small_corpus") / "corpus.txt", 40)


@pytest.fixture(scope="session")
def tokenizer(corpus):
    import data_stream
    return data_stream.get_tokenizer(None, [corpus], vocab_size=300)


@pytest.fixture(scope="session")
def tok_dir(tokenizer, tmp_path_factory):
    """The session tokenizer as a folder, for --tokenizer (read only)."""
    path = str(tmp_path_factory.mktemp("tok"))
    tokenizer.save_pretrained(path)
    return path


def release_out_dir_locks():
    """A test that runs pretrain_ddp's plan_run or main() in this process holds its out dir's lock (a
    process holds it for its life): drop it, so that runs started after it can use the out dir."""
    locks = getattr(sys.modules.get("checkpoints"), "OUT_DIR_LOCK", {})
    for f in locks.values():
        f.close()
    locks.clear()


@pytest.fixture(autouse=True)
def out_dir_locks_released():
    yield
    release_out_dir_locks()


# ----------------------------------------------------------------------------- the order xdist hands files out

# What each file's tests take, in seconds (the sum of --durations=0 over the file, 2 workers on 2 busy cores:
# only the order matters; re-measure when a file changes much). With --dist loadfile the workers take whole files
# in collection order: the longest go first, so that the short ones fill the end and both workers finish together
# (the longest file last left one worker alone for minutes). A file not listed counts 0: it goes last.
FILE_COST = {
    "test_faults.py": 165, "test_multinode.py": 160, "test_pretrain_ddp.py": 155, "test_checkpoints.py": 85,
    "test_gpu_check.py": 70, "test_trackers.py": 45, "test_data_stream.py": 31, "test_budget.py": 28,
    "test_workers_and_exit.py": 27, "test_formats.py": 20, "test_estimate_steps.py": 18, "test_token_cache.py": 16,
    "test_copies.py": 40, "test_finetune.py": 14, "test_bert_rules.py": 12, "test_init_from.py": 11, "test_model.py": 5,
    "test_modernbert.py": 60, "test_electra.py": 30,
}


def pytest_collection_modifyitems(config, items):
    """Slowest files first (a stable sort: a file's tests keep their order)."""
    items.sort(key=lambda item: -FILE_COST.get(item.path.name, 0))


# ----------------------------------------------------------------------------- commands

SCRIPT = os.path.join(ROOT, "pretrain_ddp.py")
# The flags of a short run on the CPU: small rows and batches, a log line every step (the tests read it), no
# periodic eval, no TensorBoard, no DataLoader worker process. A test gives what it needs after them: argparse
# keeps the last value of a flag.
FAST = ["--max-seq-len", "32", "--batch-size", "4", "--log-every", "1", "--eval-every", "1000", "--log-to", "stdout",
        "--num-workers", "0"]


def common(corpus, tok_dir, out, *more):
    """The trainer's flags for a short run on `corpus` into `out`, with no eval set, then `more`."""
    return ["--corpus", corpus, "--tokenizer", tok_dir, "--eval-corpus", "none", "--out-dir", out, *FAST, *more]


def plain(*args, script=SCRIPT):
    """`python pretrain_ddp.py ARGS`; script may be a list: a test's wrapper of the trainer and its arguments."""
    return [sys.executable, *([script] if isinstance(script, str) else script), *args]


def torchrun(nproc, *args, script=SCRIPT, agent=()):
    """`torchrun --standalone --nproc_per_node NPROC [agent flags] pretrain_ddp.py ARGS`."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc), *agent,
            *plain(*args, script=script)[1:]]


def env(**extra):
    """The environment of every process a test starts: one OpenMP thread, unbuffered output, and none of this
    machine's tracker settings (MLFLOW_*, WANDB_: only the test's own), then `extra`."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("MLFLOW_", "WANDB_"))}
    return {**base, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1", "MLFLOW_DISABLE_TELEMETRY": "true", **extra}


# ----------------------------------------------------------------------------- the launcher

class Result(NamedTuple):
    returncode: int
    stdout: str
    stderr: str


def processes_of(needle, where="cmdline"):
    """pids of every process whose command line (or environment) has needle as one of its entries
    (torchrun starts its workers in sessions of their own, so a process group does not reach them)."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/{where}", "rb") as f:
                entries = f.read().split(b"\0")
        except OSError:
            continue
        if needle.encode() in entries:
            pids.append(int(pid))
    return pids


class Launch:
    """A command started in a session of its own, its stdout and stderr read as they come (on_line(line, proc)
    sees each stdout line; True: read no further). Every process it starts, however (torchrun's ranks in sessions
    of their own, DataLoader workers from a forkserver), carries its marker in the environment."""

    def __init__(self, cmd, on_line=None, cwd=ROOT, extra_env=None):
        self.marker = f"BERT_DDP_TEST_RUN={uuid.uuid4().hex}"
        name, value = self.marker.split("=")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd,
                                     env=env(**(extra_env or {}), **{name: value}), start_new_session=True)
        self.out, self.err, self.errors = [], [], []
        self.readers = [threading.Thread(target=self._read, args=(on_line,), daemon=True),
                        threading.Thread(target=lambda: self.err.extend(self.proc.stderr), daemon=True)]
        for reader in self.readers:
            reader.start()

    def _read(self, on_line):
        try:
            for line in self.proc.stdout:
                self.out.append(line)
                if on_line and on_line(line, self.proc):
                    break
        except Exception as error:  # raised in the test by wait_for
            self.errors.append(error)

    def processes(self):
        return processes_of(self.marker, "environ")

    def kill(self):
        for pid in [self.proc.pid, *self.processes()]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def wait_for(launches, timeout=480):
    """Wait for every launch to end. Past timeout every process of every launch is killed and the test fails;
    it fails too if any process of a launch (a DataLoader worker, a forkserver) is alive 30 s after its
    launcher ended. Returns a Result per launch."""
    fired = []
    timer = threading.Timer(timeout, lambda: (fired.append(1), [launch.kill() for launch in launches]))
    timer.start()
    for launch in launches:
        launch.proc.wait()
    timer.cancel()
    deadline = time.time() + 30
    while any(launch.processes() for launch in launches) and time.time() < deadline:  # killed ones are reaped
        time.sleep(0.1)
    left = []
    for launch in launches:
        pids = launch.processes()
        for pid in pids:
            with contextlib.suppress(OSError), open(f"/proc/{pid}/cmdline", "rb") as f:
                left.append(f.read()[:120].decode(errors="replace"))
        if pids:
            launch.kill()
    for launch in launches:
        for reader in launch.readers:
            reader.join(timeout=30)
        if launch.errors:
            raise launch.errors[0]
    results = [Result(launch.proc.returncode, "".join(launch.out), "".join(launch.err)) for launch in launches]
    assert not fired, f"timed out after {timeout} s (a hang?): {[r.stdout[-2000:] for r in results]}"
    assert not left, f"{len(left)} process(es) of the run outlived it by 30 s (orphaned workers?): {left}"
    return results


def run(cmd, on_line=None, timeout=480, cwd=ROOT, env=None):
    """THE launcher: cmd (plain(...), torchrun(...), a helper script, a shell) in a session of its own, with
    env() and the extra environment `env`; on_line as Launch's. Returns (exit code, stdout, stderr) as a Result;
    a run past timeout, or one that leaves a process behind, fails the test (wait_for)."""
    return wait_for([Launch(cmd, on_line, cwd, env)], timeout)[0]


def run_main(*args):
    """`python pretrain_ddp.py ARGS` run by main() in this process: for a 1-rank run that ends well and that a test
    reads the output and files of (a shared run, a resume). It is the same main() without a new process's ~5 CPU s
    of imports (a dozen of these were a minute of the suite); the ends of the real command (exit codes, one-line
    errors, signals, torchrun) are run() tests'. Returns Result(0, stdout, stderr); a failure raises here."""
    import io
    from unittest import mock

    import torch

    import pretrain_ddp
    # What main() sets for its process, put back after it: its signal handlers, the thread count (without
    # OMP_NUM_THREADS: one per core), the environment (TOKENIZERS_PARALLELISM, which the processes a later test
    # starts would inherit, hiding whether the trainer sets it itself)
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    threads = torch.get_num_threads()
    stdout, stderr = io.StringIO(), io.StringIO()
    try:
        with mock.patch.dict(os.environ), contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            pretrain_ddp.main(list(args))
    except BaseException as e:
        raise AssertionError(f"main({' '.join(args)}) failed:\n{stderr.getvalue()[-3000:]}") from e
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        torch.set_num_threads(threads)
        release_out_dir_locks()
    return Result(0, stdout.getvalue(), stderr.getvalue())


def one_line_plan_errors(base, cases):
    """Each (flags, message) of cases stops the trainer where it decides the run (validate, plan_run: before any
    training) with one line holding message."""
    import torch

    import pretrain_ddp as P
    for extra, message in cases:
        with pytest.raises(P.USER_ERRORS) as error:
            args = P.parse_args([*base, *extra])
            P.validate(args)
            P.plan_run(args, torch.device("cpu"), None, P.Rank0Only())
        assert message in str(error.value) and len(str(error.value).splitlines()) == 1, (extra, error.value)


def kill_all(proc, cmd):
    """SIGKILL the run's launcher and ranks (whose command lines name its --out-dir), as a crash or
    the OOM killer would; their DataLoader workers and forkservers are left to notice by themselves."""
    out_dir = cmd[cmd.index("--out-dir") + 1]
    for pid in [proc.pid, *processes_of(out_dir)]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def crash_at(pattern):
    """on_line for run: SIGKILL every process of the run (as a crash would) once stdout matches."""
    def on_line(line, proc):
        if re.search(pattern, line):
            kill_all(proc, proc.args)
            return True
        return False
    return on_line


# ----------------------------------------------------------------------------- what a run leaves

def summary(out_dir):
    with open(os.path.join(out_dir, "summary.json")) as f:
        return json.load(f)


def logged(stdout, name):
    """{step: value} of one scalar in the stdout log."""
    return {int(step): float(v) for step, v in re.findall(rf"^step (\d+): .*?{name} ([^,\s]+)", stdout, re.M)}


def final_weights(out):
    import torch
    with open(os.path.join(out, "checkpoints", "latest")) as f:
        latest = f.read()
    return torch.load(os.path.join(out, "checkpoints", latest, "trainer.pt"), weights_only=True)["model"]


def same_weights(a, b):
    import torch
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def copy_of(run_dir, tmp_path):
    """The test's own copy of a shared run (the path of the run does not matter to a resume)."""
    import shutil
    out = str(tmp_path / "run")
    shutil.copytree(run_dir, out)
    return out


def finish(proc, timeout=300):
    """(exit code, stdout, stderr) of a Popen started earlier (tests start several, then wait)."""
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


# ----------------------------------------------------------------------------- the data stream

def make_stream(corpus, tokenizer, rank=0, world_size=1, split="train", **settings):
    """A stream of the session's sizes (batches of 4, 32 tokens) unless settings (StreamSettings' fields) say else."""
    import data_stream
    settings = data_stream.StreamSettings(**{"batch_size": 4, "max_seq_len": 32, **settings})
    return data_stream.BertPretrainStream(corpus, tokenizer, settings, split, rank, world_size)


def loader(stream, num_workers):
    from torch.utils.data import DataLoader
    return DataLoader(stream, batch_size=None, num_workers=num_workers)


def run_ranks(corpus, tokenizer, world_size, num_workers, epoch=0, **kw):
    """All batches of one epoch, per rank, in the order the trainer would see them."""
    out = []
    for rank in range(world_size):
        stream = make_stream(corpus, tokenizer, rank=rank, world_size=world_size, **kw)
        stream.set_epoch(epoch)
        out.append(list(loader(stream, num_workers)))
    return out


def tokens_per_shard(batches, tokenizer):
    """mlm + no masking: each shard's tokens, special tokens left out, in the order read."""
    tokens = {}
    special = set(tokenizer.all_special_ids)
    for b in batches:
        ids = [t for t in b["input_ids"].flatten().tolist() if t not in special]
        tokens.setdefault(b["cursor"][0], []).extend(ids)
    return tokens


def corpus_tokens(corpus, tokenizer):
    """Every token of every document, once: what one epoch must hold, no more and no less."""
    stream = make_stream(corpus, tokenizer, token_cache="none")
    return Counter(t for d in range(stream.num_docs) for t in stream.document(d)[0].tolist())


def same_batches(xs, ys):
    import torch
    assert len(xs) == len(ys)
    for x, y in zip(xs, ys, strict=True):
        assert x.keys() == y.keys()
        for k in x:
            if k == "cursor":
                assert tuple(x[k]) == tuple(y[k])
            else:
                assert torch.equal(x[k], y[k]), k


def check_resume_from_cursor(corpus, tokenizer, objective, shuffle_block, num_workers):
    """A stream stopped after k batches (a cursor at several places of epoch 2, rank 1 of 2) and resumed from
    its state_dict yields exactly the rest of the uninterrupted epoch."""
    kw = dict(objective=objective, world_size=2, rank=1, seed=3, shuffle_block=shuffle_block)
    full = make_stream(corpus, tokenizer, **kw)
    full.set_epoch(2)
    reference = list(loader(full, num_workers))
    assert len(reference) > 10
    for k in (1, 5, len(reference) - 2):
        first = make_stream(corpus, tokenizer, **kw)
        first.set_epoch(2)
        it = iter(loader(first, num_workers))
        for _ in range(k):
            first.consumed(next(it)["cursor"])
        del it
        state = first.state_dict()
        resumed = make_stream(corpus, tokenizer, **kw)
        resumed.load_state_dict(state)
        rest = list(loader(resumed, num_workers))
        same_batches(rest, reference[k:])


def real_batches(corpus, tokenizer, world_size, num_workers, epochs, batch_size, **kw):
    """[epoch][rank] -> the sizes of the micro-batches that rank's DataLoader yields, in order."""
    streams = [make_stream(corpus, tokenizer, rank=r, world_size=world_size, batch_size=batch_size, **kw)
               for r in range(world_size)]
    out = []
    for epoch in range(epochs):
        for s in streams:
            s.set_epoch(epoch)
        out.append([[len(b["input_ids"]) for b in loader(s, num_workers)] for s in streams])
    return out


def check_against_stream(corpus, tokenizer, world_size, num_workers, objective, batch_size, epochs):
    """estimate_steps' exact count (for accum 1, 2, 3) is what the ranks' DataLoaders yield. Returns those."""
    import estimate_steps as es
    real = real_batches(corpus, tokenizer, world_size, num_workers, epochs, batch_size, objective=objective)
    stream = make_stream(corpus, tokenizer, objective=objective, batch_size=999, world_size=7)  # both ignored
    for accum in (1, 2, 3):
        r = es.estimate(stream, world_size, num_workers, batch_size, accum, epochs, mode="exact", warmup=0.1)
        assert r["mode"] == "exact" and len(r["per_epoch"]) == epochs
        for epoch, (ranks, got) in enumerate(zip(real, r["per_epoch"], strict=True)):
            steps = min(len(b) for b in ranks) // accum  # every rank needs a full window of accum
            used = sum(sum(b[:steps * accum]) for b in ranks)
            want = {"samples": sum(map(sum, ranks)), "steps": steps,
                    "samples_per_rank_min": min(map(sum, ranks)), "samples_per_rank_max": max(map(sum, ranks)),
                    "micro_batches_per_rank_min": min(map(len, ranks)),
                    "micro_batches_per_rank_max": max(map(len, ranks)),
                    "unused_samples": sum(map(sum, ranks)) - used}
            assert {k: got[k] for k in want} == want, (epoch, accum)
        total = sum(min(len(b) for b in ranks) // accum for ranks in real)
        assert r["total_steps"] == total and r["warmup_steps"] == min(total, max(1, round(0.1 * total)))
        assert r["samples_per_epoch"] == sum(map(sum, real[0])) and r["steps_per_epoch"] == r["per_epoch"][0]["steps"]
    assert not stream.cache.pending  # what the estimator tokenized is in the cache, not in memory to fork
    return real
