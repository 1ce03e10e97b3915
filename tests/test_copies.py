"""The README's copy table ("to use X, copy these files"), row by row: exactly those files are copied into an empty
folder and run there, in a process that cannot see the repository (its working directory is the folder, no
PYTHONPATH): a forward; a few batches; an estimate; a few steps; a fine-tuning on a tiny task."""
import json
import os
import re
import shutil
import subprocess
import sys

import pytest
from conftest import FAST, ROOT, env, make_stream, write_corpus

ROWS = {  # the README's rows, as the test reads them (test_the_readme_s_table_is_this_one)
    "the model": ["model.py"],
    "the data stream": ["data_stream.py"],
    "the estimator": ["estimate_steps.py", "data_stream.py"],
    "the trainer": ["pretrain_ddp.py", "model.py", "data_stream.py", "estimate_steps.py", "checkpoints.py", "ranks.py",
                    "trackers.py", "workers.py", "builtin_corpus.py"],
    "fine-tuning": ["finetune.py", "model.py", "checkpoints.py", "data_stream.py", "estimate_steps.py"],
}


def copied(row, folder):
    os.makedirs(folder)
    for name in ROWS[row]:
        shutil.copy(os.path.join(ROOT, name), folder)
    return str(folder)


# Run first in every copied process: where each project module it imports comes from, said as it is imported.
WHERE = """
import importlib.util, sys
class Where:
    def find_spec(self, name, path=None, target=None):
        if name not in {names!r}:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        print("imported", name, "from", spec and spec.origin, file=sys.stderr, flush=True)
        return spec
sys.meta_path.insert(0, Where())
"""


