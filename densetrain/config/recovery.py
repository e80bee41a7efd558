"""Sections that watch a run and act on trouble: ``[guard]`` (non-finite and spike handling, rollback),
``[watchdog]`` (throughput and hangs), ``[probe]`` (data quality) and ``[[faults]]`` (injected faults
for rehearsal and tests). Used by the watchers of :mod:`densetrain.train`."""

from __future__ import annotations

from dataclasses import dataclass

from densetrain.errors import check_config

FAULT_KINDS = ("loss_spike", "nan_grad", "slow_rank", "duplicate_data", "kill")


@dataclass
class GuardConfig:
    spike_zscore: float = 6.0
    """A step is a loss spike when its loss exceeds the window's centre by this many standard deviations
    (as `zscore` measures them); 6 as OLMo-core's `sigma_factor`. 0 disables spike detection."""
    zscore: str = "robust"
    """How the spike z-score is measured over the window: 'robust' (the default): (loss - median) /
    (1.4826 x median absolute deviation), which a few high losses in the window barely move (Leys et al.
    2013); 'mean_std': (loss - mean) / sample standard deviation, OLMo-core's SkipStepOptimizer (which also
    skips losses far *below* the mean; densetrain never does). On losses alternating 2.9/3.1, 3.7 has z 4.7
    robust and 6.8 mean_std."""
    window: int = 128
    """Accepted losses kept for the spike statistics (spikes and non-finite losses never enter); also
    the span (in steps) within which `patience` spikes trigger a rollback. 128 as OLMo-core's
    `rolling_interval_length`."""
    min_history: int = 20
    """Accepted steps needed before spikes are judged (the first steps' loss falls too fast to judge)."""
    min_ratio: float = 1.05
    """A spike must also exceed the window's centre (median; mean with `zscore = 'mean_std'`) by this factor
    (guards against a tiny spread on a plateau)."""
    patience: int = 3
    """Spikes within `window` steps that trigger a rollback; a single spike only skips its update."""
    rollback: bool = True
    """Roll back to the newest checkpoint before the trouble on `patience` spikes or on a streak of
    `train.max_nonfinite_steps` non-finite steps; false: stop with an error on such a streak."""
    max_rollbacks: int = 3
    """Automatic rollbacks allowed per run invocation before training stops with an error."""
    lr_factor: float = 1.0
    """After a rollback, multiply the scheduled lr by this factor for `lr_factor_steps` steps."""
    lr_factor_steps: int = 0
    """Steps after a rollback that use `lr_factor` (0: none)."""


@dataclass
class WatchdogConfig:
    every: int = 10
    """Steps per measurement window: per-rank phase times are gathered and compared every `every` steps; 0 disables."""
    threshold: float = 0.3
    """Relative slowdown of a window against the rank's baseline that counts as slow (0.3 = 30% slower)."""
    sustain: int = 3
    """Consecutive slow windows before an event is raised (one slow window is noise)."""
    warmup: int = 2
    """Windows ignored at the start and after each stage switch, eval or resume (compilation, caches)."""
    hang_seconds: float = 600.0
    """No completed step for this long: every rank dumps its Python stacks (faulthandler) to stderr and
    RUN_DIR/hang_rank<r>.txt, well before the default 30-minute collective timeout; 0 disables."""


@dataclass
class ProbeConfig:
    every: int = 20
    """Steps per data-quality check (duplicate rate and per-source loss trend); 0 disables."""
    window_tokens: int = 64
    """Token windows hashed for the duplicate rate (non-overlapping, from each trained sequence)."""
    sketch_size: int = 65536
    """Most recent window hashes remembered per source (bounded memory)."""
    dup_rate_jump: float = 0.2
    """An event when a source's within-epoch duplicate rate exceeds its running baseline by this much (absolute)."""
    loss_rise: float = 0.2
    """An event when, within a stage, the mean of a source's last `trend_checks` checks exceeds the mean of the
    `trend_checks` before by this many nats (and by 3x its check-to-check noise) while the other sources fell;
    0.2 is the rise of the seed's post-mortem 7.1 (2.3 -> 2.5)."""
    trend_checks: int = 3
    """Checks compared for the per-source loss trend."""


@dataclass
class FaultConfig:
    kind: str = ""
    """One of loss_spike, nan_grad, slow_rank, duplicate_data, kill."""
    step: int = 0
    """Update index (0-based) the fault happens at (from, for slow_rank and duplicate_data)."""
    factor: float = 10.0
    """loss_spike: multiply the step's loss (and so its gradients) by this."""
    rank: int = 0
    """nan_grad, slow_rank, kill: the rank it happens on."""
    ms: float = 0.0
    """slow_rank: extra milliseconds per step (slept in its first forward pass) from `step`."""
    source: str = ""
    """duplicate_data: the source whose windows are repeated."""
    during_checkpoint: bool = False
    """kill: die in the middle of the checkpoint write of `step` (after the shards, before the marker)."""


def validate_recovery(guard: GuardConfig, watchdog: WatchdogConfig, probe: ProbeConfig,
                      faults: list[FaultConfig], sources: list[str]) -> None:
    """Check ``[guard]``, ``[watchdog]``, ``[probe]`` and ``[[faults]]``; raise ConfigError naming the key."""
    check_config(guard.spike_zscore >= 0, f"guard.spike_zscore must be >= 0 (0 disables), got {guard.spike_zscore}")
    check_config(guard.zscore in ("robust", "mean_std"), f"guard.zscore must be 'robust' or 'mean_std', got "
                                                         f"'{guard.zscore}'")
    for k in ("window", "min_history", "patience", "max_rollbacks"):
        check_config(getattr(guard, k) >= 1, f"guard.{k} must be >= 1, got {getattr(guard, k)}")
    check_config(guard.lr_factor > 0, f"guard.lr_factor must be positive, got {guard.lr_factor}")
    check_config(watchdog.every >= 0 and watchdog.threshold > 0 and watchdog.sustain >= 1,
                 "watchdog: need every >= 0, threshold > 0, sustain >= 1")
    check_config(probe.every >= 0 and probe.window_tokens >= 8 and probe.sketch_size >= 64,
                 "probe: need every >= 0, window_tokens >= 8, sketch_size >= 64")
    for i, f in enumerate(faults):
        check_config(f.kind in FAULT_KINDS, f"faults[{i}].kind: '{f.kind}' is not one of {', '.join(FAULT_KINDS)}")
        check_config(f.step >= 0, f"faults[{i}].step must be >= 0, got {f.step}")
        if f.kind == "duplicate_data":
            check_config(f.source in sources, f"faults[{i}].source: '{f.source}' is not a configured source "
                                              f"({', '.join(sources)})")
