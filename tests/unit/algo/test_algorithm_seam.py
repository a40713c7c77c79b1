"""The algorithm seam: outside its folder (hpcnft/algo/<name>/) and the registry, no module of
hpcnft names an algorithm or its loss key (the default algorithm's name is algo.name's default);
every registered algorithm is a complete hpcnft.algo.protocol.Algorithm."""
from __future__ import annotations

import inspect
import os

import pytest

from hpcnft.algo.protocol import Algorithm
from hpcnft.algo.registry import ALGORITHMS, algorithm_for, spec_of, specs
from hpcnft.algo.root_config import load_config
from hpcnft.common.recipe_files import recipe_names

PACKAGE = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))),
                       "hpcnft")


def sources():
    for root, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(root, name)
                yield os.path.relpath(path, PACKAGE), open(path, encoding="utf-8").read()


@pytest.mark.parametrize("spec", specs(), ids=lambda s: s.name)
def test_no_module_outside_the_folder_and_the_registry_names_the_algorithm(spec):
    folder = ALGORITHMS[spec.name].rsplit(".", 1)[0].removeprefix("hpcnft.").replace(".", os.sep) + os.sep
    words = [f'"{spec.name}"', spec.loss_key.removeprefix("train/")] + ([spec.name] if "_" in spec.name else [])
    found = [f"{path}: {word}" for path, text in sources() for word in words
             if word in text and not path.startswith(folder)
             and path != os.path.join("algo", "registry.py")
             and not (path == os.path.join("algo", "config.py") and word == f'"{spec.name}"'
                      and load_config("tiny").algo.name == spec.name)]  # algo.name's default
    assert found == []


@pytest.mark.parametrize("name", list(ALGORITHMS))
def test_every_algorithm_has_what_the_protocol_names(name):
    # a tiny recipe of the algorithm's (every algorithm comes with one)
    recipe = next(r for r in sorted(recipe_names()) if r.startswith("tiny") and load_config(r).algo.name == name)
    algorithm = algorithm_for(load_config(recipe))
    wanted = {n for n, _ in inspect.getmembers(Algorithm, inspect.isfunction)} - set(dir(object))
    assert wanted <= set(dir(algorithm)) and algorithm.spec is spec_of(name)
    for method in wanted:
        params = list(inspect.signature(getattr(Algorithm, method)).parameters)[1:]
        assert list(inspect.signature(getattr(algorithm, method)).parameters) == params, method
