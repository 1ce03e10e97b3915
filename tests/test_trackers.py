"""--log-to mlflow and --log-to wandb with the packages really installed: what a run logs is read back
with each tracker's own reader (MlflowClient; W&B's offline transaction log), and a resume continues
the same tracker run."""
import json
import os
import signal
import struct

import pytest
from conftest import FAST, logged, plain, run, summary

pytestmark = pytest.mark.slow  # every test here starts the trainer



def stop_at(prefix):
    """on_line for run: SIGTERM to the trainer (it saves and exits) once a stdout line starts with prefix."""
    def on_line(line, proc):
        if line.startswith(prefix):
            proc.send_signal(signal.SIGTERM)
    return on_line


def latest_meta(out_dir):
    root = os.path.join(out_dir, "checkpoints")
    with open(os.path.join(root, "latest")) as f:
        with open(os.path.join(root, f.read().strip(), "manifest.json")) as m:
            return json.load(m)["meta"]


def wandb_records(path):
    """The records of a W&B transaction log (run-<id>.wandb): a ':W&B' header, then LevelDB's log
    format, 32 KiB blocks of chunks that each have a 7-byte header (crc32, length, type)."""
    from wandb.proto import wandb_internal_pb2
    with open(path, "rb") as f:
        data = f.read()
    assert data[:4] == b":W&B", path
    pos, record = 7, b""
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        record, pos = record + data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind in (1, 4):  # FULL or LAST: the record is complete
            parsed = wandb_internal_pb2.Record()
            parsed.ParseFromString(record)
            yield parsed
            record = b""


def wandb_offline_run(run_dir):
    """(run id, display name, summary) of an offline run folder: the summary as W&B folds its updates."""
    [log] = [os.path.join(run_dir, n) for n in os.listdir(run_dir) if n.endswith(".wandb")]
    run_id, name, summary = None, None, {}
    for record in wandb_records(log):
        if record.HasField("run"):
            run_id, name = record.run.run_id, record.run.display_name
        if record.HasField("summary"):
            for item in record.summary.update:
                summary[item.key or "/".join(item.nested_key)] = json.loads(item.value_json)
    return run_id, name, summary


def test_mlflow_and_wandb_log_the_run_and_a_resume_continues_both(tmp_path, corpus, tok_dir):
    db = tmp_path / "tracking.db"
    uri = f"sqlite:///{db}"
    out = str(tmp_path / "run")
    args = ["--corpus", corpus, "--tokenizer", tok_dir, "--eval-corpus", corpus, "--out-dir", out, *FAST,
            "--eval-every", "2", "--save-every", "2", "--log-to", "stdout,mlflow,wandb"]
    variables = {"MLFLOW_TRACKING_URI": uri, "MLFLOW_EXPERIMENT_NAME": "bert-test", "WANDB_MODE": "offline"}
    first = run(plain(*args, "--max-steps", "6"), stop_at("step 4:"), cwd=tmp_path, env=variables)  # saves, exits
    assert first.returncode == 0 and "stopped by signal" in first.stdout, first.stderr[-3000:]
    second = run(plain(*args, "--max-steps", "6", "--keep-last", "5"), cwd=tmp_path, env=variables)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resumed from" in second.stdout and "mlflow: continuing run" in second.stdout
    s = summary(out)
    kept = latest_meta(out)["tracker_runs"]

    from mlflow import MlflowClient
    client = MlflowClient(uri)
    experiment = client.get_experiment_by_name("bert-test")
    [mlflow_run] = client.search_runs([experiment.experiment_id])  # one run: the resume continued it
    assert kept["mlflow"] == mlflow_run.info.run_id
    assert mlflow_run.info.run_name == "run" and mlflow_run.info.status == "FINISHED"
    params, tags = mlflow_run.data.params, mlflow_run.data.tags
    assert params["batch_size"] == "4" and params["max_seq_len"] == "32" and params["out_dir"] == out
    assert params["keep_last"] == "3" and tags["resumed/keep_last"] == "5"  # params are write-once
    # the train loss at every logged step, as the stdout sink printed it in both processes
    losses = {m.step: m.value for m in client.get_metric_history(mlflow_run.info.run_id, "train/loss")}
    expected = {**logged(first.stdout, "train/loss"), **logged(second.stdout, "train/loss")}
    assert sorted(losses) == sorted(expected) == [1, 2, 3, 4, 5, 6]
    assert all(losses[step] == pytest.approx(expected[step], rel=1e-3) for step in expected)
    assert losses[6] == pytest.approx(s["train_loss"], rel=1e-9)
    evals = client.get_metric_history(mlflow_run.info.run_id, "eval/mlm_loss")
    assert {2, 4, 6} <= {m.step for m in evals}  # (and the step the signal stopped at, if not 4)
    assert mlflow_run.data.metrics["eval/mlm_loss"] == pytest.approx(s["eval"]["eval/mlm_loss"], rel=1e-9)

    # W&B offline: one folder per process, both of the run kept in the checkpoint
    folders = sorted(n for n in os.listdir(os.path.join(out, "wandb")) if n.startswith("offline-run-"))
    runs = [wandb_offline_run(os.path.join(out, "wandb", n)) for n in folders]
    assert len(runs) == 2 and runs[0][0] == runs[1][0] == kept["wandb"]
    _, name, last = runs[1]
    assert name == "run" and last["step"] == 6
    assert last["train/loss"] == pytest.approx(s["train_loss"], rel=1e-9)
    assert last["eval/mlm_loss"] == pytest.approx(s["eval"]["eval/mlm_loss"], rel=1e-9)


