"""The training loop's own counters, saved in every checkpoint's ``trainer_state.json``."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields


@dataclass
class TrainState:
    """Where the run is.

    Attributes:
        step: optimizer steps taken (applied or skipped); the next update has index ``step``.
        tokens: target tokens consumed, summed over ranks (skipped steps included: their data was read).
        skipped_steps: updates not applied (non-finite loss or gradients).
        stage: name of the stage of the last step ('' before the first).
    """

    step: int = 0
    tokens: int = 0
    skipped_steps: int = 0
    stage: str = ""

    def state_dict(self) -> dict:
        return asdict(self)

    def load_state_dict(self, d: dict) -> None:
        """Restore from a ``trainer_state.json`` (keys absent in older checkpoints keep their defaults)."""
        for f in fields(self):
            if f.name in d:
                setattr(self, f.name, type(getattr(self, f.name))(d[f.name]))
