"""The update-norm precursor: the size of each optimizer update, per layer group, and a warning when it
jumps.

Every ``guard.update_every`` steps the parameters are copied just before ``optimizer.step()`` and
subtracted just after it (optimizer step hooks, so only applied updates are measured), giving the
update ``Δθ`` exactly. Logged to metrics.jsonl (kind ``update``, at the step of the train record):
``update/<group>`` = ``||Δθ||`` and ``update_ratio/<group>`` = ``||Δθ|| / ||θ||`` for the groups
``tok_embeddings``, ``layers.<i>``, ``norm``, ``output``, and ``update_norm`` / ``update_ratio`` over
the whole model.

Adam's update of each element is about ``lr`` times a number of order one, so ``||Δθ|| / lr`` does
not follow the schedule's warmup and decay; it jumps when the lr the optimizer really applies is not
the scheduled one, or when the second-moment estimate lags a sudden growth of the gradients, and the
loss moves only at the next forward pass, so the warning comes first. A robust z-score of
``||Δθ|| / lr`` against the last ``guard.window`` measurements (as the guard's loss z-score) above
``guard.update_zscore``, and above ``guard.update_min_ratio`` times their median, raises an
``update_norm`` event; with ``guard.update_lr_factor`` the lr is multiplied by it for
``guard.update_lr_steps`` steps. Flagged measurements do not enter the window.

Sharded parameters (FSDP2, tensor parallel: DTensors) are measured on their local shards and the
squares summed over ranks with one all-reduce, each divided by the number of ranks that hold the same
shard; plain parameters (one process, DDP) are whole on every rank and need no collective.
"""

from __future__ import annotations

import math
from collections import deque

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

from densetrain.config.recovery import GuardConfig
from densetrain.train.guard import loss_z
from densetrain.train.watchers import Verdict, Watcher


def layer_group(name: str) -> str:
    """``'layers.3.attention.wq.weight'`` -> ``'layers.3'``; ``'output.weight'`` -> ``'output'``."""
    parts = name.split(".")
    return ".".join(parts[:2]) if parts[0] == "layers" else parts[0]


def _copies(p: torch.Tensor, world: int) -> int:
    """How many ranks hold the same local data as this rank for parameter ``p``."""
    if not isinstance(p, DTensor):
        return world
    sharded = math.prod(p.device_mesh.size(i) for i, pl in enumerate(p.placements) if isinstance(pl, Shard))
    return world // sharded


class UpdateNorms(Watcher):
    """Update norms per layer group and the early warning (module docstring)."""

    name = "updates"

    def __init__(self, cfg: GuardConfig, world_size: int):
        self.cfg, self.world = cfg, world_size
        self.history: deque[float] = deque(maxlen=cfg.window)
        self.installed = False
        self.measure = False
        self.norms: tuple[torch.Tensor, torch.Tensor] | None = None  # (update, parameter) norm per tensor
        self.lr_until = -1  # steps below this use guard.update_lr_factor
        self.alert = False  # the last measurement was flagged (one event per episode)

    def _install(self, run) -> None:
        named = [(n, p) for n, p in run.model.named_parameters() if p.requires_grad]
        self.groups = list(dict.fromkeys(layer_group(n) for n, _ in named))  # model order
        self.local = [p.to_local() if isinstance(p, DTensor) else p for _, p in named]
        self.before = [torch.empty_like(t) for t in self.local]  # the copy an update is measured against
        index = torch.tensor([self.groups.index(layer_group(n)) for n, _ in named])
        self.onehot = torch.nn.functional.one_hot(index, len(self.groups)).double().to(self.local[0].device)
        self.weight = torch.tensor([1.0 / _copies(p, self.world) for _, p in named], dtype=torch.float64,
                                   device=self.local[0].device)
        self.collective = self.world > 1 and any(isinstance(p, DTensor) for _, p in named)
        run.optimizer.register_step_pre_hook(self._pre)
        run.optimizer.register_step_post_hook(self._post)
        self.installed = True

    @torch.no_grad()
    def _pre(self, optimizer, args, kwargs) -> None:
        if self.measure:
            torch._foreach_copy_(self.before, self.local)

    @torch.no_grad()
    def _post(self, optimizer, args, kwargs) -> None:
        if self.measure:
            torch._foreach_sub_(self.before, self.local)  # old - new = -Δθ
            self.norms = (torch.stack(torch._foreach_norm(self.before)), torch.stack(torch._foreach_norm(self.local)))

    def before_step(self, run) -> None:
        if not self.installed:
            self._install(run)
        self.measure, self.norms = run.state.step % self.cfg.update_every == 0, None
        if run.state.step < self.lr_until:
            run.lr_scale *= self.cfg.update_lr_factor

    def after_step(self, run, result, verdict: Verdict) -> None:
        if verdict != Verdict.APPLY or self.norms is None:
            return
        upd, par = self.norms
        sq = torch.stack([upd.double() ** 2, par.double() ** 2]) * self.weight  # (2, tensors)
        sums = sq @ self.onehot  # (2, groups): squares per layer group
        if self.collective:
            dist.all_reduce(sums)
        u, p = sums.sqrt().tolist()
        metrics = {f"update/{g}": u[i] for i, g in enumerate(self.groups)}
        metrics.update({f"update_ratio/{g}": u[i] / max(p[i], 1e-30) for i, g in enumerate(self.groups)})
        total, ptotal = math.sqrt(sum(x * x for x in u)), math.sqrt(sum(x * x for x in p))
        metrics.update({"update_norm": total, "update_ratio": total / max(ptotal, 1e-30)})
        run.log.log(run.state.step, metrics, kind="update")
        self._judge(run, result, total / max(result.lr, 1e-30))

    def _judge(self, run, result, x: float) -> None:
        if self.cfg.update_zscore and len(self.history) >= self.cfg.min_history:
            z, med = loss_z(x, self.history, "robust")
            if z > self.cfg.update_zscore and x > self.cfg.update_min_ratio * med:
                lower = self.cfg.update_lr_factor != 1 and self.cfg.update_lr_steps > 0
                if lower:
                    self.lr_until = run.state.step + self.cfg.update_lr_steps
                if self.alert:
                    return
                self.alert = True
                run.log.event(result.index, f"update norm per unit lr {x:.4g} (median {med:.4g}, z {z:.1f}): an early "
                              "warning of instability"
                              + (f"; lr x{self.cfg.update_lr_factor:g} for {self.cfg.update_lr_steps} steps"
                                 if lower else ""),
                              kind="update_norm", action="lower_lr" if lower else "warn",
                              values={"update_per_lr": x, "median": med, "z": z, "lr": result.lr})
                return
        self.alert = False
        self.history.append(x)

    def state_dict(self) -> dict:
        return {"history": list(self.history)}

    def load_state_dict(self, d: dict) -> None:
        self.history.extend(d.get("history", []))