def run_in(folder, *args, timeout=300):
    """python ARGS (a script and its flags, or -c CODE) in folder, which is all of the project it can import: no
    PYTHONPATH, no user site-packages (-s), and every project module it imports must come from the folder."""
    names = sorted(f[:-3] for f in os.listdir(ROOT) if f.endswith(".py"))
    code = args[1] if args[0] == "-c" else \
        f"import runpy, sys\nsys.argv = {list(args)!r}\nrunpy.run_path({args[0]!r}, run_name='__main__')"
    done = subprocess.run([sys.executable, "-s", "-c", WHERE.format(names=names) + code], cwd=folder,
                          env={k: v for k, v in env().items() if k != "PYTHONPATH"}, capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    imported = re.findall(r"^imported (\w+) from (.*)$", done.stderr, re.M)
    assert all(os.path.dirname(origin) == str(folder) for _, origin in imported), imported
    return done.stdout, {name for name, _ in imported}


def test_the_readme_s_table_is_this_one():
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    table = {}
    for row in ROWS:
        line = re.search(rf"^\| {re.escape(row)} \| (.*?) \|", readme, re.M)
        assert line, f"README.md has no copy-table row '| {row} |'"
        table[row] = re.findall(r"`([\w.]+\.py)`", line[1])
    assert table == ROWS
    # every module the product imports is in some row: a new file cannot slip past the table
    product = {f for f in os.listdir(ROOT) if f.endswith(".py")} - {"arrow_corpus.py"}  # optional: parquet/Arrow
    assert product == {f for files in ROWS.values() for f in files}


def test_model_py_alone_builds_a_model_and_its_forward_is_the_stock_one(tmp_path):
    folder = copied("the model", tmp_path / "model")
    code = """
import torch, model
torch.manual_seed(0)
hf = model.model_from(model.new_architecture("tiny", 100, 32, 0), "nsp", 0.0).eval()
ids = torch.randint(5, 100, (2, 16))
types = torch.zeros_like(ids)
masked_pos, cls_pos = torch.tensor([3, 20, 31]), torch.tensor([0, 16])  # among the flattened rows
with torch.no_grad():
    logits, nsp = model.Pretraining(hf).logits(ids, types, masked_pos, cls_pos=cls_pos)
    stock = hf(input_ids=ids, token_type_ids=types)
print(logits.shape[0], (logits - stock.prediction_logits.flatten(0, 1)[masked_pos]).abs().max().item(),
      (nsp - stock.seq_relationship_logits).abs().max().item())
"""
    out, imported = run_in(folder, "-c", code)
    rows, mlm_off, nsp_off = out.split()
    assert imported == {"model"}
    assert int(rows) == 3 and float(mlm_off) < 1e-4 and float(nsp_off) < 1e-4


@pytest.mark.slow  # a process of its own
def test_data_stream_py_alone_streams_a_text_corpus_with_a_tokenizer_folder(tmp_path, corpus, tok_dir):
    """Its CLI, as a process (test_data_stream.py's bad-corpus process beside it): --show N prints N samples."""
    folder = copied("the data stream", tmp_path / "stream")
    shown, imported = run_in(folder, "data_stream.py", "--corpus", corpus, "--tokenizer", tok_dir, "--show", "3")
    assert shown.count("--- sample") == 3 and "[MASK]" in shown and imported == set()  # it is __main__


@pytest.mark.slow  # a process of its own: the estimator's imports
def test_the_estimator_runs_from_its_two_files_and_its_json_is_the_estimate(tmp_path, corpus, tokenizer, tok_dir):
    """Its CLI, as a process (test_estimate_steps.py: the table and bad input): --json is estimate()'s answer."""
    import estimate_steps
    folder = copied("the estimator", tmp_path / "estimator")
    out, imported = run_in(folder, "estimate_steps.py", "--corpus", corpus, "--tokenizer", tok_dir, "--max-seq-len",
                           "32", "--world-size", "2", "--num-workers", "2", "--epochs", "2", "--warmup", "0.1",
                           "--batch-size", "4", "--accum-steps", "2", "--json")
    assert imported == {"data_stream"}
    r = json.loads(out)
    want = estimate_steps.estimate(make_stream(corpus, tokenizer), 2, 2, 4, 2, 2, warmup=0.1)
    assert r["mode"] == "exact" and r["mode_reason"].startswith("auto:")
    for key in ("samples_per_epoch", "steps_per_epoch", "total_steps", "warmup_steps", "documents", "sentences",
                "tokens", "samples_per_rank_min", "samples_per_rank_max", "micro_batches_per_rank_min",
                "micro_batches_per_rank_max", "unused_samples", "per_epoch", "total_steps_ci"):
        assert r[key] == want[key], key
    assert r["total_steps"] > 10 and r["warmup_steps"] == max(1, round(0.1 * r["total_steps"]))


@pytest.mark.slow  # two processes: a trainer and a fine-tuning
def test_the_trainer_and_finetune_run_from_their_files(tmp_path, tok_dir):
    corpus = write_corpus(tmp_path / "corpus.txt", 60)
    trainer = copied("the trainer", tmp_path / "trainer")
    _, imported = run_in(trainer, "pretrain_ddp.py", "--corpus", corpus, "--tokenizer", tok_dir, "--eval-corpus",
                         "none", "--out-dir", "run", *FAST, "--max-steps", "3")
    # every file of the row but the script itself and builtin_corpus.py (only --corpus builtin reads it)
    assert imported == {f.removesuffix(".py") for f in ROWS["the trainer"]} - {"pretrain_ddp", "builtin_corpus"}
    run = os.path.join(trainer, "run")
    with open(os.path.join(run, "summary.json")) as f:
        assert json.load(f)["steps"] == 3
    assert os.path.exists(os.path.join(run, "hf", "config.json"))
    tune = copied("fine-tuning", tmp_path / "finetune")
    with open(os.path.join(tune, "task.csv"), "w") as f:
        f.write("label,text\n" + "".join(f"yes,river stone {i}\n" if i % 2 else f"no,paper engine {i}\n"
                                          for i in range(80)))
    _, imported = run_in(tune, "finetune.py", run, "--task", "task.csv", "--seeds", "1", "--epochs", "1", "--out",
                         "scores.json")
    assert imported == {"model", "checkpoints", "data_stream", "estimate_steps"}  # not pretrain_ddp
    with open(os.path.join(tune, "scores.json")) as f:
        scores = json.load(f)
    assert 0.0 <= scores["accuracy_mean"] <= 1.0 and len(scores["seeds"]) == 1
