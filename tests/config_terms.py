"""Reward terms for config tests: a remote judge whose operational settings (url, timeout_s,
retry_for_s, retries, token_env) a resume may change, and configs made of term tables as
`--set reward.terms=[...]` gives them."""
from __future__ import annotations

from hpcnft.algo.root_config import Config, load_config

# retry_for_s within the tiny recipe's layout.timeout_s (120 s)
JUDGE = 'kind="remote", name="ocr", url="http://judge:8000/v1/score/ocr", retry_for_s=30.0'


def judge(setting: str = "") -> str:
    """The remote term, one of its settings replaced or added (`key=value`)."""
    if not setting:
        return JUDGE
    key = setting.split("=")[0]
    kept = [item for item in JUDGE.split(", ") if not item.startswith(f"{key}=")]
    return ", ".join(kept + [setting])


def with_terms(*tables: str, steps: int | None = None) -> Config:
    """The tiny recipe with these reward terms (TOML inline tables)."""
    return load_config("tiny", [f"reward.terms=[{', '.join('{' + t + '}' for t in tables)}]"], steps=steps)
