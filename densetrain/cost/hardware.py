"""Hardware profiles: what one GPU (and its links) can do, as data (``profiles/*.toml``, one file a GPU kind,
each citing its datasheet), read by the planner (``densetrain plan --hardware``) and written for this machine
by ``densetrain doctor --profile FILE`` from its own measurements."""

from __future__ import annotations

import json
import math
import tomllib
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import tomli_w

from densetrain.errors import ConfigError
from densetrain.fileio import atomic_write_bytes, json_text, read_text_bounded

PROFILES_DIR = Path(__file__).parent / "profiles"
HOST_FIELDS = ("dtensor_op_s", "fsdp_group_s", "all_gather_bytes_per_s", "reduce_scatter_bytes_per_s",
               "collectives_on_cores", "loss_parallel_logit_s", "gemm_call_s", "attention_call_s")
"""Optional figures of the host's share (:mod:`densetrain.cost.host`), each a number >= 0 (0: not modelled)."""


@dataclass(frozen=True)
class Hardware:
    """One GPU kind and its node. Rates are per GPU and per direction.

    ``peak_bf16_flops`` (FLOP/s, dense; the MFU denominator), ``peak_fp8_flops`` (FLOP/s, dense; equal to the
    bf16 peak where the GPU has no fp8), ``memory_gib`` (GiB), ``hbm_bytes_per_s`` (B/s), ``nvlink_bytes_per_s``
    (B/s within a node), ``net_bytes_per_s`` (B/s across nodes, the GPU's own NIC), ``gpus_per_node``,
    ``latency_intra_s`` / ``latency_inter_s`` (s per ring step of a collective), ``name``, ``source``.
    Optional: ``gemm_efficiency``, ``attention_efficiency``, ``network_efficiency``, ``hbm_efficiency``, the
    fractions of those rates the work reaches (0: the cost model's fitted constants, for datasheet rates; a
    measured profile sets 1, its rates being reached ones); ``sms``, the streaming multiprocessors a GEMM's
    output tiles are scheduled over in waves (0: not modelled); ``op_overhead_s``, the fixed cost of one
    operator (kernel launch and tail on a GPU; eager PyTorch's dispatch on a CPU, measured by ``doctor
    --profile``; 0: the cost model's default); ``loss_elements_per_s``, logits a second the cross-entropy's
    forward and backward get through (measured by ``doctor --profile``: on a CPU the exponentials bound it, not
    the bytes; 0: the logits' bytes at the memory bandwidth); ``nvls_bus_bytes_per_s``, the bus bandwidth NCCL's
    all-reduce reaches over all of a node's GPUs with NVLink SHARP (B/s, nccl-tests' busbw: it replaces the
    ring's ``nvlink_bytes_per_s`` x efficiency for that one case; 0: no NVLink SHARP); ``flex_forward_rate`` /
    ``flex_backward_rate``, FlexAttention's speed relative to SDPA's causal kernel on this GPU, forward / backward
    (densetrain's context parallelism runs FlexAttention: ``densetrain.cost.step.ATTENTION_KERNELS``; 0: the same).
    The host's share (:mod:`densetrain.cost.host`,
    measured by ``doctor --profile`` on a CPU, 0 in the GPU profiles, whose host work hides behind the kernels):
    ``dtensor_op_s`` (s a DTensor dispatch beyond its local operator), ``fsdp_group_s`` (s an FSDP2 group a
    micro-batch, forward and backward), ``all_gather_bytes_per_s`` / ``reduce_scatter_bytes_per_s`` (bus bytes a
    second of those collectives; 0: the link's), ``collectives_on_cores`` (1 where the collectives run on the
    compute's cores, gloo on a CPU: what the step model hides behind compute is charged),
    ``loss_parallel_logit_s`` (s a logit the vocabulary-parallel cross-entropy of tensor parallelism adds to the
    fused one), ``gemm_call_s`` / ``attention_call_s`` (s a GEMM call / a causal attention call, forward and
    backward, costs beside its FLOPs at the profile's rates, with the run's threads: on a CPU the thread team's
    wake-up, split and join).
    """

    name: str
    peak_bf16_flops: float
    peak_fp8_flops: float
    memory_gib: float
    hbm_bytes_per_s: float
    nvlink_bytes_per_s: float
    net_bytes_per_s: float
    gpus_per_node: int
    latency_intra_s: float
    latency_inter_s: float
    source: str = ""
    gemm_efficiency: float = 0.0
    attention_efficiency: float = 0.0
    network_efficiency: float = 0.0
    hbm_efficiency: float = 0.0
    sms: int = 0
    op_overhead_s: float = 0.0
    loss_elements_per_s: float = 0.0
    nvls_bus_bytes_per_s: float = 0.0
    flex_forward_rate: float = 0.0
    flex_backward_rate: float = 0.0
    dtensor_op_s: float = 0.0
    fsdp_group_s: float = 0.0
    all_gather_bytes_per_s: float = 0.0
    reduce_scatter_bytes_per_s: float = 0.0
    collectives_on_cores: float = 0.0
    loss_parallel_logit_s: float = 0.0
    gemm_call_s: float = 0.0
    attention_call_s: float = 0.0

    def to_toml(self) -> str:
        """The profile as a flat TOML table (what :func:`load_hardware` reads)."""
        return tomli_w.dumps(asdict(self))


