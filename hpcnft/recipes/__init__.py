"""Recipes shipped with hpcnft (TOML files read by hpcnft.common.recipe_files)."""
