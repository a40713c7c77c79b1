"""The bottom layer: the config machinery (TOML recipes, `--set`, per-key rules), errors and exit codes, determinism, small torch helpers."""