RANGES = {
    # A value outside its range is a typo or a unit slip, not hardware: a profile of a laptop CPU (~1e10 FLOP/s,
    # ~1e9 B/s) to beyond B200's (2.25e15 bf16, 8e12 B/s HBM; NVIDIA B200 datasheet) by two orders of magnitude.
    # Past them the cost model's sums underflow or overflow (1e-300 FLOP/s gives inf seconds, then nan).
    "peak_bf16_flops": (1e6, 1e18), "peak_fp8_flops": (1e6, 1e18), "hbm_bytes_per_s": (1e6, 1e15),
    "nvlink_bytes_per_s": (1e3, 1e15), "net_bytes_per_s": (1e3, 1e15), "memory_gib": (1e-3, 1e6),
    "latency_intra_s": (1e-9, 10.0), "latency_inter_s": (1e-9, 10.0),
    # NVL72 racks put 72 GPUs in one NVLink domain; a node of a million is a unit slip
    "gpus_per_node": (1, 1 << 16),
}
"""Inclusive ``(low, high)`` of each required number of a profile (units of :class:`Hardware`)."""
OPTIONAL_MAX = {
    # the optional figures are >= 0 (0: not modelled); above these they are unit slips: FlexAttention 10x faster
    # than SDPA's kernel, a second per operator, a link faster than RANGES allows, a CPU share above 1
    "flex_forward_rate": 10.0, "flex_backward_rate": 10.0, "nvls_bus_bytes_per_s": 1e15,
    "all_gather_bytes_per_s": 1e15, "reduce_scatter_bytes_per_s": 1e15, "loss_elements_per_s": 1e18,
    "op_overhead_s": 1.0, "dtensor_op_s": 1.0, "fsdp_group_s": 1.0, "collectives_on_cores": 1.0, "sms": 1 << 20,
    "loss_parallel_logit_s": 1.0, "gemm_call_s": 1.0, "attention_call_s": 1.0,
}
"""Inclusive upper bound of each optional number of a profile (its lower bound is 0)."""


def profile_names() -> list[str]:
    """Names of the shipped profiles (``a100-80gb``, ``b200``, ``h100-96gb-500w``, ``h100-sxm``, ``h200``), sorted."""
    return sorted(p.stem for p in PROFILES_DIR.glob("*.toml"))


