"""Compute-optimal planning after Chinchilla (Hoffmann et al. 2022, "Training Compute-Optimal Large Language Models").

The rule used here is the paper's Approach-1 result in its simplest form:

* training compute ``C ≈ 6 · N · D`` FLOPs for ``N`` parameters and ``D`` training tokens (the paper's
  §3.3 constraint ``FLOPs(N, D) ≈ 6ND``, after Kaplan et al. 2020);
* compute-optimal models scale ``N`` and ``D`` equally (Table 2, Approach 1: ``a = b = 0.50``), at about
  ``D ≈ 20 · N`` tokens per parameter (the ratio of every row of Table 3: 8.0B / 400M = 20,
  20.2B / 1B = 20.2, 205.1B / 10B = 20.5, ...).

Hence ``N = sqrt(C / (6 · 20))`` and ``D = 20 · N``. ``N`` counts *all* parameters including the
embedding tables, as Chinchilla does (Kaplan et al. 2020 counted non-embedding parameters; the difference
explains much of their disagreement, Pearce & Song 2024, "Reconciling Kaplan and Chinchilla Scaling Laws").

:data:`CHINCHILLA_TABLE3` reproduces Table 3 of the paper (Approach 1 projections); the values were checked
against the paper's text (arXiv:2203.15556v1, §3.4). The ``D = 20 N`` rule reproduces every row within 8 %
(the 67B row's 1.5T tokens is rounded in the paper: 5.76e23 / (6 · 67e9) = 1.43T).

Wall time needs a throughput: either a measured/declared ``tokens_per_sec`` (tokens/s of the whole job), or
a peak ``peak_flops`` (FLOP/s of the whole job, all accelerators together) times a model-FLOPs utilisation
``mfu``. Units throughout: FLOPs (floating-point operations, not per second), tokens, parameters, seconds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

CHINCHILLA_TOKENS_PER_PARAM = 20.0
"""Compute-optimal training tokens per parameter (Hoffmann et al. 2022, Table 3, rounded)."""

FLOPS_PER_PARAM_TOKEN = 6.0
"""Training FLOPs per parameter per token: 2 (forward) + 4 (backward) (Kaplan et al. 2020, §2.1)."""


@dataclass(frozen=True)
class Table3Row:
    """One row of Hoffmann et al. 2022, Table 3: params, training FLOPs, training tokens (as printed)."""

    label: str
    params: float
    flops: float
    tokens: float


CHINCHILLA_TABLE3: tuple[Table3Row, ...] = (
    Table3Row("400 Million", 400e6, 1.92e19, 8.0e9),
    Table3Row("1 Billion", 1e9, 1.21e20, 20.2e9),
    Table3Row("10 Billion", 10e9, 1.23e22, 205.1e9),
    Table3Row("67 Billion", 67e9, 5.76e23, 1.5e12),
    Table3Row("175 Billion", 175e9, 3.85e24, 3.7e12),
    Table3Row("280 Billion", 280e9, 9.90e24, 5.9e12),
    Table3Row("520 Billion", 520e9, 3.43e25, 11.0e12),
    Table3Row("1 Trillion", 1e12, 1.27e26, 21.2e12),
    Table3Row("10 Trillion", 10e12, 1.30e28, 216.2e12),
)
"""Hoffmann et al. 2022, Table 3 ("Estimated optimal training FLOPs and training tokens for various model
sizes", Approach 1). The "FLOPs in Gopher units" column is omitted (Gopher = 5.76e23)."""


# --------------------------------------------------------------------------------------------------
# Core rule
# --------------------------------------------------------------------------------------------------


def optimal_from_flops(flops: float, tokens_per_param: float = CHINCHILLA_TOKENS_PER_PARAM) -> tuple[float, float]:
    """Compute-optimal (params, tokens) for a training budget of ``flops`` FLOPs.

    ``N = sqrt(C / (6 r))``, ``D = r N`` with ``r = tokens_per_param``, so that ``6 N D = C``.
    Raises: ValueError for a non-positive or non-finite budget.
    """
    _positive("flops", flops)
    n = math.sqrt(flops / (FLOPS_PER_PARAM_TOKEN * tokens_per_param))
    return n, tokens_per_param * n


def _positive(name: str, value: float | None) -> None:
    if value is None or isinstance(value, bool) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a positive finite number, got {value!r}")


# --------------------------------------------------------------------------------------------------
# Presets
# --------------------------------------------------------------------------------------------------


def preset_shapes() -> list[dict]:
    """Every preset in ``densetrain/presets`` with its parameter counts and FLOPs per token.

    Counts come from the real :class:`~densetrain.model.llama.Transformer` built on the ``meta`` device
    (nothing is allocated, so the 8B preset is cheap): ``params`` = all parameters (shared tensors once,
    the Chinchilla count), ``non_embedding_params`` = without the input embedding table
    (``num_params(exclude_embeddings=True)``). ``flops_per_token`` is :func:`densetrain.metrics.flops_per_token`
    at the preset's ``train.seq_len`` (6 x matmul params + attention; the MFU numerator of the training loop).

    Returns: list of ``{"name", "params", "non_embedding_params", "flops_per_token", "seq_len", "d_model",
    "n_layers"}``, sorted by params.
    """
    import torch

    from densetrain.config import list_presets, load_config
    from densetrain.metrics import flops_per_token
    from densetrain.model.llama import Transformer

    out = []
    for name in list_presets():
        cfg = load_config(preset=name)
        with torch.device("meta"):
            model = Transformer(cfg.model)
        out.append({
            "name": name,
            "params": model.num_params(),
            "non_embedding_params": model.num_params(exclude_embeddings=True),
            "flops_per_token": flops_per_token(cfg.model, cfg.train.seq_len),
            "seq_len": cfg.train.seq_len,
            "d_model": cfg.model.d_model,
            "n_layers": cfg.model.n_layers,
        })
    return sorted(out, key=lambda p: p["params"])


def nearest_preset(params: float, presets: list[dict] | None = None) -> dict:
    """The preset whose total parameter count is closest to ``params`` in log space (ratio closest to 1).

    Raises: ValueError if there are no presets or ``params`` is not positive.
    """
    _positive("params", params)
    presets = preset_shapes() if presets is None else presets
    if not presets:
        raise ValueError("no presets found")
    return min(presets, key=lambda p: abs(math.log(p["params"] / params)))


def nearest_table3_row(flops: float) -> Table3Row:
    """The row of :data:`CHINCHILLA_TABLE3` whose budget is closest to ``flops`` in log space."""
    _positive("flops", flops)
    return min(CHINCHILLA_TABLE3, key=lambda r: abs(math.log(r.flops / flops)))


def gpu_cost(gpu_hours: float, gpu_hour_price: float | None = None) -> dict:
    """``{"gpu_hours", "gpu_hour_price", "usd"}``: the price of ``gpu_hours`` GPU-hours at ``gpu_hour_price``
    USD per GPU-hour (``usd`` None without a price).

    Raises:
        ValueError: a price that is negative or not finite.
    """
    if gpu_hour_price is not None and not (math.isfinite(gpu_hour_price) and gpu_hour_price >= 0):
        raise ValueError(f"gpu_hour_price must be a finite number of USD >= 0, got {gpu_hour_price!r}")
    return {"gpu_hours": gpu_hours, "gpu_hour_price": gpu_hour_price,
            "usd": None if gpu_hour_price is None else gpu_hours * gpu_hour_price}


# --------------------------------------------------------------------------------------------------
# The planner
# --------------------------------------------------------------------------------------------------


def plan(
    flops: float | None = None,
    params: float | None = None,
    tokens: float | None = None,
    hours: float | None = None,
    tokens_per_sec: float | None = None,
    peak_flops: float | None = None,
    mfu: float = 0.4,
    tokens_per_param: float = CHINCHILLA_TOKENS_PER_PARAM,
    presets: list[dict] | None = None,
    gpu_peak_flops: float | None = None,
    gpu_hour_price: float | None = None,
) -> dict:
    """Chinchilla-optimal model size, token count, budget and wall time from one given quantity.

    Give exactly one of:

    * ``flops``: training budget C (FLOPs) -> ``N = sqrt(C / 120)``, ``D = 20 N``;
    * ``params``: N (all parameters) -> ``D = 20 N``, ``C = 6 N D``;
    * ``tokens``: D (training tokens) -> ``N = D / 20``, ``C = 6 N D``;
    * ``hours``: wall-clock hours, with a throughput: ``tokens_per_sec`` gives ``D = tokens_per_sec * 3600 *
      hours`` (the throughput is taken to be that of the planned model), otherwise ``peak_flops * mfu``
      gives ``C = peak_flops * mfu * 3600 * hours``.

    Throughput (optional unless ``hours``): ``tokens_per_sec`` (tokens/s, whole job) wins over
    ``peak_flops`` (FLOP/s, whole job) x ``mfu`` (fraction of peak reached, 0 < mfu <= 1). The effective
    training FLOP/s is ``6 N tokens_per_sec`` or ``peak_flops mfu``; wall time is ``C`` divided by it. When
    both are given the implied MFU ``6 N tokens_per_sec / peak_flops`` is reported.

    Cost (with ``gpu_peak_flops``, FLOP/s of one GPU): ``C / (gpu_peak_flops · mfu) / 3600`` GPU-hours, where
    ``mfu`` is the implied one when ``tokens_per_sec`` and ``peak_flops`` are both given (then the GPU-hours are
    the wall time times ``peak_flops / gpu_peak_flops`` GPUs); with ``tokens_per_sec`` alone the GPUs are
    unknown and there is no cost. Times ``gpu_hour_price`` (USD per GPU-hour) when given.

    The nearest preset (log-distance in total params) is reported with its own Chinchilla-optimal tokens
    ``20 P``, the tokens ``C / (6 P)`` that the given budget buys for it, and a wall time for ``20 P`` tokens
    at the same effective FLOP/s using the preset's exact FLOPs per token (incl. attention).

    Returns:
        dict with ``given`` (the input quantity's name), ``flops``, ``params``, ``tokens``,
        ``tokens_per_param``, ``throughput`` (``{"tokens_per_sec", "flops_per_sec", "mfu", "implied_mfu",
        "source"}`` or None), ``seconds`` / ``hours`` / ``days`` (None without a throughput),
        ``preset`` (dict), ``table3`` (the nearest :class:`Table3Row` as a dict plus ratios) and ``cost``
        (:func:`gpu_cost` plus ``gpu_peak_flops`` and ``mfu``, or None).

    Raises:
        ValueError: not exactly one of flops/params/tokens/hours; a non-positive or non-finite value;
        ``hours`` without a throughput; ``mfu`` outside (0, 1].
    """
    given = {k: v for k, v in (("flops", flops), ("params", params), ("tokens", tokens), ("hours", hours))
             if v is not None}
    if len(given) != 1:
        raise ValueError(
            f"give exactly one of flops, params, tokens, hours; got {', '.join(given) if given else 'none'}"
        )
    (name, value), = given.items()
    _positive(name, value)
    _positive("tokens_per_param", tokens_per_param)
    if tokens_per_sec is not None:
        _positive("tokens_per_sec", tokens_per_sec)
    if peak_flops is not None:
        _positive("peak_flops", peak_flops)
    if not (isinstance(mfu, (int, float)) and 0 < mfu <= 1):
        raise ValueError(f"mfu must be in (0, 1], got {mfu!r}")

    r = tokens_per_param
    if name == "flops":
        n, d = optimal_from_flops(value, r)
    elif name == "params":
        n, d = value, r * value
    elif name == "tokens":
        n, d = value / r, value
    else:  # hours
        if tokens_per_sec is not None:
            d = tokens_per_sec * 3600.0 * value
            n = d / r
        elif peak_flops is not None:
            n, d = optimal_from_flops(peak_flops * mfu * 3600.0 * value, r)
        else:
            raise ValueError("hours needs a throughput: tokens_per_sec, or peak_flops (with mfu)")
    c = FLOPS_PER_PARAM_TOKEN * n * d

    throughput = None
    if tokens_per_sec is not None:
        fps = FLOPS_PER_PARAM_TOKEN * n * tokens_per_sec
        throughput = {
            "tokens_per_sec": tokens_per_sec, "flops_per_sec": fps, "mfu": None,
            "implied_mfu": fps / peak_flops if peak_flops else None, "source": "tokens_per_sec",
        }
    elif peak_flops is not None:
        fps = peak_flops * mfu
        throughput = {
            "tokens_per_sec": fps / (FLOPS_PER_PARAM_TOKEN * n), "flops_per_sec": fps, "mfu": mfu,
            "implied_mfu": None, "source": "peak_flops x mfu",
        }
    seconds = c / throughput["flops_per_sec"] if throughput else None
    if name == "hours":
        seconds = value * 3600.0

    cost = None
    cost_mfu = throughput["implied_mfu"] if throughput and throughput["source"] == "tokens_per_sec" else mfu
    if gpu_peak_flops is not None and cost_mfu:
        _positive("gpu_peak_flops", gpu_peak_flops)
        cost = {**gpu_cost(c / (gpu_peak_flops * cost_mfu) / 3600.0, gpu_hour_price),
                "gpu_peak_flops": gpu_peak_flops, "mfu": cost_mfu}

    p = dict(nearest_preset(n, presets))
    p["ratio_to_plan"] = p["params"] / n
    p["optimal_tokens"] = r * p["params"]
    p["optimal_flops"] = FLOPS_PER_PARAM_TOKEN * p["params"] * p["optimal_tokens"]
    p["tokens_at_budget"] = c / (FLOPS_PER_PARAM_TOKEN * p["params"])
    p["seconds"] = (
        p["flops_per_token"] * p["optimal_tokens"] / throughput["flops_per_sec"] if throughput else None
    )

    row = nearest_table3_row(c)
    table3 = {
        "label": row.label, "params": row.params, "flops": row.flops, "tokens": row.tokens,
        "params_ratio": n / row.params, "flops_ratio": c / row.flops,
    }
    return {
        "given": name, "value": value, "flops": c, "params": n, "tokens": d, "tokens_per_param": r,
        "throughput": throughput, "seconds": seconds,
        "hours": seconds / 3600.0 if seconds is not None else None,
        "days": seconds / 86400.0 if seconds is not None else None,
        "preset": p, "table3": table3, "cost": cost,
    }
