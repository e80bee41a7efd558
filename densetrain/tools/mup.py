"""μP diagnostics: the coordinate check and a learning-rate sweep across widths.

Both tools train small models of the real :class:`~densetrain.model.llama.Transformer`, initialised by the
real :func:`~densetrain.model.init.init_weights`, with the real optimizer (:func:`~densetrain.optim.build_optimizer`,
whose parameter groups carry the μP ``lr_scale``, and :func:`~densetrain.optim.set_lr`). So what they check is
the parameterisation as the training loop uses it, not a re-implementation of it.

Coordinate check (Yang et al. 2022, "Tensor Programs V: Tuning Large Neural Networks via Zero-Shot
Hyperparameter Transfer", §7 / Fig. 5 and Appendix D.1): train models that differ only in width for a few
Adam steps with a large learning rate, and record the average size ``mean(|x|)`` of the coordinates of each
activation kind at every step. Under a correct μP the curves are flat in width (every activation's update
is Θ(1) whatever the width); under the standard parameterisation they grow with width (the update of a
width-n matmul with Adam is Θ(n) per coordinate), and the larger the lr the sooner this shows. A curve that
grows under μP points at a wrong init / lr / multiplier for the layer that produces it.

Widths vary with the head count: ``n_heads = width / head_dim`` keeps ``head_dim`` fixed (the TP5 choice for
attention), and ``d_ff = ff_mult * width`` keeps the MLP ratio fixed.

Data: a fixed stream of real text bytes (vocabulary 256, one token per byte) read from the running Python's
standard-library sources, which every machine that runs this package has; if those are missing (an embedded
Python shipping only bytecode) this package's own source files are used. See :func:`text_bytes`.

Units: learning rates are the *base* lr (the lr of width ``base_d_model``; μP groups get ``lr * lr_scale``);
losses are nats per token; activation sizes are mean absolute coordinate values (dimensionless).
"""

from __future__ import annotations

import math
import sysconfig
import time
from pathlib import Path
from typing import Callable, Mapping, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from densetrain.config import Config, ModelConfig, ScheduleConfig, validate
from densetrain.fileio import atomic_write_json
from densetrain.model.init import build_model
from densetrain.model.llama import Transformer
from densetrain.optim import build_optimizer, set_lr
from densetrain.schedule import lr_at

ACT_KINDS = ("embedding", "attention", "mlp", "logits")
"""Activation kinds recorded by the coordinate check, in plotting order:

- ``embedding``: output of ``tok_embeddings`` (B, T, d_model);
- ``attention``: output of each block's attention (after ``wo``, before the residual add), averaged over layers;
- ``mlp``: output of each block's feed-forward (after ``w2``), averaged over layers;
- ``logits``: the model output (B, T, vocab), including μP's ``logit_mult``.
"""

VOCAB = 256
"""Byte-level vocabulary of the diagnostics (token = byte value)."""

_TEXT_CACHE: dict[int, np.ndarray] = {}


# --------------------------------------------------------------------------------------------------
# Real text
# --------------------------------------------------------------------------------------------------


def _text_files() -> list[Path]:
    """Deterministic list of real-text files: stdlib top-level ``*.py`` (sorted), else this package's sources."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in stdlib.glob("*.py") if p.is_file())
    if sum(p.stat().st_size for p in files[:50]) < 200_000:  # no (or stripped) stdlib sources
        files = sorted(Path(__file__).parent.rglob("*.py"))
    return files


def text_bytes(n_bytes: int = 2_000_000) -> np.ndarray:
    """The first ``n_bytes`` bytes of the real-text stream, as a (n,) uint8 array (token ids 0..255).

    Files are concatenated in sorted order; the result is cached per size.

    Raises:
        RuntimeError: fewer than ``n_bytes`` bytes of text were found.
    """
    if n_bytes not in _TEXT_CACHE:
        chunks, total = [], 0
        for p in _text_files():
            b = p.read_bytes()
            chunks.append(b)
            total += len(b)
            if total >= n_bytes:
                break
        if total < n_bytes:
            raise RuntimeError(f"only {total} bytes of real text found, need {n_bytes}")
        _TEXT_CACHE[n_bytes] = np.frombuffer(b"".join(chunks)[:n_bytes], dtype=np.uint8).copy()
    return _TEXT_CACHE[n_bytes]


def text_batch(data: np.ndarray, batch: int, seq_len: int, offsets: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and next-byte targets from windows of ``data`` starting at ``offsets``.

    Returns: (inputs, targets), each (batch, seq_len) int64.
    """
    rows = np.stack([data[o : o + seq_len + 1] for o in offsets[:batch]]).astype(np.int64)
    t = torch.from_numpy(rows)
    return t[:, :-1].contiguous(), t[:, 1:].contiguous()


