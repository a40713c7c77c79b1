"""The bottom layer: config, errors and exit codes, determinism, small torch helpers."""
