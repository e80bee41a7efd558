"""The optimizer: AdamW with parameter groups (default), or Muon for the hidden matrices with AdamW for the rest.

Weight decay goes on 2-D matmul weights only: norm gains and (by default) embeddings are not
decayed, following GPT-3 / Llama practice (decaying gains and embeddings pulls them toward zero
for no regularisation benefit). Every group carries an lr multiplier (``lr_scale``); the training
loop sets ``group["lr"] = lr(step) * group["lr_scale"]``, so the schedule, stage ``lr_mult`` and
re-warmups reach every group alike. Under μP an AdamW group's multiplier is its μP lr scale.

``optim.name = 'muon'`` (Jordan et al. 2024, "Muon: An optimizer for hidden layers in neural
networks", https://kellerjordan.github.io/posts/muon/): PyTorch's own ``torch.optim.Muon`` updates the
hidden matrices (attention wq/wk/wv/wo, MLP w1/w2/w3) with the momentum update orthogonalised by a
Newton-Schulz iteration; embeddings, the output head and norm gains stay on AdamW (the split of
modded-nanogpt and nanochat: Muon is defined for hidden 2-D maps only). The Muon groups' ``lr_scale`` is
``muon_lr / peak_lr``, so their lr follows the same curve with peak ``muon_lr``. Under FSDP2 / tensor
parallel (DTensor parameters) each update is gathered to the whole matrix for Newton-Schulz, see
:class:`GatheredMuon` and docs/distributed.md.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.optim._muon import _adjust_lr, _zeropower_via_newtonschulz

from densetrain.config import Config
from densetrain.model.init import is_hidden_matrix, mup_lr_scale
from densetrain.model.precision import resolve_dtype


def param_groups(model: nn.Module, cfg: Config) -> list[dict]:
    """Split parameters into groups by (optimizer, decayed?, lr_scale).

    Returns a list of dicts with keys ``params``, ``weight_decay``, ``lr_scale``, ``names`` and, when
    ``optim.name = 'muon'``, ``muon`` (True for the hidden matrices' group).
    Tied weights appear once (``named_parameters`` de-duplicates them).
    """
    o = cfg.optim
    groups: dict[tuple[bool, bool, float], dict] = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        if o.name == "muon" and p.ndim == 2 and is_hidden_matrix(name):
            # Muon's orthogonalised update has a width-independent spectral size (torch's shape factor
            # sqrt(max(1, A/B)) keeps it ~ sqrt(fan_out / fan_in)), so no μP 1/width_mult on top.
            key = (True, True, o.muon_lr / o.peak_lr)
            wd = o.muon_weight_decay
        else:
            is_embedding = name.endswith("tok_embeddings.weight")
            decay = p.ndim == 2 and (not is_embedding or o.decay_embeddings)
            scale = mup_lr_scale(name, cfg.model) if cfg.model.init == "mup" else 1.0
            # AdamW's decay per step is lr * weight_decay; under μP a hidden matrix's lr is scaled by
            # 1/width_mult, so its weight_decay is scaled by width_mult to keep the per-step decay the
            # same at every width (as the `mup` package's MuAdamW does).
            key = (False, decay, scale)
            wd = o.weight_decay / scale if decay else 0.0
        g = groups.setdefault(key, {"params": [], "names": [], "weight_decay": wd, "lr_scale": key[2]})
        if o.name == "muon":  # only then: an AdamW run's checkpoints keep their group keys
            g["muon"] = key[0]
        g["params"].append(p)
        g["names"].append(name)
    return list(groups.values())


def newton_schulz_fp32(g: torch.Tensor, coefficients: tuple[float, float, float], steps: int,
                       eps: float) -> torch.Tensor:
    """torch's Newton-Schulz orthogonalisation (``torch.optim._muon._zeropower_via_newtonschulz``: the quintic
    ``X <- a X + (b A + c A^2) X`` with ``A = X X^T`` on the wide orientation, after ``X = G / ||G||_F``; Jordan
    et al. 2024) carried out in fp32 instead of bf16. ``g``: (A, B) matrix; returns (A, B), fp32.

    For ``train.dtype = 'fp32'`` runs: bf16 rounds each element to 8 bits, so the last-bit differences of a
    gradient summed in another order (FSDP2's reduce-scatter against one process) flip bf16 roundings and
    move the update by ~0.4% of an element, 1e-5 of the loss within 5 steps; in fp32 the paths agree to ~1e-7.
    """
    a, b, c = coefficients
    x = g.float()
    wide = x.size(0) > x.size(1)
    if wide:
        x = x.T
    x = x / x.norm().clamp(min=eps)
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if wide else x


class GatheredMuon(torch.optim.Muon):
    """``torch.optim.Muon`` that also takes DTensor (FSDP2 / tensor-parallel) parameters, and can run its
    Newton-Schulz step in fp32 (``ns_fp32=True``, for ``train.dtype = 'fp32'``, see :func:`newton_schulz_fp32`).

    The step is torch's ``_single_tensor_muon`` per parameter (same operations in the same order, so with
    plain tensors and ``ns_fp32=False`` it is bit for bit torch's; a test holds it), with one all-gather per
    DTensor parameter: the momentum buffer (a DTensor sharded like the parameter) and the Nesterov blend are
    elementwise, so they run on the local shard; the update is gathered to the whole matrix
    (``DTensor.full_tensor()``), orthogonalised, and every rank keeps only its own shard of the result
    (``distribute_tensor(..., src_data_rank=None)``, no communication) for the weight decay and the update.
    Every rank computes Newton-Schulz of every matrix (redundant FLOPs, ``O(d^3)`` per matrix, no second
    collective); the alternative, assigning whole matrices to ranks and broadcasting, is nanochat's DistMuon.
    """

    def __init__(self, params, ns_fp32: bool = False, **kwargs):
        super().__init__(params, **kwargs)
        self.ns_fp32 = ns_fp32

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        orthogonalise = newton_schulz_fp32 if self.ns_fp32 else _zeropower_via_newtonschulz
        for group in self.param_groups:
            lr, wd, mom = group["lr"], group["weight_decay"], group["momentum"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                grad = p.grad
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(grad, memory_format=torch.preserve_format)
                buf = state["momentum_buffer"]
                buf.lerp_(grad, 1 - mom)
                update = grad.lerp(buf, mom) if group["nesterov"] else buf
                full = update.full_tensor() if isinstance(update, DTensor) else update
                ortho = orthogonalise(full, group["ns_coefficients"], group["ns_steps"], group["eps"])
                if isinstance(p, DTensor):
                    ortho = distribute_tensor(ortho, p.device_mesh, p.placements, src_data_rank=None)
                p.mul_(1 - lr * wd)
                p.add_(ortho, alpha=-_adjust_lr(lr, group["adjust_lr_fn"], p.shape))
        return loss


class MuonAdamW(torch.optim.Optimizer):
    """One optimizer over two: :class:`GatheredMuon` for the groups with ``muon=True``, AdamW for the rest.

    Both inner optimizers share this object's ``param_groups`` (the same dicts) and ``state`` (one dict,
    keyed by parameter), so ``state_dict``/``load_state_dict``, ``zero_grad``, :func:`set_lr` and
    ``torch.distributed.checkpoint``'s ``get_state_dict`` see one ordinary optimizer.
    """

    def __init__(self, groups: list[dict], muon_kwargs: dict, adamw_kwargs: dict):
        muon_groups = [g for g in groups if g["muon"]]
        adamw_groups = [g for g in groups if not g["muon"]]
        self.muon = GatheredMuon(muon_groups, lr=0.0, **muon_kwargs)
        self.adamw = torch.optim.AdamW(adamw_groups, lr=0.0, **adamw_kwargs)
        super().__init__(self.muon.param_groups + self.adamw.param_groups, {})
        self._share()

    def _share(self) -> None:
        n = len(self.muon.param_groups)
        self.muon.param_groups, self.adamw.param_groups = self.param_groups[:n], self.param_groups[n:]
        self.muon.state = self.adamw.state = self.state

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.muon.step()
        self.adamw.step()
        return loss

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)  # replaces param_groups and state with new objects
        self._share()


def build_optimizer(model: nn.Module, cfg: Config) -> torch.optim.Optimizer:
    """AdamW over :func:`param_groups` (``optim.name = 'adamw'``) or :class:`MuonAdamW` ('muon'); lr is
    set per step by the loop (initial value 0).

    The fused AdamW kernel (one pass over each parameter, grad, exp_avg, exp_avg_sq) is used on CPU and CUDA unless
    the run's dtype is 'fp32' (``train.dtype``, 'auto' as :func:`densetrain.model.precision.resolve_dtype` resolves
    it on the parameters' device), which keeps the multi-tensor ``foreach`` kernel: the two round differently (max
    2.4e-7 apart after 10 steps), and the recorded golden fp32 trajectory was made with ``foreach``. Measured on 2
    Zen 4 cores for a 13.8M-parameter model: fused ~7 ms per step, foreach ~50-60 ms. Parameters and both moments
    are fp32 in every case (master weights); Muon's momentum is fp32 and its Newton-Schulz runs in bf16 (torch's,
    after Jordan et al. 2024), in fp32 when the run's dtype is 'fp32' (so fp32 runs keep fp32 agreement across
    layouts).
    """
    o = cfg.optim
    param = next(model.parameters(), None)
    fp32 = resolve_dtype(cfg.train.dtype, param.device if param is not None else torch.device("cpu")) == "fp32"
    kernel = {"foreach": True} if fp32 else {"fused": True}
    adamw = {"betas": (o.beta1, o.beta2), "eps": o.eps, "weight_decay": o.weight_decay, **kernel}
    groups = param_groups(model, cfg)
    if o.name == "muon":
        muon = {"momentum": o.muon_momentum, "nesterov": o.muon_nesterov, "weight_decay": o.muon_weight_decay,
                "ns_steps": o.muon_ns_steps, "adjust_lr_fn": o.muon_adjust_lr, "ns_fp32": fp32}
        return MuonAdamW(groups, muon, adamw)
    return torch.optim.AdamW(groups, lr=0.0, **adamw)


def set_lr(opt: torch.optim.Optimizer, lr: float) -> None:
    """Set every group's lr to ``lr * group['lr_scale']``."""
    for g in opt.param_groups:
        g["lr"] = lr * g.get("lr_scale", 1.0)


