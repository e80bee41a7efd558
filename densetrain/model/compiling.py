"""The compile cache of torch.compile (inductor), one directory per torch version and CPU capability.

Every place that compiles (the bf16 cross-entropy in train/step.py, ``train.compile`` and
``parallel.compile_blocks`` in parallel/parallelize.py, FlexAttention in model/masks.py) calls
:func:`pin_inductor_cache` first, so the pin holds whichever compiles first in a process: a run, an
offline eval or a test calling the compiled loss directly (under ``ATEN_CPU_CAPABILITY=avx2`` that test
segfaulted on AVX-512 kernels from the shared default directory when only the trainer's setup pinned it).
"""

from __future__ import annotations

import getpass
import os
import tempfile

import torch


def pin_inductor_cache() -> str:
    """Give torch.compile (inductor) a cache directory of this torch version and CPU capability, unless
    ``TORCHINDUCTOR_CACHE_DIR`` names another directory than torch's default; runs before each compile site's first
    compile. Returns the directory in effect.

    The directory is torch's default (``<tempdir>/torchinductor_<user>``, as
    ``torch._inductor.runtime.cache_dir_utils.default_cache_dir`` builds it) plus
    ``<torch version>-<capability>``, the capability being the one ATen dispatches to
    (:func:`torch.backends.cpu.get_cpu_capability`, lowered; ``ATEN_CPU_CAPABILITY`` can lower it), e.g.
    ``/tmp/torchinductor_alice/2.13.0+cpu-avx512``. Why: inductor's cache key leaves the capability out,
    and kernels cached under AVX-512 segfaulted when loaded from a shared directory under
    ``ATEN_CPU_CAPABILITY=avx2`` (nodes of a cluster with mixed CPUs sharing a home or /tmp).
    """
    try:
        user = getpass.getuser()
    except (KeyError, OSError):  # no passwd entry (some containers): torch names it by uid too
        user = f"uid_{os.getuid()}"
    base = os.path.join(tempfile.gettempdir(), f"torchinductor_{user}")
    # Unset, or torch's own default: inductor writes that into the environment at its first compile (one of
    # the user's, or of a library's, before ours), so it is not a choice; any other directory is the user's.
    if os.environ.get("TORCHINDUCTOR_CACHE_DIR") in (None, base):
        cap = torch.backends.cpu.get_cpu_capability().lower()
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(base, f"{torch.__version__}-{cap}")
    return os.environ["TORCHINDUCTOR_CACHE_DIR"]
