"""Name registries users pick from (tasks, filters): pure Python, importable by the config schema."""
