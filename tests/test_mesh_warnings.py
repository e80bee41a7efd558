"""Building the mesh and the FSDP2 sub-mesh of a context-parallel layout prints no PyTorch warning
(review of issue 40: every rank printed device_mesh.py's "Slicing a flattened dim from root mesh will be
deprecated" on each switch into, or resume onto, cp)."""

import warnings
from datetime import timedelta

import pytest

from densetrain.parallel.dist import set_group_timeouts
from densetrain.parallel.mesh import Layout, build_mesh, dp_mesh
from densetrain.tools.plan.rank import fake_world


@pytest.mark.parametrize("layout", [Layout(1, 2, 1, cp=2), Layout(2, 1, 1, cp=2), Layout(2, 2, 1, cp=2)],
                         ids=["fsdp_cp", "hsdp_cp_no_shard", "hsdp_cp"])
def test_cp_mesh_builds_without_a_deprecation_warning(layout):
    world = layout.dp_replicate * layout.dp_shard * layout.cp
    with fake_world(world, 0), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        mesh = build_mesh(layout, "cpu")
        sub = dp_mesh(mesh, layout)
        set_group_timeouts(mesh, timedelta(seconds=60), flattened=True)
        # The sub-mesh FSDP2 reduces over: replicate x (shard * cp) ranks, rank 0's row first.
        expect = (layout.dp_replicate, layout.dp_shard * layout.cp) if layout.dp_replicate > 1 \
            else (layout.dp_shard * layout.cp,)
        assert tuple(sub.mesh.shape) == expect
        assert sub.mesh.flatten().tolist()[0] == 0
        assert sorted(sub.mesh.flatten().tolist()) == list(range(world))
    flat = [str(w.message) for w in caught if "flattened" in str(w.message)]
    assert flat == []
