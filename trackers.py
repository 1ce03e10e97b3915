"""
Where pretrain_ddp.py's scalars go, --log-to: stdout, TensorBoard, and the experiment trackers MLflow and
Weights & Biases.

A leaf: it imports nothing of the training scripts, and TensorBoard's writer, mlflow and wandb only when --log-to
names them (the core runs without the trackers' packages). Each start_* returns (log(scalars, step), finish(),
run id); given the resumed checkpoint's run id a tracker continues that run. `say` prints a line of the
trainer's (stdout), `warn` one on stderr.
"""

import json
import os


def failed_line(name, error):
    """One line for a tracker dropped, not its client's traceback: the run is worth more than its logs."""
    message = str(error).strip().splitlines()[0].rstrip(".") if str(error).strip() else type(error).__name__
    if len(message) > 300:  # a client's wrapped errors: what was tried comes first, the cause last
        message = f"{message[:140]} ... {message[-140:]}"
    fix = {"mlflow": "check MLFLOW_TRACKING_URI", "wandb": "wandb login, or WANDB_MODE=offline"}.get(name, "")
    fix = f"{fix}, or " if fix else ""
    return f"warning: --log-to {name}: {message}; training goes on without {name} ({fix}drop it from --log-to)"


def start_stdout(out_dir, config, run_id, say, warn):
    def log(scalars, step):
        say(f"step {step}: " + ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                                         for k, v in scalars.items()))
    return log, lambda: None, None


def start_tensorboard(out_dir, config, run_id, say, warn):
    """Event files in the out dir: `tensorboard --logdir runs` shows every run (a resume appends)."""
    from torch.utils.tensorboard import SummaryWriter
    writer = SummaryWriter(out_dir)
    writer.add_text("config", json.dumps(config, indent=1))

    def log(scalars, step):
        for k, v in scalars.items():
            writer.add_scalar(k, v, step)
    return log, writer.close, None


def start_mlflow(out_dir, config, run_id, say, warn):
    """The out dir's MLflow run; run_id: the resumed checkpoint's, continued.
    MLFLOW_TRACKING_URI and MLFLOW_EXPERIMENT_NAME say where, as MLflow users expect; without them a
    sqlite database in the working directory, MLflow's recommended local backend (its file store,
    ./mlruns, is in maintenance mode and refuses to start)."""
    # MLflow's defaults (a 120 s timeout, 7 retries with backoff from 2 s doubling) would stall training
    # for many minutes on a server that does not answer; these give up within ~35 s (a refused
    # connection: ~4 s). The user's values win.
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "1")
    import mlflow
    from mlflow.exceptions import MlflowException
    if not os.environ.get("MLFLOW_TRACKING_URI"):
        mlflow.set_tracking_uri("sqlite:///" + os.path.abspath("mlflow.db"))
    uri = mlflow.get_tracking_uri()
    active = None
    if run_id:
        try:
            active = mlflow.start_run(run_id=run_id)
        except MlflowException as e:
            if e.error_code != "RESOURCE_DOES_NOT_EXIST":
                raise
            warn(f"warning: --log-to mlflow: the checkpoint's run {run_id} is not at {uri}; starting a new run")
    if active is None:
        active = mlflow.start_run(run_name=os.path.basename(out_dir))
    params, logged = {k: str(v) for k, v in config.items()}, active.data.params  # a resumed run has some
    mlflow.log_params({k: v for k, v in params.items() if k not in logged})
    # Params are write-once in MLflow: a value this resume changed (e.g. --max-steps) goes to a tag.
    changed = {f"resumed/{k}": v for k, v in params.items() if k in logged and logged[k] != v}
    if changed:
        mlflow.set_tags(changed)
    run_id, experiment = active.info.run_id, active.info.experiment_id
    where = f"{uri}/#/experiments/{experiment}/runs/{run_id}" if uri.startswith("http") else \
        f"mlflow ui --backend-store-uri {uri}"
    say(f"mlflow: {'continuing' if logged else 'new'} run {run_id} (experiment {experiment}) at {uri}; "
        f"open it with: {where}")
    return (lambda s, step: mlflow.log_metrics(s, step=step)), mlflow.end_run, run_id


def start_wandb(out_dir, config, run_id, say, warn):
    """The out dir's W&B run; run_id: the resumed checkpoint's, continued.
    The WANDB_* variables apply as W&B users expect (WANDB_PROJECT, WANDB_ENTITY, WANDB_MODE=offline
    for no network, ...); by default the run is named after the out dir and its files go in it."""
    # wandb waits 90 s (+10) for a server that does not answer; training goes on after ~30 s. The user's value wins.
    os.environ.setdefault("WANDB_INIT_TIMEOUT", "20")
    import wandb
    run = wandb.init(config=config, id=run_id, resume="allow" if run_id else None,
                     name=None if os.environ.get("WANDB_NAME") else os.path.basename(out_dir),
                     dir=None if os.environ.get("WANDB_DIR") else out_dir)
    # Our step, not wandb's own: wandb drops a step below the run's last one, which is what a resume
    # from a checkpoint older than the last log sends.
    run.define_metric("step")
    run.define_metric("*", step_metric="step")
    return (lambda s, step: run.log({**s, "step": step})), run.finish, run.id


STARTS = {"stdout": start_stdout, "tensorboard": start_tensorboard, "mlflow": start_mlflow, "wandb": start_wandb}


class Logger:
    """The sinks named (keys of STARTS): log(scalars, step) writes to each, close() ends them. runs: the
    trackers' {name: run id}, kept in the trainer's checkpoints: given the resumed checkpoint's, each tracker
    continues its run. A sink that fails (no server, no login, a server gone mid-run) is dropped with one
    warning line: training goes on."""

    def __init__(self, names, out_dir, config, runs, say, warn):
        self.live = {}
        self.warn = warn
        self.runs = dict(runs)
        for name in names:
            try:
                write, finish, run_id = STARTS[name](out_dir, config, self.runs.get(name), say, warn)
            except Exception as e:  # whatever the tracker's client raises: it must not end the training
                warn(failed_line(name, e))
                continue
            self.live[name] = (write, finish)
            if run_id is not None:
                self.runs[name] = run_id

    def __call__(self, scalars, step):
        for name, (write, _) in list(self.live.items()):
            try:
                write(scalars, step)
            except Exception as e:
                self.warn(failed_line(name, e))
                del self.live[name]

    def close(self):
        for name, (_, finish) in self.live.items():
            try:
                finish()
            except Exception as e:
                self.warn(failed_line(name, e))
