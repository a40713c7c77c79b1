"""Prompt files shipped for the tiny recipe (the tiny tokenizers were learned from them)."""
