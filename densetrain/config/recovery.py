"""Sections that watch a run and act on trouble: ``[guard]`` (non-finite and spike handling, rollback),
``[watchdog]`` (throughput and hangs), ``[health]`` (hardware health checks), ``[probe]`` (data quality) and
``[[faults]]`` (injected faults for rehearsal and tests). Used by the watchers of :mod:`densetrain.train`."""

from __future__ import annotations

from dataclasses import dataclass

from densetrain.errors import check_config

FAULT_KINDS = ("loss_spike", "nan_grad", "slow_rank", "duplicate_data", "kill", "bitflip", "bad_batch", "lr_jump",
               "slow_memory", "hang")
REPLICA_ACTIONS = ("report", "rollback", "stop")
MACHINE_FAULTS = ("nan_grad", "slow_rank", "kill", "bitflip", "slow_memory", "hang")
"""Faults of the device, not of the data or the recipe: a replay of the step (``densetrain replay``) leaves them out."""


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
    replica_every: int = 100
    """Steps between replica checksums (and at every checkpoint step): each data-parallel replica of every
    parameter and optimizer moment (DDP ranks; HSDP's replicate dimension) must be bitwise equal after an
    update; an exact integer checksum per tensor is compared across the replicas. 0 disables."""
    replica_action: str = "report"
    """On differing replicas: 'report' (an event naming the rank, by majority vote with >= 3 replicas, and the
    tensors), 'rollback' (to the newest checkpoint at or before the last check that found them equal) or 'stop'."""
    replay: bool = False
    """After each loss spike or non-finite step, rank 0 starts `densetrain replay RUN_DIR STEP` in the
    background (a separate process on the same device): its verdict (data or machine) joins the events."""
    update_every: int = 5
    """Steps between measurements of the update (the change of the parameters an optimizer step makes): its
    norm per layer group and the ratio to the parameter norm go to metrics.jsonl (kind 'update'). A measured
    step costs a copy of the parameters in memory and a few passes over them, like an AdamW step (1-2.5% of a
    tiny-preset CPU step, less with more tokens per step: benchmarks/sdc_overhead.py), so the default samples
    every 5th; 1 gives the earliest warning. 0 disables."""
    update_zscore: float = 6.0
    """An early-warning event when the update norm per unit lr (|delta theta| / lr) exceeds the median of the
    last `window` measurements by this many robust standard deviations (and by `update_min_ratio`). 0: no events."""
    update_min_ratio: float = 1.5
    """The update norm per unit lr must also exceed the window median by this factor to warn."""
    update_lr_factor: float = 1.0
    """On an update-norm warning, multiply the lr by this for `update_lr_steps` steps (1: leave the lr alone)."""
    update_lr_steps: int = 0
    """Steps that use `update_lr_factor` after an update-norm warning."""


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
class HealthConfig:
    every: int = 1000
    """Steps between hardware health checks in training (and one at start-up, and one after each throughput
    drop the watchdog blames on a device, not on contention); 0: none in training (``densetrain doctor`` still
    runs them). A check costs about a second of every rank's time (benchmarks/health_cost.py)."""
    seconds: float = 0.02
    """Length of each timed trial of a measurement (the best of `trials` is kept: contention only lowers one)."""
    trials: int = 3
    """Timed trials per figure; the best is kept."""
    copy_mib: int = 64
    """Size of the buffer the memory-bandwidth figure copies (STREAM's copy kernel): larger than any cache."""
    min_ratio: float = 0.6
    """A figure is an outlier when it is below this fraction of the ranks' median (latency: above its
    inverse) and, with 3 or more ranks, its robust z-score is beyond `zscore`; or below this fraction of the
    rank's own first measurement (a slow decline, as in the seed's post-mortem 7.2). 0.6: a synchronous job
    runs at the pace of its slowest device, so one at 0.6x costs ~40% of every step; the best-of-trials matmul
    rate of a CPU shared with other jobs moved by up to 0.63x between checks (measured), a GPU's by a few %."""
    zscore: float = 3.5
    """Robust z-score (value - median) / (1.4826 x MAD) beyond which a figure is an outlier among 3 or more ranks
    (3.5: Iglewicz and Hoaglin's modified z-score cut-off). With 2 ranks every |z| is 0.67: the ratio decides."""


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
    """One of loss_spike, nan_grad, slow_rank, slow_memory, hang, duplicate_data, kill, bitflip, bad_batch,
    lr_jump."""
    step: int = 0
    """Update index (0-based) the fault happens at (from, for slow_rank, slow_memory and duplicate_data)."""
    factor: float = 10.0
    """loss_spike: multiply the step's loss (and so its gradients) by this; lr_jump: the lr from `step` on;
    slow_memory: how many times slower the rank's memory-bound work gets."""
    rank: int = 0
    """nan_grad, slow_rank, slow_memory, hang, kill, bitflip: the rank it happens on."""
    ms: float = 0.0
    """slow_rank: extra milliseconds per step (slept in its first forward pass) from `step`."""
    source: str = ""
    """duplicate_data: the source whose windows are repeated; bad_batch: the source whose tokens replace the batch."""
    during_checkpoint: bool = False
    """kill: die in the middle of the checkpoint write of `step` (after the shards, before the marker)."""
    param: str = ""
    """bitflip: the parameter's name as in the model's named_parameters (e.g. 'layers.0.attention.wq.weight');
    '' is the first one."""
    grad: bool = False
    """bitflip: flip the bit in the parameter's gradient (after the data-parallel reduction, before clipping)
    instead of in the weight (before the forward pass)."""
    element: int = 0
    """bitflip: index of the element in the flattened (local) tensor, modulo its size."""
    bit: int = 30
    """bitflip: the bit of the element's IEEE-754 pattern to flip (0 = lowest mantissa bit; 30, the default, is
    the top exponent bit of an fp32 value: a weight or gradient below 2 in magnitude becomes ~1e38 times larger)."""
    rows: int = 0
    """bad_batch: sequences of the global batch replaced, from its first one (0: all of them)."""
    tokens: str = "random"
    """bad_batch: each replaced sequence is a window of `source` at a seeded random place, read corrupted:
    'random' (uniformly random token ids) or 'repeat' (the window's first token over the whole sequence)."""
    mode: str = "stop"
    """hang: 'stop' (the process sends itself SIGSTOP: every thread stops, the heartbeat too) or 'busy' (its main
    thread spins forever, as in an infinite loop in a data worker: the heartbeat thread lives on)."""


