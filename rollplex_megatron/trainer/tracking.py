"""Experiment trackers beside metrics.jsonl: TensorBoard event files (`train.tensorboard=true`, in
`<run dir>/tensorboard/`) and wandb in offline mode (`train.wandb=true`, needs the wandb package;
`<run dir>/wandb/`, `wandb sync` uploads it later). Both get the same scalars as metrics.jsonl, at the
record's step."""
from __future__ import annotations

from pathlib import Path

from torch.utils.tensorboard import SummaryWriter

try:  # optional: not a pinned dependency
    import wandb
except ImportError:
    wandb = None


def scalars(rec: dict, prefix: str = "") -> dict[str, float]:
    """The numeric leaves of a metrics record, nested dicts flattened with '/' (`phase_times/update`)."""
    out = {}
    for k, v in rec.items():
        if isinstance(v, dict):
            out.update(scalars(v, f"{prefix}{k}/"))
        elif isinstance(v, (int, float)) and not isinstance(v, bool) and k not in ("step", "kind"):
            out[f"{prefix}{k}"] = float(v)
    return out


def check_tracking(use_wandb: bool) -> None:
    """`train.wandb=true` needs the package (checked before any process starts)."""
    if use_wandb and wandb is None:
        raise ValueError("train.wandb=true needs the wandb package (pip install wandb); it runs offline, "
                         "`wandb sync <run dir>/wandb/offline-run-*` uploads later")


class Tracker:
    """Writes every record it is given to the enabled trackers (rank 0 only)."""

    def __init__(self, run: Path, tensorboard: bool, use_wandb: bool, config: dict, name: str, start: int = 0):
        """`start`: the step a resumed run continues after; TensorBoard drops the events it holds from later steps
        (logged after that checkpoint, before the interruption), as metrics.jsonl is cut back."""
        check_tracking(use_wandb)
        self.tb = None
        if tensorboard:
            self.tb = SummaryWriter(str(run / "tensorboard"), purge_step=start + 1 if start else None)
        self.wb = wandb.init(mode="offline", dir=str(run), config=config, name=name) if use_wandb else None

    def log(self, rec: dict) -> None:
        """A step's or a validation run's scalars at its step."""
        values = scalars(rec)
        if self.tb is not None:
            for k, v in values.items():
                self.tb.add_scalar(k, v, global_step=rec["step"])
            self.tb.flush()
        if self.wb is not None:
            self.wb.log(values, step=rec["step"])

    def close(self) -> None:
        """Flush and close the writers."""
        if self.tb is not None:
            self.tb.close()
        if self.wb is not None:
            self.wb.finish()
