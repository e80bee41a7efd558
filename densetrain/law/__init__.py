"""Scaling laws (pure math: numpy and scipy, no torch), and the ladder files they are fitted from.

- :mod:`~densetrain.law.fits`: the forms (Chinchilla's approaches 2 and 3, the schedule-aware curve, the
  accuracy sigmoid, the compute multiplier), their fits, bootstrap intervals and predictions;
- :mod:`~densetrain.law.files`: ``ladder.json``, ``ladder.jsonl``, a point's ``summary.json`` and ``fit.json``
  read through the bounded readers of :mod:`densetrain.fileio` and checked value by value (one line naming
  file, line and key);
- :mod:`~densetrain.law.trajectory`: the ladder's trajectory law (one law over every run's loss trajectory: a
  new run's final loss from its N and lr schedule), its fit and bootstrap over runs;
- :mod:`~densetrain.law.judge`: when a ladder's fit is degenerate (and what to run next), the cross-check against
  the power law in compute, when a prediction is withheld;
- :mod:`~densetrain.law.forecast`: a run's final loss forecast from its own validations.

Used by ``densetrain ladder`` (the fits), ``plan`` (a prediction), the training watcher
``train/watch/curve.py`` and the report's scaling panel. The names below are the fits' (``from densetrain.law
import fit_law``).
"""

from densetrain.law.fits import (
    ANNEAL_MOMENTUM,
    HUBER_DELTA,
    LEVEL,
    Curve,
    Interval,
    IsoFlop,
    Law,
    Sigmoid,
    bootstrap_isoflop,
    bootstrap_law,
    budget_groups,
    compute_multiplier,
    fit_accuracy,
    fit_compute_power,
    fit_curve,
    fit_isoflop,
    fit_law,
    fit_prediction,
    frontier,
    huber,
    isoflop_intervals,
    law_intervals,
    law_vector,
    multiplier_intervals,
    predict,
    schedule_areas,
)
from densetrain.law.trajectory import Trajectory, bootstrap_trajectory, fit_trajectory, predict_trajectory

__all__ = ["ANNEAL_MOMENTUM", "HUBER_DELTA", "LEVEL", "Curve", "Interval", "IsoFlop", "Law", "Sigmoid",
           "bootstrap_isoflop", "bootstrap_law", "budget_groups", "compute_multiplier", "fit_accuracy",
           "fit_compute_power", "fit_curve", "fit_isoflop", "fit_law", "fit_prediction", "frontier", "huber",
           "isoflop_intervals", "law_intervals", "law_vector", "multiplier_intervals", "predict", "schedule_areas",
           "Trajectory", "bootstrap_trajectory", "fit_trajectory", "predict_trajectory"]