def validate_health(health: HealthConfig) -> None:
    """Check ``[health]``; raise ConfigError naming the key."""
    check_config(health.every >= 0, f"health.every must be >= 0 (0: no checks in training), got {health.every}")
    # Upper bounds: a check is meant to take about a second per rank; beyond these it would stall training for
    # minutes (seconds x trials per figure) or allocate more than a host has (copy_mib, twice: source and copy).
    check_config(0 < health.seconds <= 60 and 1 <= health.trials <= 100 and 1 <= health.copy_mib <= 65536,
                 f"health: need seconds in (0, 60], trials in [1, 100], copy_mib in [1, 65536], got "
                 f"{health.seconds}, {health.trials}, {health.copy_mib}")
    check_config(0 < health.min_ratio < 1, f"health.min_ratio must be in (0, 1), got {health.min_ratio}")
    check_config(health.zscore > 0, f"health.zscore must be positive, got {health.zscore}")


def validate_recovery(guard: GuardConfig, watchdog: WatchdogConfig, probe: ProbeConfig,
                      faults: list[FaultConfig], sources: list[str]) -> None:
    """Check ``[guard]``, ``[watchdog]``, ``[probe]`` and ``[[faults]]``; raise ConfigError naming the key."""
    check_config(guard.spike_zscore >= 0, f"guard.spike_zscore must be >= 0 (0 disables), got {guard.spike_zscore}")
    check_config(guard.zscore in ("robust", "mean_std"), f"guard.zscore must be 'robust' or 'mean_std', got "
                                                         f"'{guard.zscore}'")
    for k in ("window", "min_history", "patience", "max_rollbacks"):
        check_config(getattr(guard, k) >= 1, f"guard.{k} must be >= 1, got {getattr(guard, k)}")
    check_config(guard.lr_factor > 0, f"guard.lr_factor must be positive, got {guard.lr_factor}")
    check_config(guard.replica_action in REPLICA_ACTIONS, f"guard.replica_action: '{guard.replica_action}' is not "
                                                          f"one of {', '.join(REPLICA_ACTIONS)}")
    for k in ("replica_every", "update_every", "update_zscore", "update_lr_steps"):
        check_config(getattr(guard, k) >= 0, f"guard.{k} must be >= 0 (0 disables), got {getattr(guard, k)}")
    check_config(guard.update_lr_factor > 0 and guard.update_min_ratio > 0,
                 f"guard.update_lr_factor and guard.update_min_ratio must be positive, got "
                 f"{guard.update_lr_factor}, {guard.update_min_ratio}")
    check_config(watchdog.every >= 0 and watchdog.threshold > 0 and watchdog.sustain >= 1,
                 "watchdog: need every >= 0, threshold > 0, sustain >= 1")
    check_config(probe.every >= 0 and probe.window_tokens >= 8 and probe.sketch_size >= 64,
                 "probe: need every >= 0, window_tokens >= 8, sketch_size >= 64")
    for i, f in enumerate(faults):
        check_config(f.kind in FAULT_KINDS, f"faults[{i}].kind: '{f.kind}' is not one of {', '.join(FAULT_KINDS)}")
        check_config(f.step >= 0, f"faults[{i}].step must be >= 0, got {f.step}")
        if f.kind == "bitflip":
            check_config(0 <= f.bit <= 63 and f.element >= 0, f"faults[{i}]: bitflip needs 0 <= bit <= 63 and "
                                                               f"element >= 0, got bit {f.bit}, element {f.element}")
        if f.kind == "bad_batch":
            check_config(f.tokens in ("random", "repeat") and f.rows >= 0,
                         f"faults[{i}]: bad_batch needs tokens 'random' or 'repeat' and rows >= 0, got "
                         f"'{f.tokens}', {f.rows}")
        if f.kind == "hang":
            check_config(f.mode in ("stop", "busy"), f"faults[{i}].mode: '{f.mode}' is not one of stop, busy")
        if f.kind == "slow_memory":
            check_config(f.factor >= 1, f"faults[{i}].factor must be >= 1 for slow_memory, got {f.factor}")
        if f.kind == "lr_jump":
            check_config(f.factor > 0, f"faults[{i}].factor must be positive for lr_jump, got {f.factor}")
        if f.kind in ("duplicate_data", "bad_batch"):
            check_config(f.source in sources, f"faults[{i}].source: '{f.source}' is not a configured source "
                                              f"({', '.join(sources)})")
