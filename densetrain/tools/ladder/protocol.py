"""The ladder protocol: what turns sizes x budgets into a ladder that earns its extrapolation, each part from
what broke earlier predictions (benchmarks/RESULTS.md, issue 34); issue 42 item 2. ``densetrain ladder``'s
defaults are :data:`PROTOCOL`, :data:`DEFAULT_SIZES` and :data:`DEFAULT_BUDGETS`.


- *placement* (``per_budget``): each budget trains only ``per_budget`` consecutive sizes (by N), a window
  that moves up the size list from the smallest budget (the smallest sizes) to the largest (the largest
  sizes), evenly by rank: budget ``i`` of ``B`` takes the window starting at ``round(i (S - k) / (B - 1))`` of
  ``S`` sizes. The compute-optimal N grows as ~C^0.5 (Hoffmann et al. 2022), so the optimum moves up the
  sizes with the budget; the windows follow it (IsoFLOP-style: no compute on the largest sizes at the
  smallest budgets, where they train a few steps, or on the smallest at the largest) and the largest
  budget still reaches the largest size, so the ladder spans its whole N range. A placed point too short
  to decay after its warmup is left out (said in the ladder's first line,
  :func:`densetrain.tools.ladder.launcher.describe`);
- *seeds* (``seeds``): the largest rung (the largest size at its largest budget) is trained at this many
  seeds (``train.seed`` + 0, 1, ...; named ``..._s1``, ``..._s2``), so the ladder measures its own seed noise;
  the fit takes the mean of the replicas (:mod:`densetrain.tools.ladder.fit`);
- *learning rate per size* (``lr_rule``): ``"inverse-width"`` scales ``peak_lr`` and ``min_lr`` by
  ``config d_model / d_model`` (AdamW's best lr under the standard parameterisation falls as 1 / width:
  4e-3 at d=64 to 1e-3 at d=256 in `densetrain lr-sweep`, benchmarks/RESULTS.md "Where the best lr lands
  across widths"; the config's lr is the base width's); ``"config"`` keeps the config's (μP runs:
  ``model.init = "mup"`` transfers it by itself);
- *head dimension* (``head_dim``): the sizes' heads are this wide (0: the config's), so small sizes exist;
- *FLOPs* (``flops``): ``"exact"`` budgets count :func:`densetrain.metrics.flops_per_token` (the count
  ``plan`` uses: matmuls, the head and attention, no input embedding), ``D = C / flops_per_token``;
  ``"6nd"``: ``D = C / (6 N)``. Either way N is :data:`densetrain.tools.ladder.grid.N_KEY`.

Warmup and decay are the config's ``schedule`` (``warmup_steps``, ``decay_fraction``, ``decay_shape``), the
same in steps for every size (above); the protocol's recipe file (README "densetrain ladder") sets 10 warmup
steps and a 20% linear decay (Hägele et al. 2024's cooldown length).

Pure data and checks (no torch: ``densetrain ladder --help`` reads the defaults from here);
:mod:`densetrain.tools.ladder.grid` applies them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from densetrain.errors import ConfigError

LR_RULES = ("inverse-width", "config")
FLOP_COUNTS = ("exact", "6nd")


@dataclass(frozen=True)
class Protocol:
    """How a ladder places, seeds and tunes its points (module docstring). The defaults are the grid of a bare
    ``build_grid`` (every size at every budget, one seed, the config's lr and heads, 6ND): ladders planned
    before the protocol read back the same; ``densetrain ladder``'s defaults are :data:`PROTOCOL`."""

    per_budget: int = 0
    """Sizes per budget, placed around its predicted optimum; 0: every size at every budget."""
    seeds: int = 1
    """Seeds of the largest rung (the largest size at its largest budget), 1 to 10."""
    lr_rule: str = "config"
    """'inverse-width' (peak_lr, min_lr x config d_model / d_model) or 'config'."""
    head_dim: int = 0
    """Head dimension of every size (0: the config's d_model / n_heads)."""
    flops: str = "6nd"
    """Budgets in 'exact' FLOPs (flops_per_token x D, plan's count) or '6nd' (6 N D)."""

    def check(self) -> Protocol:
        """Raises ConfigError (one line naming the field) on a value outside its range; returns self."""
        bad = None
        if not 0 <= self.per_budget <= 20:
            bad = f"per_budget {self.per_budget}: expected 0 (every size) to 20 sizes per budget"
        elif not 1 <= self.seeds <= 10:
            bad = f"seeds {self.seeds}: expected 1 to 10 seeds of the largest rung"
        elif self.lr_rule not in LR_RULES:
            bad = f"lr_rule '{self.lr_rule}': expected one of {', '.join(LR_RULES)}"
        elif not 0 <= self.head_dim <= 1024:
            bad = f"head_dim {self.head_dim}: expected 0 (the config's) to 1024"
        elif self.flops not in FLOP_COUNTS:
            bad = f"flops '{self.flops}': expected one of {', '.join(FLOP_COUNTS)}"
        if bad:
            raise ConfigError(f"ladder protocol: {bad}")
        return self

    @classmethod
    def from_dict(cls, d: dict, where: str) -> Protocol:
        """The protocol ``d`` (``ladder.json``'s ``protocol``), checked; an unknown key is one line naming it."""
        unknown = sorted(set(d) - set(cls.__dataclass_fields__))
        if unknown:
            raise ConfigError(f"{where}: protocol key '{unknown[0]}' unknown; expected "
                              f"{', '.join(cls.__dataclass_fields__)}")
        try:
            return cls(**d).check()
        except TypeError as e:
            raise ConfigError(f"{where}: protocol: {e}") from None

    def as_dict(self) -> dict:
        return asdict(self)


PROTOCOL = Protocol(per_budget=3, seeds=3, lr_rule="inverse-width", head_dim=16,
                    flops="exact")
"""``densetrain ladder``'s protocol (issue 42 item 2; measured with it: benchmarks/RESULTS.md, "issue 42: the
ladder protocol"): 3 sizes per budget on a staircase, the largest rung at 3 seeds, lr x 1/width, heads of 16,
exact FLOPs."""
DEFAULT_SIZES = (16, 32, 48, 64)
"""``densetrain ladder``'s sizes (d_model): with heads of 16, vocab 512 and the ladder-corpus shape (aspect ratio
d_model / n_layers = 32; benchmarks/ladder_protocol.toml) N = 11.6k, 28.0k, 74.0k, 125k (10.8x). On the
staircase of 3 sizes a budget the middle size of each window trains ~13-18 tokens per parameter at the three
larger budgets (near Chinchilla's ~20), so each budget has sizes on both sides of its optimum."""
DEFAULT_BUDGETS = (3.3e10, 1e11, 3.3e11, 1e12)
"""``densetrain ladder``'s budgets, FLOPs (30.3x): ~6 CPU-minutes for the whole ladder on 2 shared Zen 4 cores."""
