"""The cost model, pure math (no torch, no process groups): FLOPs per token (the MFU count the training log, the
planner and the ladder share), hardware profiles as data, and the time of a training step by its parts.

- :mod:`~densetrain.cost.flops`: :func:`flops_per_token` (torchtitan's and Llama 3's MFU count), per-op shapes;
- :mod:`~densetrain.cost.hardware`: :class:`Hardware` profiles (``profiles/*.toml``), ``--hardware FILE``;
- :mod:`~densetrain.cost.step`: :func:`step_time` (compute, communication per mesh dimension, overlap, bubble);
- :mod:`~densetrain.cost.host`: the host's share of a step (DTensor and FSDP2 Python work, gloo on the cores).

Read by ``densetrain plan`` (tools/plan/), the dry run, ``doctor --profile`` and :mod:`densetrain.metrics`.
"""

from densetrain.cost.flops import Shape, flops_per_token, mfu, shape_of
from densetrain.cost.hardware import Hardware, load_hardware, measured_hardware, profile_names, write_hardware
from densetrain.cost.step import AC_RECOMPUTE, CHECKED_ERROR, Parallel, bubble_share, parallel_of, step_time

__all__ = ["AC_RECOMPUTE", "CHECKED_ERROR", "Hardware", "Parallel", "Shape", "bubble_share", "flops_per_token",
           "load_hardware", "measured_hardware", "mfu", "parallel_of", "profile_names", "shape_of", "step_time",
           "write_hardware"]
