"""Hugging Face interop: export our Transformer (or a training checkpoint of any layout) as a
``LlamaForCausalLM`` folder, and import one back, with logits equal to 1e-4 in fp32.

The room: :mod:`.mapping` (tensor names, RoPE fields, ``config.json``, μP folding: what both directions
share), :mod:`.export` (``densetrain export``: the atomic export folder, the tokenizer files, the
checkpoint read tensor by tensor) and :mod:`.load` (``densetrain import-hf``: a local folder, checked).
Called by the CLI (``export``, ``import-hf``); the names below are the public ones.
"""

from densetrain.hf.export import (
    check_checkpoint_matches,
    check_export_target,
    checkpoint_model_tensors,
    export_hf,
    export_hf_from_checkpoint,
    generation_config_file,
    read_checkpoint_tensor,
    special_token_ids,
    tokenizer_files,
)
from densetrain.hf.load import import_hf
from densetrain.hf.mapping import (
    from_hf_state_dict,
    hf_config_dict,
    rope_parameters,
    rope_scaling_from_hf,
    to_hf_state_dict,
)

__all__ = [
    "check_checkpoint_matches", "check_export_target", "checkpoint_model_tensors", "export_hf",
    "export_hf_from_checkpoint", "from_hf_state_dict", "generation_config_file", "hf_config_dict", "import_hf",
    "read_checkpoint_tensor", "rope_parameters", "rope_scaling_from_hf", "special_token_ids", "to_hf_state_dict",
    "tokenizer_files",
]
