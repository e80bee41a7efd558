"""RoPE frequencies with optional context-extension scaling: linear, Llama 3.1, YaRN.

Plain RoPE (Su et al. 2021, "RoFormer", eq. 15) rotates pair ``i`` of a head (``i = 0 .. D/2 - 1``,
``D = head_dim``) by ``pos * f_i`` with the inverse frequency ``f_i = theta^(-2i/D)`` radians per
position; its wavelength is ``lambda_i = 2 pi / f_i`` tokens. A model trained on contexts of ``L``
tokens has seen every pair with ``lambda_i < L`` turn through all its angles, but the slow pairs
(``lambda_i > L``) only through part of a turn. Scaling changes the ``f_i`` before the stage that
extends the context by the factor ``s``:

- ``linear`` (Chen et al. 2023, "Extending Context Window of Large Language Models via Positional
  Interpolation"): ``f_i / s`` for every pair, i.e. positions squeezed into the trained range.
- ``llama3`` (Llama 3.1's published formula, the ``apply_scaling`` of Meta's llama-models reference
  code; Dubey et al. 2024): with ``lo = L / low_freq_factor`` and ``hi = L / high_freq_factor``
  (``hi < lo``),

      lambda_i < hi:  f_i                          (fast pairs: unchanged)
      lambda_i > lo:  f_i / s                      (slow pairs: interpolated)
      otherwise:      (1 - g) f_i / s + g f_i,     g = (L / lambda_i - low_freq_factor)
                                                       / (high_freq_factor - low_freq_factor)

  (``g`` runs from 0 at ``lambda = lo`` to 1 at ``lambda = hi``, so the three pieces join
  continuously.)
- ``yarn`` (Peng et al. 2023, "YaRN: Efficient Context Window Extension of Large Language Models",
  sec. 3.2 "NTK-by-parts" and 3.4): pair ``i`` turns ``r_i = L / lambda_i`` times over ``L``; pairs
  turning more than ``beta_fast`` times keep ``f_i``, fewer than ``beta_slow`` times get ``f_i / s``,
  and the weight between them is linear. As in the authors' reference code (and transformers), the
  ramp is linear in the pair index ``i`` (that is, in ``log r``), between the index where
  ``r = beta_fast``, rounded down, and the index where ``r = beta_slow``, rounded up; the index of a
  rotation count ``r`` is ``D ln(L / (2 pi r)) / (2 ln theta)``. YaRN also sharpens attention: cos and
  sin are multiplied by ``attention_factor`` (default ``0.1 ln s + 1``, eq. 22), so every ``q.k`` by
  its square.

Everything is computed in fp32, the precision the tables are used in (densetrain/model/llama.py).
"""

from __future__ import annotations

import math

import torch

from densetrain.config.schema import RopeScalingConfig


def plain_inv_freq(head_dim: int, theta: float, device: torch.device | str | None = None) -> torch.Tensor:
    """Unscaled inverse frequencies ``theta^(-2i/head_dim)``, i = 0 .. head_dim/2 - 1 (RoFormer eq. 15).

    Returns: (head_dim // 2,) float32, radians per position. Raises: ValueError if head_dim is odd.
    """
    if head_dim % 2:
        raise ValueError(f"RoPE needs an even head_dim, got {head_dim}")
    exponent = torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim
    return 1.0 / (theta**exponent)


def _llama3(f: torch.Tensor, rs: RopeScalingConfig) -> torch.Tensor:
    L, s = float(rs.original_max_position_embeddings), float(rs.factor)
    wavelen = 2 * math.pi / f  # (D/2,) tokens per turn
    g = (L / wavelen - rs.low_freq_factor) / (rs.high_freq_factor - rs.low_freq_factor)
    mid = (1 - g) * f / s + g * f
    out = torch.where(wavelen > L / rs.low_freq_factor, f / s, mid)
    return torch.where(wavelen < L / rs.high_freq_factor, f, out)


def _yarn(f: torch.Tensor, rs: RopeScalingConfig, head_dim: int, theta: float) -> torch.Tensor:
    L, s = float(rs.original_max_position_embeddings), float(rs.factor)

    def index_of(rotations: float) -> float:  # pair index whose wavelength fits `rotations` times into L
        return head_dim * math.log(L / (2 * math.pi * rotations)) / (2 * math.log(theta))

    lo = max(math.floor(index_of(rs.beta_fast)), 0)
    hi = min(math.ceil(index_of(rs.beta_slow)), head_dim - 1)
    span = hi - lo if hi > lo else 1e-3  # one-index ramp: a step instead of a division by zero
    w = ((torch.arange(f.numel(), dtype=torch.float32, device=f.device) - lo) / span).clamp(0, 1)  # 0: keep
    return f * (1 - w) + (f / s) * w


def attention_factor(rs: RopeScalingConfig | None) -> float:
    """Multiplier of the cos/sin tables: YaRN's ``attention_factor`` (0: ``0.1 ln s + 1``, 1 for s <= 1),
    1.0 for every other type."""
    if rs is None or rs.type != "yarn":
        return 1.0
    if rs.attention_factor > 0:
        return float(rs.attention_factor)
    return 0.1 * math.log(rs.factor) + 1.0 if rs.factor > 1 else 1.0


def rope_frequencies(head_dim: int, theta: float, scaling: RopeScalingConfig | None = None,
                     device: torch.device | str | None = None) -> torch.Tensor:
    """Inverse frequencies of RoPE with base ``theta``, scaled by ``scaling`` (module docstring).

    Args:
        scaling: None or type 'none'/'': plain RoPE; 'linear', 'llama3' or 'yarn' with its fields.
    Returns: (head_dim // 2,) float32, radians per position.
    Raises: ValueError for an odd head_dim or an unknown scaling type.
    """
    f = plain_inv_freq(head_dim, theta, device)
    kind = "none" if scaling is None or scaling.type in ("", "none") else scaling.type
    if kind == "none":
        return f
    if kind == "linear":
        return f / float(scaling.factor)
    if kind == "llama3":
        return _llama3(f, scaling)
    if kind == "yarn":
        return _yarn(f, scaling, head_dim, theta)
    raise ValueError(f"unknown RoPE scaling type '{scaling.type}' (none, linear, llama3, yarn)")
