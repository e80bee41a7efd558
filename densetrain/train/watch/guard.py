"""The guard: non-finite steps and loss spikes are skipped; repeated trouble rolls the run back.

Rules (config ``[guard]``; the numbers are reduced over ranks, so every rank decides the same):

- A non-finite loss or gradient on any rank: skip the update (parameters and optimizer state,
  moments and step count included, are untouched). ``train.max_nonfinite_steps`` in a row: roll back
  (or stop with an error when ``guard.rollback = false`` or there is no checkpoint to go back to).
- A loss spike: a z-score of the loss over the last ``guard.window`` accepted losses above
  ``guard.spike_zscore`` (and the loss above ``guard.min_ratio`` x the window's centre). One spike:
  skip. ``guard.patience`` spikes within ``guard.window`` steps: roll back to the newest checkpoint at
  or before the first of them. Spikes and non-finite losses never enter the window.
- A stage's first step starts a new window (said in a ``guard`` event): a stage switch (another mix, seq_len,
  RoPE base, lr) moves the loss level on purpose, and against the previous stage's window the first steps
  of the new one read as spikes (a mix switch and RoPE base change of the test corpus: z 6.3 two steps
  in; a larger shift, three of them in a row, rolled the run back to before the switch, and after
  ``guard.max_rollbacks`` every step of the stage was skipped). Spikes are judged again once the window holds
  ``guard.min_history`` losses of the stage and the stage's lr re-warmup (``rewarmup_steps``) is over, as
  the run's first ``guard.min_history`` steps are waited out. Non-finite steps are judged throughout. A window
  restored from a checkpoint (a resume) is taken to be of the stage of the last step taken (the step before the
  first one judged),
  so a resume at a stage's first step starts the new window there too; a rollback to a step of another stage
  than the window's starts one as well (spikes are then not judged for ``guard.min_history`` steps).

Two z-scores (``guard.zscore``), both one-sided (a sudden drop of the loss is never skipped):

- ``robust`` (default): ``(loss - median) / (1.4826 * MAD)``, MAD the median absolute deviation;
  1.4826 makes it a consistent estimate of the standard deviation of normal data (Rousseeuw & Croux
  1993). The default because a few high but accepted losses in the window (a noisy source, the
  start of a stage) inflate a standard deviation and hide the next spike, and barely move the median
  and MAD (breakdown point 50%, against 0 for mean/std; Leys et al. 2013, "Detecting outliers: do
  not use standard deviation around the mean, use absolute deviation around the median").
- ``mean_std``: ``(loss - mean) / std`` with the sample standard deviation (n - 1), OLMo-core's
  ``SkipStepOptimizer`` (``sigma_factor`` 6 over ``rolling_interval_length`` 128, the defaults here
  too; it also skips losses that far below the mean). It flags more on a loss that alternates
  between two levels: on 2.9/3.1 alternating, 3.7 has z 6.8 here and 4.7 robust, so it is a spike at
  6 for OLMo-core and not for the default.

The lr schedule is a function of the step counter, which counts skipped steps: a skipped step uses up
its lr as if it had been applied (as OLMo-core and torchtitan do), so a run with skips ends at the
same step with the same final lr. A rollback restores the counter of the checkpoint.

Step numbers: a skip event is stamped, as every event, with the update's index (``[step 7]``, the
faults' ``step``); metrics.jsonl counts the steps completed, so that update is its record of step 8 and
``densetrain replay RUN 8``, which the event's text says.
"""

from __future__ import annotations

import math
from collections import deque

import numpy as np
import torch

from densetrain.config.recovery import GuardConfig
from densetrain.errors import TrainError
from densetrain.schedule import stage_at
from densetrain.train.watch.spikes import rank_partials, start_replay
from densetrain.train.watchers import Verdict, Watcher


def loss_z(loss: float, history, method: str = "robust") -> tuple[float, float]:
    """(z, centre) of ``loss`` against ``history`` (at least one value) by ``method`` (module docstring):
    'robust': median-based z and the median; 'mean_std': mean / sample-std z (std 0 for one value) and the
    mean."""
    h = np.asarray(history, dtype=np.float64)
    if method == "robust":
        centre = float(np.median(h))
        spread = 1.4826 * float(np.median(np.abs(h - centre)))
    else:
        centre, spread = float(h.mean()), float(h.std(ddof=1)) if len(h) > 1 else 0.0
    return (loss - centre) / (spread + 1e-12), centre


