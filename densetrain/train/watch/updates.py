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

The event names the layer group that moved most: the largest ``update_ratio/<group>`` of the flagged step.

Every norm is that of the full tensor on one process, for any layout (DDP replicas, FSDP2 / HSDP shards,
tensor-parallel slices, context parallelism), and the same on every rank: the local parts' squares are
reduced with one all-reduce by :class:`densetrain.parallel.norms.FullNorms`, each shard counted once.
"""

from __future__ import annotations

import math
from collections import deque

import torch

from densetrain.config.recovery import GuardConfig
from densetrain.parallel.norms import FullNorms, local_part
from densetrain.train.watch.guard import loss_z
from densetrain.train.watchers import Verdict, Watcher


def layer_group(name: str) -> str:
    """``'layers.3.attention.wq.weight'`` -> ``'layers.3'``; ``'output.weight'`` -> ``'output'``."""
    parts = name.split(".")
    return ".".join(parts[:2]) if parts[0] == "layers" else parts[0]


def _group_order(group: str) -> tuple:
    """The whole model's order of layer groups: embedding, blocks by index, final norm, head."""
    parts = group.split(".")
    if parts[0] == "layers" and len(parts) == 2 and parts[1].isdigit():
        return (1, int(parts[1]), "")
    return ({"tok_embeddings": 0, "norm": 2, "output": 3}.get(parts[0], 4), 0, group)


class UpdateNorms(Watcher):
    """Update norms per layer group and the early warning (module docstring)."""

    name = "updates"

    def __init__(self, cfg: GuardConfig, extra_group=None):
        """``extra_group``: the pipeline-stage group the norms are also summed over
        (:class:`densetrain.parallel.norms.FullNorms`), None without pipeline stages."""
        self.cfg, self.extra_group = cfg, extra_group
        self.history: deque[float] = deque(maxlen=cfg.window)
        self.installed = False
        self.measure = False
        self.norms: torch.Tensor | None = None  # (2, groups): update and parameter norms of the last step
        self.lr_until = -1  # steps below this use guard.update_lr_factor
        self.alert = False  # the last measurement was flagged (one event per episode)

    def install(self, model, optimizer) -> None:
        """Measure the updates of ``model``'s trainable parameters that ``optimizer`` applies (its step hooks)."""
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self.groups = list(dict.fromkeys(layer_group(n) for n, _ in named))  # model order
        if hasattr(model, "full_state_names"):  # a pipeline stage: every stage's groups, in one order on all ranks
            self.groups = sorted({layer_group(n) for n in model.full_state_names}, key=_group_order)
        self.local = [local_part(p) for _, p in named]
        self.before = [torch.empty_like(t) for t in self.local]  # the copy an update is measured against
        self.full = FullNorms([p for _, p in named], [self.groups.index(layer_group(n)) for n, _ in named],
                              extra_group=self.extra_group, n_groups=len(self.groups))
        optimizer.register_step_pre_hook(self._pre)
        optimizer.register_step_post_hook(self._post)
        self.installed = True

    @torch.no_grad()
    def _pre(self, optimizer, args, kwargs) -> None:
        if self.measure:
            torch._foreach_copy_(self.before, self.local)

    @torch.no_grad()
    def _post(self, optimizer, args, kwargs) -> None:
        if self.measure:
            torch._foreach_sub_(self.before, self.local)  # old - new = -Δθ
            self.norms = self.full.norms(self.before, self.local)  # (2, groups), a collective

    def metrics(self) -> dict[str, float]:
        """The last measured step's record (module docstring): update norm and ratio per group and in total."""
        u, p = self.norms.tolist()
        metrics = {f"update/{g}": u[i] for i, g in enumerate(self.groups)}
        metrics.update({f"update_ratio/{g}": u[i] / max(p[i], 1e-30) for i, g in enumerate(self.groups)})
        total, ptotal = math.sqrt(sum(x * x for x in u)), math.sqrt(sum(x * x for x in p))
        metrics.update({"update_norm": total, "update_ratio": total / max(ptotal, 1e-30)})
        return metrics

    def before_step(self, run) -> None:
        if not self.installed:
            self.install(run.model, run.optimizer)
        self.measure, self.norms = run.state.step % self.cfg.update_every == 0, None
        if run.state.step < self.lr_until:
            run.lr_scale *= self.cfg.update_lr_factor

    def after_step(self, run, result, verdict: Verdict) -> None:
        if verdict != Verdict.APPLY or self.norms is None:
            return
        metrics = self.metrics()
        run.log.log(run.state.step, metrics, kind="update")
        self._judge(run, result, metrics)

    def _judge(self, run, result, metrics: dict[str, float]) -> None:
        x = metrics["update_norm"] / max(result.lr, 1e-30)
        if self.cfg.update_zscore and len(self.history) >= self.cfg.min_history:
            z, med = loss_z(x, self.history, "robust")
            if z > self.cfg.update_zscore and x > self.cfg.update_min_ratio * med:
                lower = self.cfg.update_lr_factor != 1 and self.cfg.update_lr_steps > 0
                if lower:
                    self.lr_until = run.state.step + self.cfg.update_lr_steps
                if self.alert:
                    return
                self.alert = True
                group = max(self.groups, key=lambda g: metrics[f"update_ratio/{g}"])  # moved most, relative to itself
                ratio = metrics[f"update_ratio/{group}"]
                run.log.event(result.index, f"update norm per unit lr {x:.4g} (median {med:.4g}, z {z:.1f}): an early "
                              f"warning of instability; {group} moved most (|Δθ|/|θ| {ratio:.3g})"
                              + (f"; lr x{self.cfg.update_lr_factor:g} for {self.cfg.update_lr_steps} steps"
                                 if lower else ""),
                              kind="update_norm", action="lower_lr" if lower else "warn",
                              values={"update_per_lr": x, "median": med, "z": z, "lr": result.lr, "group": group,
                                      "group_update_ratio": ratio})
                return
        self.alert = False
        self.history.append(x)

    def state_dict(self) -> dict:
        return {"history": list(self.history)}

    def load_state_dict(self, d: dict) -> None:
        """Raises: ValueError: a saved list longer than ``guard.window`` (the caller names the file)."""
        if len(d.get("history", [])) > self.cfg.window:
            raise ValueError(f"watchers.updates.history: expected at most guard.window ({self.cfg.window}) values, "
                             f"got {len(d['history'])}")
        self.history.extend(d.get("history", []))
