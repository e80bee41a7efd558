"""Weight initialisation: standard (GPT-2 style) and μP (Yang et al. 2022, "Tensor Programs V").

Standard (``cfg.init == "standard"``), after GPT-2 (Radford et al. 2019, §2.3: "scale the weights of
residual layers at initialization by a factor of 1/sqrt(N) where N is the number of residual layers")
as implemented in nanoGPT (``c_proj`` std = 0.02 / sqrt(2 * n_layer): two residual branches per block):

    tok_embeddings, output, wq, wk, wv, w1, w3   ~ N(0, init_std^2)
    wo, w2 (residual output projections)          ~ N(0, (init_std / sqrt(2 n_layers))^2)
    RMSNorm gains                                 = 1
    attn_scale = None (1/sqrt(head_dim)), logit_mult = 1

μP (``cfg.init == "mup"``), with ``m = width_mult = d_model / base_d_model``. This is the "multiplier"
form of Tensor Programs V Table 3 (the form of its Table 8 / the ``mup`` package's ``MuReadout``):
the output layer keeps a width-independent init and learning rate and the forward pass multiplies the
logits by 1/m. The effective output matrix W/m then has init variance ∝ 1/fan_in^2 and Adam updates
∝ 1/fan_in, which is exactly Table 3's "output weights" column.

    parameter                         init std                               Adam lr mult   forward mult
    tok_embeddings (input weights)    init_std                               1              1
    wq, wk, wv, w1, w3 (hidden)       init_std / sqrt(m)                     1/m            1
    wo, w2 (hidden, residual)         init_std / sqrt(m) / sqrt(2 n_layers)  1/m            1
    output (readout)                  init_std                               1              logits * 1/m
    RMSNorm gains (vector-like)       1                                      1              1
    attention logits                  —                                      —              q·k / head_dim

The attention scale 1/head_dim replaces 1/sqrt(head_dim) (TP5 §4 / Appendix B: q and k become correlated
during training, so their dot product grows like head_dim, not sqrt(head_dim)). At m = 1 every row but
the attention scale coincides with the standard init. Tied embeddings are allowed: the shared matrix is
both input and readout weight, which agree in this table (init_std, lr mult 1).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from densetrain.config import ModelConfig
from densetrain.model.llama import Transformer

# Parameter-name fragments (torchtitan naming, see llama.py) of the hidden matrices and of the two
# residual output projections.
_HIDDEN = ("attention.wq.", "attention.wk.", "attention.wv.", "attention.wo.",
           "feed_forward.w1.", "feed_forward.w2.", "feed_forward.w3.")
_RESIDUAL_OUT = ("attention.wo.", "feed_forward.w2.")


def width_mult(cfg: ModelConfig) -> float:
    """μP width multiplier ``d_model / base_d_model`` (dimensionless)."""
    return cfg.d_model / cfg.base_d_model


def _check_kind(cfg: ModelConfig) -> None:
    if cfg.init not in ("standard", "mup"):
        raise ValueError(f"model.init must be 'standard' or 'mup', got '{cfg.init}'")


@torch.no_grad()
def init_weights(model: nn.Module, cfg: ModelConfig) -> None:
    """Initialise ``model`` (a :class:`~densetrain.model.llama.Transformer`) in place per the tables above.

    Works on real or meta-then-materialised models::

        with torch.device("meta"):
            model = Transformer(cfg)
        model.to_empty(device="cuda")
        init_weights(model, cfg)

    It re-ties ``output.weight`` to ``tok_embeddings.weight`` when ``cfg.tie_embeddings`` (``to_empty``
    replaces the two modules' Parameters separately and so breaks the tie), empties the RoPE cache, and
    sets ``model.attn_scale`` / ``model.logit_mult``. Uses the global torch RNG (seed it first).

    Raises: ValueError for an unknown ``cfg.init``.
    """
    _check_kind(cfg)
    mup = cfg.init == "mup"
    m = width_mult(cfg) if mup else 1.0
    if cfg.tie_embeddings:
        model.tie_weights()

    residual_factor = 1.0 / math.sqrt(2 * cfg.n_layers)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):  # attention_norm, ffn_norm, final norm
            nn.init.ones_(p)
        elif name.endswith("tok_embeddings.weight") or name.endswith("output.weight"):
            nn.init.normal_(p, mean=0.0, std=cfg.init_std)
        elif any(f in name for f in _HIDDEN):
            std = cfg.init_std / math.sqrt(m)
            if any(f in name for f in _RESIDUAL_OUT):
                std *= residual_factor
            nn.init.normal_(p, mean=0.0, std=std)
        else:  # pragma: no cover - a new parameter must be given an explicit rule
            raise ValueError(f"init_weights: no rule for parameter '{name}'")

    set_init_scalars(model, cfg)


def set_init_scalars(model: nn.Module, cfg: ModelConfig) -> None:
    """The init's non-parameter state of ``model``: ``attn_scale`` and ``logit_mult`` (μP: 1/head_dim and
    1/width_mult; standard: None and 1), and an empty RoPE cache. Alone, for a model whose weights come from
    a checkpoint (a layout switch, :func:`densetrain.parallel.build_parallel_model` with ``init=False``)."""
    mup = cfg.init == "mup"
    model.attn_scale = 1.0 / cfg.head_dim if mup else None
    model.logit_mult = 1.0 / width_mult(cfg) if mup else 1.0
    model.reset_rope_cache()


def is_hidden_matrix(param_name: str) -> bool:
    """Whether ``param_name`` (from ``named_parameters()``, wrapper prefixes tolerated) is a hidden matrix:
    an attention (wq, wk, wv, wo) or MLP (w1, w2, w3) weight, not an embedding, the output head or a norm."""
    return any(f in param_name for f in _HIDDEN)


def mup_lr_scale(param_name: str, cfg: ModelConfig) -> float:
    """Adam learning-rate multiplier for one parameter (the "Adam lr mult" column above).

    ``param_name`` is a name from ``model.named_parameters()``; wrapper prefixes such as ``_orig_mod.``
    (torch.compile) or ``module.`` (DDP) are tolerated because matching is on name fragments.
    Returns 1.0 for every parameter when ``cfg.init == "standard"``; under μP 1/width_mult for hidden
    matrices (wq, wk, wv, wo, w1, w2, w3) and 1.0 for embeddings, the output layer and norm gains.

    Raises: ValueError for an unknown ``cfg.init``.
    """
    _check_kind(cfg)
    if cfg.init != "mup":
        return 1.0
    if is_hidden_matrix(param_name):
        return 1.0 / width_mult(cfg)
    return 1.0


def build_model(cfg: ModelConfig, seed: int, device: torch.device | str = "cpu") -> Transformer:
    """The one way to make a model: construct on the meta device (no memory, no RNG draws),
    materialise on ``device``, initialise with :func:`init_weights` from ``seed``.

    The same seed gives the same weights on every rank and in every tool (training, μP sweeps,
    export). The global CPU RNG is seeded inside ``torch.random.fork_rng``, so the caller's CPU RNG
    state is untouched.
    """
    with torch.device("meta"):
        model = Transformer(cfg)
    model.to_empty(device=device)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        init_weights(model, cfg)
    return model