class Guard(Watcher):
    """Skip / roll back on non-finite steps and loss spikes (module docstring)."""

    name = "guard"

    def __init__(self, cfg: GuardConfig, max_nonfinite: int):
        self.cfg, self.max_nonfinite = cfg, max_nonfinite
        self.history: deque[float] = deque(maxlen=cfg.window)
        self.spikes: list[int] = []  # update indices of recent spikes
        self.streak = 0  # consecutive non-finite steps
        self.streak_start = 0
        self.rollbacks = 0
        self.lr_scale_until = -1  # steps < this use guard.lr_factor (after a rollback)
        self.stage: int | None = None  # index of the stage whose losses the window holds (None: not known yet)

    def _enter(self, run, result) -> None:
        """Start a new window at a stage's first step (module docstring); a result without its stage (a
        judgement outside a run) keeps the window."""
        if result.stage is None:
            return
        if self.stage is None:  # the stage of the last step taken (-1 before the first); by index: names may repeat
            self.stage = stage_at(result.index - 1, run.stages).index if result.index else -1
        st = result.stage
        if st.index == self.stage:
            return
        fresh = self.stage >= 0  # not at the run's first step (the window is empty then anyway)
        self.stage, self.spikes = st.index, []
        self.history.clear()
        if fresh:
            wait = max(self.cfg.min_history, st.rewarmup_steps - (result.index - st.start_step))
            run.log.event(result.index, f"guard: stage '{st.name}' starts a new loss window; loss spikes are judged "
                                        f"again after {wait} steps of it (its first {self.cfg.min_history} accepted "
                                        "losses" + (f", its lr re-warmup of {st.rewarmup_steps} steps" if
                                                    st.rewarmup_steps else "") + ")",
                          kind="guard", action="new_window",
                          values={"stage": st.name, "min_history": self.cfg.min_history,
                                  "rewarmup_steps": st.rewarmup_steps})

    def _spike(self, loss: float, result) -> tuple[bool, float, float]:
        st = result.stage
        if (self.cfg.spike_zscore <= 0 or len(self.history) < self.cfg.min_history
                or (st is not None and result.index - st.start_step < st.rewarmup_steps)):  # the lr's bump
            return False, 0.0, 0.0
        z, centre = loss_z(loss, self.history, self.cfg.zscore)
        return z > self.cfg.spike_zscore and loss > self.cfg.min_ratio * centre, z, centre

    def on_grads(self, run, stats) -> None:
        self.local = (stats.loss_sum, stats.n_tokens)  # this rank's part, for the events (train/watch/spikes.py)

    def before_step(self, run) -> None:
        run.lr_scale = self.cfg.lr_factor if run.state.step < self.lr_scale_until else 1.0

    def judge(self, run, result) -> Verdict:
        self._enter(run, result)
        if not result.finite:
            if self.streak + 1 < self.max_nonfinite:
                return Verdict.SKIP
            result.rollback_before = self.streak_start if self.streak else result.index
            return self._rollback_or_stop(result, f"{self.streak + 1} consecutive non-finite steps",
                                          weights=_nonfinite_weight(run))
        spike, _, _ = self._spike(result.loss, result)
        if not spike:
            return Verdict.APPLY
        recent = [s for s in self.spikes if result.index - s < self.cfg.window] + [result.index]
        if len(recent) < self.cfg.patience:
            return Verdict.SKIP
        result.rollback_before = recent[0]
        return self._rollback_or_stop(result, f"{len(recent)} loss spikes within {self.cfg.window} steps", stop=False)

    def _rollback_or_stop(self, result, why: str, stop: bool = True, weights: str = "") -> Verdict:
        """``weights``: the name of a non-finite weight of this rank ('' when all are finite)."""
        if self.cfg.rollback and self.rollbacks < self.cfg.max_rollbacks:
            return Verdict.ROLLBACK
        if stop and weights:  # skipped steps never write a non-finite update: the weights came so (a load, memory)
            raise TrainError(f"{why} (last at step {result.index}): the weights themselves are not finite "
                             f"({weights}), so every step is; not an lr problem: check the checkpoint resumed or "
                             "rolled back to, and the machine's memory")
        if stop:
            raise TrainError(f"{why} (last at step {result.index}): the weights or the lr are broken; "
                             + ("rollbacks are off (guard.rollback = false); " if not self.cfg.rollback else
                                f"{self.rollbacks} rollbacks did not help; ")
                             + "resume from an earlier checkpoint with a lower optim.peak_lr")
        return Verdict.SKIP  # spikes without a rollback left: keep skipping them

    def after_step(self, run, result, verdict: Verdict) -> None:
        vals = {"loss": result.loss, "grad_norm": result.grad_norm, "sample_index": result.first_sample}
        if verdict == Verdict.APPLY:
            self.streak = 0
            self.history.append(result.loss)
            return
        if verdict == Verdict.ROLLBACK:
            self.rollbacks += 1
            self.streak, self.spikes = 0, []
            if self.cfg.lr_factor_steps:
                self.lr_scale_until = run.state.step + self.cfg.lr_factor_steps
            return
        if not result.finite:
            if self.streak == 0:
                self.streak_start = result.index
            self.streak += 1
            run.log.event(result.index, f"{nonfinite_what(result)} (loss {result.loss}, grad_norm {result.grad_norm}): "
                          f"update skipped ({run.state.skipped_steps} so far; {_as_metrics(result.index)})",
                          kind="nonfinite", action="skip",
                          values={**vals, **run.batch_documents(result),
                                  "ranks": rank_partials(run, self.local, result.grad_norm)})
            if self.cfg.replay:
                start_replay(run, result.index)
            return
        spike, z, med = self._spike(result.loss, result)
        self.spikes = [s for s in self.spikes if result.index - s < self.cfg.window] + [result.index]
        centre = "median" if self.cfg.zscore == "robust" else "mean"
        run.log.event(result.index, f"loss spike {result.loss:.4f} ({centre} {med:.4f}, z {z:.1f}): update skipped "
                      f"({_as_metrics(result.index)})",
                      kind="loss_spike", action="skip",
                      values={**vals, "z": z, "median": med, **run.batch_documents(result),
                              "ranks": rank_partials(run, self.local, result.grad_norm)})
        if self.cfg.replay:
            start_replay(run, result.index)

    def state_dict(self) -> dict:
        return {"history": list(self.history), "spikes": self.spikes}

    def load_state_dict(self, d: dict) -> None:
        """Raises: ValueError: a saved list longer than ``guard.window`` (the caller names the file)."""
        for key in ("history", "spikes"):
            if len(d.get(key, [])) > self.cfg.window:
                raise ValueError(f"watchers.guard.{key}: expected at most guard.window ({self.cfg.window}) "
                                 f"values, got {len(d[key])}")
        self.history.extend(d.get("history", []))
        self.spikes = list(d.get("spikes", []))


