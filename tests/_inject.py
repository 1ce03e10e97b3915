"""Test-only: pretrain_ddp.py with faults injected (issue 39); no flag a user sees does this.
Usage: INJECT="nan_grad=RANK:STEP,STEP,...;nan_weights=STEP" python tests/_inject.py [pretrain_ddp.py flags]
- nan_grad: that rank's loss (so its gradient, and after DDP's all_reduce every rank's) is NaN at those
  optimizer steps (1-based, as the log counts them);
- nan_weights: a weight is NaN after that step (what a skipped update can never cause: only this)."""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import model as M  # noqa: E402
import pretrain_ddp as P  # noqa: E402
import ranks  # noqa: E402

if __name__ == "__main__":  # DataLoader workers start from a forkserver, which runs this file again
    spec = dict(part.split("=") for part in os.environ["INJECT"].split(";") if part)
    rank, steps = spec.get("nan_grad", "-1:").split(":")
    nan_steps = {int(s) for s in steps.split(",") if s}
    nan_weights_at = int(spec.get("nan_weights", -1))
    state = {"step": 0, "poison": False}
    train_step, count_step, restore, forward = P.train_step, P.count_step, P.restore, M.Pretraining.forward

    def poisoned_forward(self, *args, **kwargs):
        out = forward(self, *args, **kwargs)
        return out * float("nan") if state["poison"] else out

    def injected_train_step(trainer, *args, **kwargs):
        state["poison"] = ranks.GROUP.rank == int(rank) and state["step"] + 1 in nan_steps
        try:
            result = train_step(trainer, *args, **kwargs)
        finally:
            state["poison"] = False
        if state["step"] + 1 == nan_weights_at:
            with P.torch.no_grad():
                next(trainer.raw_model.parameters()).view(-1)[0] = float("nan")
        return result

    def counted(meter, progress, *args):
        count_step(meter, progress, *args)
        state["step"] = progress.step

    def restored(*args):
        progress, *rest = restore(*args)
        state["step"] = progress.step
        return (progress, *rest)

    M.Pretraining.forward = poisoned_forward
    P.train_step = injected_train_step
    P.count_step = counted
    P.restore = restored
    P.cli()
