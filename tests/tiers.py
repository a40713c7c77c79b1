"""The test tiers (markers) and, where a session collects the whole tree, how many tests each
holds: conftest.py counts them, tests/unit/test_doc_links.py holds the README's table to them."""
import pytest

TIERS = ("slow", "hpc", "gpu")  # default: every test marked with none of these
COUNTS = pytest.StashKey[dict]()  # config.stash[COUNTS]: {tier: tests, "all": tests}