def _nonfinite_weight(run) -> str:
    """Name of the first parameter of ``run.model`` with a non-finite value in this rank's part ('' if none)."""
    for name, p in run.model.named_parameters():
        t = p.to_local() if hasattr(p, "to_local") else p
        if not bool(torch.isfinite(t.detach()).all()):
            return name
    return ""


def nonfinite_what(result) -> str:
    """What was not finite in a skipped step, for its event: ``"non-finite loss and grad_norm"``, ``"non-finite
    grad_norm"``, ... or, when both global numbers are finite, the ranks whose own loss or gradient norm was not
    (a rank's overflowed gradient that the reduction did not carry, e.g. a flipped exponent bit)."""
    bad = [name for name, v in (("loss", result.loss), ("grad_norm", result.grad_norm)) if not math.isfinite(v)]
    if bad:
        return "non-finite " + " and ".join(bad)
    n = result.stats.nonfinite_ranks
    return f"non-finite loss or grad_norm on {n} rank{'' if n == 1 else 's'}"


def _as_metrics(index: int) -> str:
    """Where the skipped update ``index`` is in metrics.jsonl and for ``densetrain replay``: events are stamped
    with the update's index (the ``[step N]`` prefix, as the faults' ``step``), metrics records with the steps
    completed, index + 1."""
    return f"metrics.jsonl step {index + 1}, densetrain replay RUN {index + 1}"
