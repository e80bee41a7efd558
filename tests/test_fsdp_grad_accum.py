"""Gradient accumulation under FSDP2 keeps gradients sharded (densetrain.parallel.wrap.grad_sync).

Before session 16 every micro-batch but a step's last ran under FSDP2's ``set_requires_gradient_sync(False)``,
which holds each parameter's whole gradient in fp32 on every rank until the last backward (4 bytes a
parameter: ~30 GiB a rank for an 8B model on 8 GPUs, beyond the memory plan). Now FSDP2 reduce-scatters every
micro-batch; HSDP defers only the replicas' all-reduce. Four real gloo ranks (FSDP 4, HSDP 2 x 2); the
accumulated gradient must equal the sum over both micro-batches and all ranks computed on one process.
"""

from __future__ import annotations

import json
from pathlib import Path

from conftest import run_script_ranks

_WORKER = r"""
import json, os, sys
root, out = sys.argv[1:]
sys.path.insert(0, root)
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from densetrain.parallel.wrap import grad_sync

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
res = {}
for name, shape, dims in (("fsdp", (4,), ("dp_shard",)), ("hsdp", (2, 2), ("dp_replicate", "dp_shard"))):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    ref = [p.detach().clone() for p in model.parameters()]
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=dims)
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    data = torch.randn(world, 2, 3, 8, generator=torch.Generator().manual_seed(1))  # rank, micro-batch, rows, in
    seen = []
    for i in range(2):
        with grad_sync(model, enabled=i == 1):
            (model(data[rank, i]).square().sum() * world).backward()  # x world: FSDP2's reduction is a mean
        if i == 0:  # after the first micro-batch: what this rank holds of the gradients, and where
            seen = [None if p.grad is None else list(p.grad.to_local().shape) for p in model.parameters()]
            groups = [m._get_fsdp_state()._fsdp_param_group for m in model.modules() if isinstance(m, FSDPModule)]
            groups = [g for g in groups if g is not None]
            unsharded = sum(t.numel() for g in groups for fp in g.fsdp_params
                            for t in (fp.unsharded_accumulated_grad,
                                      getattr(getattr(fp, "_unsharded_param", None), "grad", None)) if t is not None)
            partial = sum(g._partial_reduce_output.numel() for g in groups if g._partial_reduce_output is not None)
    full = [p.grad.full_tensor() for p in model.parameters()]
    # the same on one process: every rank's both micro-batches
    plain = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    with torch.no_grad():
        for p, r in zip(plain.parameters(), ref):
            p.copy_(r)
    plain(data.reshape(-1, 8)).square().sum().backward()
    res[name] = {"after_first": seen, "shapes": [list(p.shape) for p in plain.parameters()],
                 "unsharded": unsharded, "partial": partial, "numel": sum(p.numel() for p in plain.parameters()),
                 "err": max(float((a - p.grad).abs().max()) for a, p in zip(full, plain.parameters()))}
with open(f"{out}.{rank}", "w") as f:
    json.dump(res, f)
dist.destroy_process_group()
sys.stdout.flush(); sys.stderr.flush(); os._exit(0)
"""


def test_fsdp2_accumulates_sharded_gradients_equal_to_one_process(tmp_path: Path):
    out = run_script_ranks(_WORKER, tmp_path, "grad_accum", world=4, timeout=180)
    for r in range(4):
        res = json.loads(Path(f"{out}.{r}").read_text())
        fsdp, hsdp = res["fsdp"], res["hsdp"]
        # after a non-final micro-batch no rank holds a whole gradient (before: every parameter's, as FSDP2's
        # unsharded parameter's .grad); FSDP 4: each rank's quarter of dim 0 as .grad; HSDP 2 x 2: the
        # reduce-scattered half waits for the replicas' all-reduce in FSDP2's partial reduce output
        assert fsdp["unsharded"] == 0 and hsdp["unsharded"] == 0, res
        assert fsdp["after_first"] == [[s[0] // 4, *s[1:]] for s in fsdp["shapes"]], fsdp
        assert hsdp["after_first"] == [None] * 4 and hsdp["partial"] == hsdp["numel"] // 2, hsdp
        assert fsdp["err"] < 1e-5 and hsdp["err"] < 1e-5, res
