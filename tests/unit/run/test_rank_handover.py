"""A spawned rank starts from the config the spawner resolved, handed over whole (run.rank:
START_ENV): it parses neither the recipe nor the --set strings again, so a recipe file changed
or gone after `hpcnft run` read it changes nothing in the job."""
from __future__ import annotations

from hpcnft.algo.root_config import load_config
from hpcnft.run.rank import START_ENV, handover, taken_over


def test_a_rank_takes_the_resolved_config_and_reads_no_recipe(tmp_path):
    recipe = tmp_path / "mine.toml"
    recipe.write_text('base = "tiny"\nsteps = 3\n\n[train]\nseed = 7\n')
    overrides = ["rollout.seed=5", 'reward.terms=[{kind = "jpeg_compressibility"}]']
    cfg = load_config(str(recipe), overrides, run_dir=str(tmp_path / "run"))
    env = handover(cfg, str(recipe), overrides)
    assert list(env) == [START_ENV]
    recipe.write_text("this is no TOML [")  # a rank that parsed the recipe again would fail here
    got, name, said = taken_over(env)
    assert got == cfg and (name, said) == (str(recipe), overrides)
    assert (got.steps, got.train.seed, got.rollout.seed, got.reward.terms[0].kind) == (3, 7, 5, "jpeg_compressibility")
    recipe.unlink()
    assert taken_over(env)[0] == cfg