def load_hardware(spec: str | Path = "h100-sxm") -> Hardware:
    """A profile by shipped name (:func:`profile_names`) or from a ``.toml`` / ``.json`` file.

    Raises:
        ConfigError: no such file or name, a file that does not parse, a missing or unknown key, or a value
        that is not a finite positive number (``gpus_per_node`` a positive integer), not an object, or outside its
        :data:`RANGES`.
    """
    path = Path(spec)
    if not path.suffix and (PROFILES_DIR / f"{spec}.toml").exists():
        path = PROFILES_DIR / f"{spec}.toml"
    if not path.is_file():
        raise ConfigError(f"--hardware {spec}: no such file or profile (shipped: {', '.join(profile_names())})")
    try:
        text = read_text_bounded(path)
        raw = json.loads(text) if path.suffix == ".json" else tomllib.loads(text)
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ConfigError(f"{path}: not a hardware profile ({e})") from None
    if not isinstance(raw, dict):  # JSON may hold a list, a number or null
        raise ConfigError(f"{path}: not a hardware profile: expected an object of keys (name, peak_bf16_flops, ...), "
                          f"got {type(raw).__name__} {str(raw)[:40]}")
    names = {f.name: f for f in fields(Hardware)}
    unknown = sorted(set(raw) - set(names))
    optional = {"source", "sms", "op_overhead_s", "loss_elements_per_s", "nvls_bus_bytes_per_s",
                "flex_forward_rate", "flex_backward_rate", *HOST_FIELDS}
    missing = sorted(k for k in names if k not in raw and k not in optional and not k.endswith("_efficiency"))
    if unknown or missing:
        raise ConfigError(f"{path}: " + "; ".join(([f"unknown key(s) {', '.join(unknown)}"] if unknown else [])
                                                  + ([f"missing key(s) {', '.join(missing)}"] if missing else [])))
    for k, v in raw.items():
        if k in ("name", "source"):
            if not isinstance(v, str):
                raise ConfigError(f"{path}: {k} = {v!r}: expected a string")
        elif k in ("sms", "op_overhead_s", "loss_elements_per_s", "nvls_bus_bytes_per_s", "flex_forward_rate",
                   "flex_backward_rate", *HOST_FIELDS):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0 \
                    or (k == "sms" and int(v) != v):
                raise ConfigError(f"{path}: {k} = {v!r}: expected a number >= 0"
                                  + (" (an integer)" if k == "sms" else ""))
            if v > OPTIONAL_MAX[k]:
                raise ConfigError(f"{path}: {k} = {v!r}: expected a number in [0, {OPTIONAL_MAX[k]:g}]")
        elif k.endswith("_efficiency"):
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= 1:
                raise ConfigError(f"{path}: {k} = {v!r}: expected a fraction in [0, 1] (0: the fitted constant)")
        elif isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
            raise ConfigError(f"{path}: {k} = {v!r}: expected a finite number > 0")
        elif k == "gpus_per_node" and int(v) != v:
            raise ConfigError(f"{path}: gpus_per_node = {v!r}: expected an integer")
        elif k in RANGES and not RANGES[k][0] <= v <= RANGES[k][1]:
            raise ConfigError(f"{path}: {k} = {v!r}: expected a number in [{RANGES[k][0]:g}, {RANGES[k][1]:g}] "
                              "(units: FLOP/s, B/s, GiB, s)")
    return Hardware(**{**raw, "gpus_per_node": int(raw["gpus_per_node"]), "sms": int(raw.get("sms", 0))})


def write_hardware(hw: Hardware, path: str | Path) -> Path:
    """Write ``hw`` to ``path`` atomically (TOML, or JSON for a ``.json`` name); returns the path."""
    path = Path(path)
    text = json_text(asdict(hw), indent=1) + "\n" if path.suffix == ".json" else hw.to_toml()
    atomic_write_bytes(path, text.encode())
    return path


def measured_hardware(matmul_flops: float, copy_bytes_per_s: float, collective_bytes_per_s: float | None,
                      gpus_per_node: int, memory_gib: float, name: str, op_overhead_s: float = 0.0,
                      collective_latency_s: float | None = None, loss_elements_per_s: float = 0.0,
                      attention_flops: float = 0.0, host: dict[str, float] | None = None) -> Hardware:
    """A profile of this machine from ``doctor``'s measurements: the matmul rate stands for both peaks (so the
    profile's MFU is relative to what this machine reaches, as the training log's is without
    ``logging.peak_flops``), the copy rate for the memory bandwidth, the collective bus bandwidth (None on
    one process: the copy rate) for both links; latencies the measured one per ring step
    (``collective_latency_s``, else a gloo-scale 50 µs); the measured fixed cost of one operator
    (``op_overhead_s``) and the cross-entropy's rate (``loss_elements_per_s``); efficiencies 1 (the rates are
    reached ones, not datasheet peaks) but attention's, the measured attention rate over the matmul rate
    (``attention_flops``; 0: 1); ``host``: the host's share by :data:`HOST_FIELDS` name (absent: 0)."""
    link = collective_bytes_per_s or copy_bytes_per_s
    lat = collective_latency_s or 50e-6
    return Hardware(name=name, peak_bf16_flops=matmul_flops, peak_fp8_flops=matmul_flops, memory_gib=memory_gib,
                    hbm_bytes_per_s=copy_bytes_per_s, nvlink_bytes_per_s=link, net_bytes_per_s=link,
                    gpus_per_node=max(1, gpus_per_node), latency_intra_s=lat, latency_inter_s=lat,
                    source="measured by densetrain doctor --profile", gemm_efficiency=1.0,
                    attention_efficiency=min(1.0, attention_flops / matmul_flops) if attention_flops else 1.0,
                    network_efficiency=1.0, hbm_efficiency=1.0, op_overhead_s=op_overhead_s,
                    loss_elements_per_s=loss_elements_per_s, **(host or {}))
