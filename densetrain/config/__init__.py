"""The configuration tree: nested dataclasses, TOML presets, ``--a.b=value`` overrides, validation.

A leaf layer: it imports no torch and nothing of densetrain above the errors and the name registries.
The schema is split by section (:mod:`.schema`, :mod:`.data`, :mod:`.filters`); building, saving and
``--help-config`` live in :mod:`.loading`, cross-field checks in :mod:`.validate`, the local paths a run
directory's config.toml saves absolute (and an older one's relative paths) in :mod:`.paths`. Every name users
import is re-exported here.
"""

from densetrain.config.data import DataConfig, DecontamConfig, DedupConfig, SourceConfig
from densetrain.config.filters import (
    C4Config,
    FiltersConfig,
    FineWebConfig,
    GopherQualityConfig,
    GopherRepetitionConfig,
)
from densetrain.config.loading import (
    PRESET_DIR,
    help_text,
    list_presets,
    load_config,
    parse_overrides,
    save_config,
    to_dict,
)
from densetrain.config.paths import absolute_paths, anchor_run_paths
from densetrain.config.recovery import FaultConfig, GuardConfig, HealthConfig, ProbeConfig, WatchdogConfig
from densetrain.config.schema import (
    CheckpointConfig,
    Config,
    EvalConfig,
    LoggingConfig,
    ModelConfig,
    OptimConfig,
    ParallelConfig,
    ScheduleConfig,
    StageConfig,
    TrainConfig,
)
from densetrain.config.validate import stage_parallel, validate

__all__ = [
    "PRESET_DIR", "C4Config", "CheckpointConfig", "Config", "DataConfig", "DecontamConfig", "DedupConfig",
    "EvalConfig", "FaultConfig", "FiltersConfig", "GuardConfig", "HealthConfig", "ProbeConfig",
    "WatchdogConfig", "FineWebConfig",
    "GopherQualityConfig", "GopherRepetitionConfig",
    "LoggingConfig", "ModelConfig", "OptimConfig", "ParallelConfig", "ScheduleConfig", "SourceConfig", "StageConfig",
    "TrainConfig", "absolute_paths", "anchor_run_paths",
    "help_text", "list_presets", "load_config", "parse_overrides", "save_config", "stage_parallel",
    "to_dict",
    "validate",
]