def describe_groups(optimizer: torch.optim.Optimizer, peak_lr: float) -> tuple[str, list[dict]]:
    """Which parameters each optimizer got, for the run's start event (``peak_lr``: ``optim.peak_lr``): one
    clause per group, e.g. ``Muon: 14 tensors, 0.10M params (64x64 x4, 32x64 x4, ...), peak lr 0.02,
    weight_decay 0``, and the same as values (``optimizer``, ``tensors``, ``params``, ``shapes`` {"AxB": count},
    ``peak_lr`` = ``peak_lr`` x the group's ``lr_scale``, ``weight_decay``, ``names``: the first four parameter
    names). Shapes are the whole tensors' (a DTensor's global shape), whatever the layout."""
    values = []
    for g in optimizer.param_groups:
        shapes: dict[str, int] = {}
        for p in g["params"]:
            key = "x".join(str(d) for d in p.shape)
            shapes[key] = shapes.get(key, 0) + 1
        values.append({"optimizer": "Muon" if g.get("muon") else "AdamW", "tensors": len(g["params"]),
                       "params": sum(p.numel() for p in g["params"]), "shapes": shapes,
                       "peak_lr": peak_lr * g.get("lr_scale", 1.0), "weight_decay": g["weight_decay"],
                       "names": g.get("names", [])[:4]})
    text = "; ".join(
        f"{v['optimizer']}: {v['tensors']} tensor{'' if v['tensors'] == 1 else 's'}, {v['params'] / 1e6:.2f}M params ("
        + ", ".join(f"{k} x{n}" for k, n in sorted(v["shapes"].items(), key=lambda kv: -kv[1])[:4])
        + (", ..." if len(v["shapes"]) > 4 else "")
        + f"), peak lr {v['peak_lr']:.3g}, weight_decay {v['weight_decay']:g}"
        for v in values)
    return text, values