def test_mlflow_default_is_a_database_in_the_working_directory(tmp_path, corpus, tok_dir):
    work = tmp_path / "work"
    work.mkdir()
    result = run(plain("--corpus", corpus, "--tokenizer", tok_dir, "--eval-corpus", "none", "--out-dir", "run", *FAST,
                       "--max-steps", "2", "--log-to", "stdout,mlflow"), timeout=180, cwd=work)
    assert result.returncode == 0, result.stderr[-3000:]
    uri = f"sqlite:///{work / 'mlflow.db'}"
    assert f"open it with: mlflow ui --backend-store-uri {uri}" in result.stdout

    from mlflow import MlflowClient
    client = MlflowClient(uri)
    [mlflow_run] = client.search_runs(["0"])
    losses = client.get_metric_history(mlflow_run.info.run_id, "train/loss")
    assert [m.step for m in losses] == [1, 2]


# On PYTHONPATH of the trainer: counts its connection attempts to port 9 (in a file, as they happen).
COUNT_CONNECTS = """
import os, socket
_connect, _tries = socket.socket.connect, []


def connect(self, address):
    if isinstance(address, tuple) and address[1:2] == (9,):
        _tries.append(address)
        with open(os.environ["CONNECTS_TO_PORT_9"], "w") as f:
            f.write(str(len(_tries)))
    return _connect(self, address)


socket.socket.connect = connect
"""


def test_unreachable_mlflow_server_one_warning_and_the_run_finishes(tmp_path, corpus, tok_dir):
    """MLflow's defaults retry a refused connection 7 times with a backoff doubling from 2 s (minutes
    of a stalled run); the trainer's retry 2 times. Counted, not timed: the verdict does not depend
    on the machine's load (the defaults would also outlast run()'s limit, which kills the run)."""
    out, counter, patch = tmp_path / "run", tmp_path / "connects", tmp_path / "count_connects"
    patch.mkdir()
    (patch / "sitecustomize.py").write_text(COUNT_CONNECTS)
    result = run(plain("--corpus", corpus, "--tokenizer", tok_dir, "--eval-corpus", "none", "--out-dir", str(out),
                       *FAST, "--max-steps", "2", "--log-to", "stdout,mlflow"), timeout=180, cwd=tmp_path,
                 env={"MLFLOW_TRACKING_URI": "http://127.0.0.1:9",  # the discard port: nothing listens
                      "PYTHONPATH": str(patch), "CONNECTS_TO_PORT_9": str(counter)})
    assert result.returncode == 0, result.stderr[-3000:]
    assert counter.read_text() == "3"  # one request, tried once and retried twice, then mlflow is dropped
    warnings = [line for line in result.stderr.splitlines() if "mlflow" in line.lower()]
    assert len(warnings) == 1 and warnings[0].startswith("warning: --log-to mlflow:"), result.stderr
    assert "Traceback" not in result.stderr and "MLFLOW_TRACKING_URI" in warnings[0]
    assert (out / "summary.json").exists() and logged(result.stdout, "train/loss").keys() == {1, 2}


def test_wandb_not_installed_is_one_line_naming_the_package(tmp_path, corpus, tok_dir):
    hidden = tmp_path / "hidden" / "wandb"  # as when it is not installed, whatever this machine has
    hidden.mkdir(parents=True)
    (hidden / "__init__.py").write_text("raise ImportError(\"No module named 'wandb'\")\n")
    result = run(plain("--corpus", corpus, "--tokenizer", tok_dir, "--out-dir", str(tmp_path / "o"),
                       "--log-to", "stdout,wandb"), timeout=300, cwd=tmp_path, env={"PYTHONPATH": str(hidden.parent)})
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines() == [
        "pretrain_ddp.py: error: --log-to wandb needs the wandb package: pip install wandb "
        "(or drop wandb from --log-to)"]