def _fixed_batch(data: np.ndarray, batch: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``batch`` windows spread evenly over ``data`` (deterministic)."""
    span = len(data) - seq_len - 1
    offsets = [int(i * span / batch) for i in range(batch)]
    return text_batch(data, batch, seq_len, offsets)


# --------------------------------------------------------------------------------------------------
# Model / config for one width
# --------------------------------------------------------------------------------------------------


def width_config(
    width: int,
    init: str,
    base_d_model: int = 64,
    n_layers: int = 2,
    head_dim: int = 16,
    ff_mult: int = 4,
    vocab: int = VOCAB,
    init_std: float = 0.02,
    weight_decay: float = 0.0,
    grad_clip: float = 0.0,
    optimizer: str = "adamw",
) -> Config:
    """A :class:`Config` for a model of ``d_model = width`` (``n_heads = width / head_dim``, MHA,
    ``d_ff = ff_mult * width``).

    Optimizer settings are the defaults of :class:`~densetrain.config.OptimConfig` except ``weight_decay``
    and ``grad_clip`` (0 = plain Adam, what TP5's coordinate check uses) and ``optim.name = optimizer``
    ('adamw' or 'muon').

    Raises:
        ValueError: width not a multiple of ``head_dim``.
        densetrain.config.ConfigError: the resulting config is invalid (e.g. odd head_dim, unknown init).
    """
    if width % head_dim:
        raise ValueError(f"width {width} must be a multiple of head_dim {head_dim}")
    cfg = Config()
    cfg.model = ModelConfig(
        vocab_size=vocab, d_model=width, n_layers=n_layers, n_heads=width // head_dim, n_kv_heads=width // head_dim,
        d_ff=ff_mult * width, init=init, init_std=init_std, base_d_model=base_d_model,
    )
    cfg.optim.weight_decay = weight_decay
    cfg.optim.grad_clip = grad_clip
    cfg.optim.name = optimizer
    validate(cfg)
    return cfg


def _loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


# --------------------------------------------------------------------------------------------------
# Coordinate check
# --------------------------------------------------------------------------------------------------


class _ActRecorder:
    """Forward hooks that store mean |x| of each activation kind for the current forward pass."""

    def __init__(self, model: Transformer):
        self.sums: dict[str, list[float]] = {k: [] for k in ACT_KINDS}
        self.handles = [model.tok_embeddings.register_forward_hook(self._hook("embedding"))]
        for layer in model.layers:
            self.handles.append(layer.attention.register_forward_hook(self._hook("attention")))
            self.handles.append(layer.feed_forward.register_forward_hook(self._hook("mlp")))
        self.handles.append(model.register_forward_hook(self._hook("logits")))

    def _hook(self, kind: str) -> Callable:
        def fn(_module, _inputs, output):
            self.sums[kind].append(float(output.detach().float().abs().mean()))

        return fn

    def pop(self) -> dict[str, float]:
        """Per-kind value of the last forward (layer kinds averaged over layers); resets the buffer."""
        out = {k: float(np.mean(v)) for k, v in self.sums.items()}
        self.sums = {k: [] for k in ACT_KINDS}
        return out

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def coord_check(
    widths: Sequence[int] = (64, 128, 256, 512),
    init: str = "mup",
    steps: int = 10,
    lr: float = 3e-3,
    base_d_model: int = 64,
    n_layers: int = 2,
    seq_len: int = 64,
    batch: int = 8,
    vocab: int = VOCAB,
    data: np.ndarray | None = None,
    seeds: Sequence[int] | Mapping[int, Sequence[int]] = (0, 1, 2, 3),
    head_dim: int = 16,
    ff_mult: int = 4,
    init_std: float = 0.02,
    avg_last: int = 3,
) -> dict:
    """μP coordinate check: mean |activation| per kind, per width, per step, under ``init``.

    For each width a model is built (:func:`width_config`), then trained for ``steps`` Adam steps at the
    constant base learning rate ``lr`` (groups get ``lr * lr_scale`` through :func:`set_lr`; no weight
    decay, no clipping) on one fixed batch of real text. Forward hooks record ``mean(|x|)`` of each kind in
    :data:`ACT_KINDS` at every forward: index ``t`` is the model after ``t`` updates, ``t = 0 .. steps``
    (the last one from an extra forward after the final update). With several ``seeds`` the values are
    averaged over seeds (each seed gets its own init; the batch is the same). ``seeds`` may also map each
    width to its own seeds: seed-to-seed spread shrinks with width, so small widths (cheap) can take more
    seeds than large ones (expensive).

    Growth of a kind is its size at the largest width over its size at the smallest width after the
    steps. "Size after the steps" is the seed-averaged value averaged over the last ``avg_last`` recorded
    points (t = steps - avg_last + 1 .. steps): at a large lr Adam makes the attention output oscillate from
    step to step (by ±10-20 % with this setup), and the phase at exactly t = steps is what differs most
    between seeds; the short window removes that without mixing in the early steps. ``growth_last`` is the
    strict ratio at t = steps (``avg_last=1`` makes the two equal).

    Measured with the defaults (4 seeds, lr 3e-3, 10 steps, widths 64..512, base 64; CPU fp32): μP growth
    0.998 (embedding), 1.018 (attention), 0.966 (MLP), 1.019 (logits); standard init (seed 0) 0.985, ~237,
    ~1250, 4.1. A 12-seed run put μP's strict last-step attention growth at 1.05.

    Args:
        widths: d_model values, each a multiple of ``head_dim``; sorted ascending in the result.
        init: 'mup' or 'standard' (``model.init``).
        data: (n,) integer token stream with ids < ``vocab``; default :func:`text_bytes` (vocab 256).
        seeds: init seeds, the same for every width, or ``{width: seeds}``.
        avg_last: number of final recorded points averaged for ``growth`` (>= 1; clipped to steps + 1).

    Returns:
        ``{"init", "widths", "steps", "lr", "settings": {...}, "values": {kind: [[v_t for t in 0..steps]
        for each width]}, "loss": [[loss_t ...] for each width], "growth": {kind: g}, "growth_last":
        {kind: g}, "seconds"}`` (values seed-averaged; losses in nats/token on the fixed batch), where
        ``growth_last[kind] = values[kind][largest][steps] / values[kind][smallest][steps]`` and ``growth``
        is the same ratio of the means over the last ``avg_last`` steps.

    Raises:
        ValueError: fewer than two widths, a non-positive number of steps, a bad ``avg_last``, no seeds,
        or tokens outside the vocabulary.
    """
    widths = sorted(int(w) for w in widths)
    if len(widths) < 2:
        raise ValueError("coord_check needs at least two widths")
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    if avg_last < 1:
        raise ValueError(f"avg_last must be >= 1, got {avg_last}")
    avg_last = min(avg_last, steps + 1)
    seed_map = {w: list(seeds.get(w, ())) if isinstance(seeds, Mapping) else list(seeds) for w in widths}
    if not all(seed_map.values()):
        raise ValueError(f"coord_check needs at least one seed per width, got {seeds!r}")
    if data is None:
        data = text_bytes()
    if int(data.max()) >= vocab:
        raise ValueError(f"data has token id {int(data.max())} >= vocab {vocab}")
    inputs, targets = _fixed_batch(data, batch, seq_len)

    t0 = time.perf_counter()
    values = {k: [] for k in ACT_KINDS}
    losses = []
    for width in widths:
        cfg = width_config(width, init, base_d_model, n_layers, head_dim, ff_mult, vocab, init_std)
        per_seed = {k: [] for k in ACT_KINDS}
        per_seed_loss = []
        for seed in seed_map[width]:
            model = build_model(cfg.model, seed)
            opt = build_optimizer(model, cfg)
            set_lr(opt, lr)
            rec = _ActRecorder(model)
            acts = {k: [] for k in ACT_KINDS}
            loss_curve = []
            for _ in range(steps):
                loss = _loss(model(inputs), targets)
                for k, v in rec.pop().items():
                    acts[k].append(v)
                loss_curve.append(float(loss.detach()))
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
            with torch.no_grad():
                loss_curve.append(float(_loss(model(inputs), targets)))
            for k, v in rec.pop().items():
                acts[k].append(v)
            rec.remove()
            for k in ACT_KINDS:
                per_seed[k].append(acts[k])
            per_seed_loss.append(loss_curve)
        for k in ACT_KINDS:
            values[k].append(np.mean(per_seed[k], axis=0).tolist())
        losses.append(np.mean(per_seed_loss, axis=0).tolist())

    growth_last = {k: values[k][-1][steps] / values[k][0][steps] for k in ACT_KINDS}
    growth = {k: float(np.mean(values[k][-1][-avg_last:]) / np.mean(values[k][0][-avg_last:])) for k in ACT_KINDS}
    return {
        "init": init,
        "widths": widths,
        "steps": steps,
        "lr": lr,
        "settings": {
            "base_d_model": base_d_model, "n_layers": n_layers, "seq_len": seq_len, "batch": batch, "vocab": vocab,
            "head_dim": head_dim, "ff_mult": ff_mult, "init_std": init_std,
            "seeds": {str(w): v for w, v in seed_map.items()},
            "avg_last": avg_last,
            "optimizer": "AdamW (build_optimizer), weight_decay 0, no clipping, constant lr",
            "data": "fixed batch of real text bytes (Python stdlib sources)",
        },
        "values": values,
        "loss": losses,
        "growth": growth,
        "growth_last": growth_last,
        "seconds": time.perf_counter() - t0,
    }


def _seed_text(result: dict) -> str:
    """'4 seeds' or '8/2 seeds' (per width) for titles."""
    counts = [len(v) for v in result["settings"]["seeds"].values()]
    return f"{counts[0]} seed(s)" if len(set(counts)) == 1 else f"{'/'.join(map(str, counts))} seeds (per width)"


def growth_table(results: Sequence[dict]) -> str:
    """Markdown table of ``growth`` (and the strict last-step ``growth_last``) per kind, one row per result."""
    head = "| init | " + " | ".join(ACT_KINDS) + " | last step only: " + " / ".join(ACT_KINDS) + " |"
    sep = "|---|" + "---:|" * (len(ACT_KINDS) + 1)
    rows = [head, sep]
    for r in results:
        rows.append(
            f"| {r['init']} | " + " | ".join(f"{r['growth'][k]:.3f}" for k in ACT_KINDS) + " | "
            + " / ".join(f"{r['growth_last'][k]:.3f}" for k in ACT_KINDS) + " |"
        )
    return "\n".join(rows)


def plot_coord_check(results: Sequence[dict], path: str | Path) -> Path:
    """PNG: one row per result (init), one panel per activation kind; mean |x| vs width (log-log), one line per step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(results), len(ACT_KINDS), figsize=(4 * len(ACT_KINDS), 3.2 * len(results)),
                             squeeze=False)
    for row, r in zip(axes, results):
        n = r["steps"] + 1
        cmap = plt.get_cmap("viridis")
        for ax, kind in zip(row, ACT_KINDS):
            v = np.asarray(r["values"][kind])  # (widths, steps + 1)
            for t in range(n):
                ax.plot(r["widths"], v[:, t], marker="o", ms=3, color=cmap(t / max(1, n - 1)), label=f"t={t}")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(f"{r['init']}: {kind} (growth {r['growth'][kind]:.2f}x)", fontsize=9)
            ax.set_xlabel("width (d_model)")
            ax.grid(True, which="both", alpha=0.3)
        row[0].set_ylabel("mean |activation|")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="center right", fontsize=7, title="step", title_fontsize=7)
    r0 = results[0]
    fig.suptitle(
        f"μP coordinate check: Adam lr={r0['lr']:g}, {r0['steps']} steps, base width {r0['settings']['base_d_model']}, "
        f"{_seed_text(r0)} averaged; growth over the last {r0['settings']['avg_last']} steps",
        fontsize=10,
    )
    fig.tight_layout(rect=(0, 0, 0.94, 1))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_coord_check(
    out_dir: str | Path,
    widths: Sequence[int] = (64, 128, 256, 512),
    steps: int = 10,
    lr: float = 3e-3,
    inits: Sequence[str] = ("mup", "standard"),
    log: Callable[[str], None] | None = None,
    **kwargs,
) -> dict:
    """Run :func:`coord_check` for each init and write ``coord_check.png``, ``coord_check.md``, ``coord_check.json``.

    ``kwargs`` go to :func:`coord_check`. ``log`` (e.g. ``print``) gets one line per finished init.

    Returns:
        ``{"png": path, "markdown": path, "json": path, "growth": {init: {kind: g}}, "results": [...]}``.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for init in inits:
        r = coord_check(widths=widths, init=init, steps=steps, lr=lr, **kwargs)
        results.append(r)
        if log:
            growth = ", ".join(f"{k} {r['growth'][k]:.2f}x" for k in ACT_KINDS)
            log(f"{init:>8}: " + growth + f"  ({r['seconds']:.1f} s)")
    png = plot_coord_check(results, out / "coord_check.png")
    ws, st = results[0]["widths"], results[0]["settings"]
    md = (
        f"# μP coordinate check\n\nGrowth = mean |activation| at width {ws[-1]} / at width {ws[0]}, after {steps} Adam "
        f"steps at lr {lr:g} (base width {st['base_d_model']}, {_seed_text(results[0])} averaged, sizes averaged over "
        f"the last {st['avg_last']} steps). Flat (≈1) is what μP predicts.\n\n"
        + growth_table(results)
        + "\n"
    )
    (out / "coord_check.md").write_text(md)
    atomic_write_json(out / "coord_check.json", results)
    return {
        "png": str(png), "markdown": str(out / "coord_check.md"), "json": str(out / "coord_check.json"),
        "growth": {r["init"]: r["growth"] for r in results}, "results": results,
    }


# --------------------------------------------------------------------------------------------------
# Learning-rate sweep
# --------------------------------------------------------------------------------------------------


def _train_eval(
    cfg: Config, steps: int, train_data: np.ndarray, val: tuple[torch.Tensor, torch.Tensor],
    batch: int, seq_len: int, seed: int, warmup: int,
) -> tuple[float, float]:
    """Train ``steps`` steps (cosine schedule from ``optim.peak_lr`` to a tenth after ``warmup``; Muon groups
    scaled by ``muon_lr / peak_lr`` as in training); return (last train loss, val loss)."""
    lr = cfg.optim.peak_lr
    model = build_model(cfg.model, seed)
    opt = build_optimizer(model, cfg)
    sched = ScheduleConfig(kind="cosine", warmup_steps=warmup)
    rng = np.random.default_rng(seed)
    span = len(train_data) - seq_len - 1
    clip = cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else float("inf")
    train_loss = float("nan")
    for step in range(steps):
        x, y = text_batch(train_data, batch, seq_len, rng.integers(0, span, size=batch).tolist())
        set_lr(opt, lr_at(step, sched, lr, lr / 10, steps))
        loss = _loss(model(x), y)
        train_loss = float(loss.detach())
        if not math.isfinite(train_loss):
            return float("nan"), float("nan")
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
    with torch.no_grad():
        val_loss = float(_loss(model(val[0]), val[1]))
    return train_loss, val_loss if math.isfinite(val_loss) else float("nan")


def lr_sweep(
    lrs: Sequence[float] = (5e-4, 1e-3, 2e-3, 4e-3, 8e-3),
    widths: Sequence[int] = (64, 256),
    init: str = "mup",
    steps: int = 100,
    base_d_model: int = 64,
    n_layers: int = 2,
    seq_len: int = 64,
    batch: int = 8,
    seed: int = 0,
    warmup: int = 5,
    weight_decay: float = 0.1,
    grad_clip: float = 1.0,
    head_dim: int = 16,
    ff_mult: int = 4,
    init_std: float = 0.02,
    optimizer: str = "adamw",
    adamw_lr: float = 3e-3,
    log: Callable[[str], None] | None = None,
) -> dict:
    """Short training run for every (width, base lr); the best lr per width is the one of lowest val loss.

    ``optimizer = 'muon'`` sweeps Muon's lr (``optim.muon_lr``) of the hidden matrices, with the embeddings,
    head and norms on AdamW at the fixed ``adamw_lr`` (``optim.peak_lr``); both follow the same schedule.
    Muon's update has a width-independent spectral size (torch's per-matrix factor sqrt(max(1, A/B))), so
    its best lr should stay put across widths even under the standard parameterisation.

    Each run: ``steps`` AdamW (or Muon + AdamW) steps (weight decay ``weight_decay`` on AdamW's matrices as in
    training, global-norm clipping at ``grad_clip``), cosine schedule from ``lr`` (after ``warmup`` linear steps)
    to ``lr/10``, on random windows of the first 90% of :func:`text_bytes`; the final loss is the loss on 32
    fixed windows of the held-out last 10%. All runs share the init seed and the batch order. A run whose loss becomes
    non-finite has loss ``nan`` and is never best. Under μP the best lr should not move with width; under
    the standard parameterisation it shrinks as width grows (TP5 Fig. 1).

    Returns:
        ``{"init", "widths", "lrs", "steps", "settings", "final_loss": {width: {lr: val loss (nats/token)}},
        "train_loss": {width: {lr: last train loss}}, "best_lr": {width: lr or None}, "seconds"}``
        (width and lr keys are the int / float values).

    Raises:
        ValueError: empty ``lrs`` or ``widths``, non-positive lr or steps.
    """
    lrs = sorted(float(x) for x in lrs)
    widths = sorted(int(w) for w in widths)
    if not lrs or not widths:
        raise ValueError("lr_sweep needs at least one lr and one width")
    if lrs[0] <= 0 or steps < 1:
        raise ValueError("learning rates and steps must be positive")
    data = text_bytes()
    cut = int(0.9 * len(data))
    train_data, val_data = data[:cut], data[cut:]
    val = _fixed_batch(val_data, 32, seq_len)
    t0 = time.perf_counter()
    final, train = {}, {}
    for width in widths:
        cfg = width_config(width, init, base_d_model, n_layers, head_dim, ff_mult, VOCAB, init_std, weight_decay,
                           grad_clip, optimizer)
        final[width], train[width] = {}, {}
        for lr in lrs:
            if optimizer == "muon":
                cfg.optim.peak_lr, cfg.optim.muon_lr = adamw_lr, lr
            else:
                cfg.optim.peak_lr = lr
            tl, vl = _train_eval(cfg, steps, train_data, val, batch, seq_len, seed, min(warmup, steps))
            final[width][lr], train[width][lr] = vl, tl
            if log:
                log(f"{init} width {width:>4} lr {lr:<8.3g} val loss {vl:.4f}")
    best = {}
    for width in widths:
        finite = {lr: v for lr, v in final[width].items() if math.isfinite(v)}
        best[width] = min(finite, key=finite.get) if finite else None
    return {
        "init": init, "optimizer": optimizer, "widths": widths, "lrs": lrs, "steps": steps,
        "settings": {
            "base_d_model": base_d_model, "n_layers": n_layers, "seq_len": seq_len, "batch": batch, "seed": seed,
            "warmup": warmup, "weight_decay": weight_decay, "grad_clip": grad_clip, "head_dim": head_dim,
            "init_std": init_std, "ff_mult": ff_mult, "schedule": "cosine to lr/10",
            "adamw_lr": adamw_lr if optimizer == "muon" else None,
            "data": "real text bytes (Python stdlib sources), vocab 256",
        },
        "final_loss": final, "train_loss": train, "best_lr": best, "seconds": time.perf_counter() - t0,
    }


def format_lr_sweep(result: dict) -> str:
    """Console table: one row per lr, one column per width (val loss, nats/token); the best lr marked ``*``."""
    ws = result["widths"]
    what = ""
    if result.get("optimizer") == "muon":
        what = f"muon lr with adamw lr {result['settings']['adamw_lr']:g}, "
    lines = [f"lr sweep ({result['init']}, {what}{result['steps']} steps): val loss, nats/token (* = best)"]
    lines.append(f"{'lr':>10} " + " ".join(f"{'d=' + str(w):>12}" for w in ws))
    for lr in result["lrs"]:
        cells = []
        for w in ws:
            v = result["final_loss"][w][lr]
            mark = "*" if result["best_lr"][w] == lr else " "
            cells.append(f"{v:>11.4f}{mark}" if math.isfinite(v) else f"{'diverged':>11} ")
        lines.append(f"{lr:>10.3g} " + " ".join(cells))
    lines.append("best lr: " + ", ".join(f"d={w}: {result['best_lr'][w]}" for w in ws))
    return "\n".join(lines)
