"""The planner behind ``densetrain plan`` and ``train --dry-run``: what to train and on what layout.

- :mod:`~densetrain.tools.plan.chinchilla`: compute-optimal parameters, tokens, FLOPs and wall time
  (Hoffmann et al. 2022), and the presets nearest to a plan;
- :mod:`~densetrain.tools.plan.memory`: bytes per GPU of a parallel layout at a stage (state, FSDP2
  gathers, activations with checkpointing, context and sequence parallelism, the chunked cross-entropy,
  pipeline stages: per-rank layers, micro-batches in flight, bubble, point-to-point bytes);
- :mod:`~densetrain.tools.plan.layouts`: the layouts of a number of GPUs that run each stage, ranked per stage
  by the cost model's step time (:mod:`densetrain.cost`), days, a published layout beside (Meta's for Llama 3
  405B);
- :mod:`~densetrain.tools.plan.rank`: the dry run of one rank of a job on a fake process group;
- :mod:`~densetrain.tools.plan.report`: their text forms.

Called by :mod:`densetrain.tools.commands`; the names below are the package's public surface.
"""

from densetrain.tools.plan.chinchilla import (
    CHINCHILLA_TABLE3,
    CHINCHILLA_TOKENS_PER_PARAM,
    FLOPS_PER_PARAM_TOKEN,
    Table3Row,
    gpu_cost,
    nearest_preset,
    nearest_table3_row,
    optimal_from_flops,
    plan,
    preset_shapes,
)
from densetrain.tools.plan.layouts import LOW_MFU, MAX_CP, candidate_layouts, layout_plan, schedules
from densetrain.tools.plan.memory import (
    AC_MODES,
    GIB,
    RESERVED_GIB,
    USABLE_FRACTION,
    activation_bytes_per_token,
    layout_memory,
    loss_chunk_bytes,
    model_counts,
)
from densetrain.tools.plan.report import format_cost, format_layout_plan, format_plan, human, human_time

__all__ = [
    "AC_MODES", "CHINCHILLA_TABLE3", "CHINCHILLA_TOKENS_PER_PARAM", "FLOPS_PER_PARAM_TOKEN", "GIB",
    "LOW_MFU", "MAX_CP", "RESERVED_GIB", "USABLE_FRACTION", "Table3Row", "activation_bytes_per_token",
    "candidate_layouts", "format_cost", "format_layout_plan", "format_plan", "gpu_cost", "human", "human_time",
    "layout_memory", "layout_plan", "loss_chunk_bytes", "model_counts", "nearest_preset", "nearest_table3_row",
    "optimal_from_flops", "plan", "preset_shapes", "schedules",
]
