"""The memory budget (hpcnft.perf.memory): the fastest measured rung within a budget, the
refusal of settings that need more, before any model loads; the per-card recipes are the rungs;
the text encoders offloaded between a step's encoder passes; the VAE decoded in slices."""
from __future__ import annotations

import json
import os

import pytest
import torch

from hpcnft.algo.root_config import load_config
from hpcnft.perf import memory

# made-up peaks and times, fastest first (the committed ones are the bench's: memory_rungs.json)
MEASURED = {"sd35m": {"80": {"peak_gib": 70.0, "iteration_s": 15.0}, "48": {"peak_gib": 41.0, "iteration_s": 17.0},
                      "40": {"peak_gib": 33.0, "iteration_s": 19.0}, "24": {"peak_gib": 20.0, "iteration_s": 30.0}}}
LADDER = memory.with_measurements(memory.CANDIDATES, MEASURED)["sd35m"]


def settings(recipe: str, *overrides: str) -> dict:
    return memory.settings_of(load_config(recipe, list(overrides)))


def test_the_budget_takes_the_fastest_measured_rung_within_it():
    assert [memory.fastest_within(LADDER, b).card_gib for b in (80, 75, 45, 40, 35, 24)] == \
        [80, 48, 40, 40, 24, 24]  # run under a cap within the budget, its peak too
    assert memory.fastest_within(LADDER, 23.9) is None  # the 24 GB rung peaked at 20, but under a 24 GiB cap
    assert memory.fastest_within(memory.CANDIDATES["sd35m"], 80) is None  # nothing measured: nothing chosen


@pytest.mark.parametrize("card", [24, 40, 48, 80])
def test_each_cards_recipe_holds_its_rungs_settings_and_budget(card):
    rung = next(r for r in memory.CANDIDATES["sd35m"] if r.card_gib == card)
    cfg = load_config(rung.recipe)
    assert memory.settings_of(cfg) == rung.settings
    assert cfg.perf.memory_budget_gib == card
    assert memory.check_budget(memory.settings_of(cfg), "sd35m", card, LADDER) == ("", "")


def test_settings_measured_over_the_budget_are_refused_naming_what_fits():
    refusal, note = memory.check_budget(settings("sd35m_pickscore_80gb"), "sd35m", 24, LADDER)
    assert refusal == ("perf.memory_budget_gib = 24: these settings measured 70.0 GiB per GPU; within 24 GiB: "
                       "recipe sd35m_pickscore_24gb: 20.0 GiB, 30.0 s per iteration") and not note


def test_settings_at_least_a_measured_rung_over_the_budget_are_refused():
    # the 40 GB rung with a bigger rollout batch: at least its 33 GiB
    refusal, _ = memory.check_budget(settings("sd35m_pickscore_40gb", "rollout.batch_size=32"), "sd35m", 24, LADDER)
    assert refusal.startswith("perf.memory_budget_gib = 24: these settings need at least what sd35m_pickscore_40gb's "
                              "measured, 33.0 GiB per GPU; within 24 GiB: recipe sd35m_pickscore_24gb")
    # the reference recipe keeps its encoders on the GPU and checkpoints: not known to need 33, not known to fit
    refusal, note = memory.check_budget(settings("sd35m_pickscore"), "sd35m", 24, LADDER)
    assert not refusal and note.startswith("perf.memory_budget_gib = 24: these sd35m settings were not measured; "
                                           "the fastest measured within the budget is recipe sd35m_pickscore_24gb")


def test_a_budget_below_every_measurement_names_the_smallest_need():
    refusal, _ = memory.check_budget(settings("sd35m_pickscore_24gb"), "sd35m", 16, LADDER)
    assert refusal == ("perf.memory_budget_gib = 16: no sd35m setting was measured within 16 GiB per GPU; the "
                       "smallest measured need is a 24 GiB cap (sd35m_pickscore_24gb, peak 20.0 GiB)")


def test_a_model_without_measurements_is_not_checked():
    assert memory.check_budget(settings("tiny"), "these models", 8, ()) == \
        ("", "perf.memory_budget_gib = 8: no measured settings for these models: the budget is not checked")


@pytest.mark.parametrize("change,more", [
    ({"rollout.batch_size": 32}, True), ({"train.micro_batch": 4}, False), ({"train.grad_checkpointing": True}, False),
    ({"perf.text_encoders": "device"}, True), ({"perf.vae_decode_batch": 0}, True), ({"perf.old_pass_batch": 4}, False),
    ({"train.finetune": "full"}, True), ({"rollout.height": 256}, False), ({"perf.fsdp_cpu_offload": True}, False),
    ({"perf.base_fp8_storage": True}, False)])
def test_settings_need_at_least_a_rung_when_they_are_at_least_its_in_every_respect(change, more):
    rung = next(r for r in LADDER if r.card_gib == 24)
    assert memory.needs_at_least(rung.settings, rung)
    assert memory.needs_at_least({**rung.settings, **change}, rung) is more


def test_the_committed_measurements_are_the_bench_jsons():
    """memory_rungs.json holds what docs/bench's JSON of each rung recorded, for the candidates."""
    with open(memory.MEASURED) as f:
        committed = json.load(f)
    root = os.path.dirname(os.path.dirname(memory.__file__))
    for model, cards in committed.items():
        rungs = {str(r.card_gib): r for r in memory.CANDIDATES[model]}
        for card, got in cards.items():
            with open(os.path.join(os.path.dirname(root), got["source"])) as f:
                doc = json.load(f)
            entry = next(e for e in doc["memory_caps"] if e["recipe"] == rungs[card].recipe and e["fits"])
            recorded, settings = entry["settings"], rungs[card].settings
            assert {k: v for k, v in settings.items() if k in recorded} == recorded
            # keys newer than the measurement: the rung keeps them at their defaults, as it ran
            defaults = memory.settings_of(load_config("tiny"))
            assert {k: v for k, v in settings.items() if k not in recorded} == \
                {k: defaults[k] for k in settings if k not in recorded}
            assert got["peak_gib"] == round(entry["peak_gib"], 1)
            assert got["iteration_s"] == round(entry["iteration_s"], 1)


def test_offloaded_text_encoders_encode_a_steps_new_prompts_in_one_pass_with_the_same_bits(tiny_models):
    from hpcnft.algo.sampler import PromptEncoder
    from hpcnft.models.families import family_named

    family = family_named("sd3")
    pipe = family.load(tiny_models[0], torch.float32, torch.device("cpu"), torch.device("cpu"))
    plain = PromptEncoder(pipe, 16, torch.device("cpu"), cfg=True)(["a cat", "a dog"])
    offloaded = PromptEncoder(pipe, 16, torch.device("cpu"), cfg=True, offload=True)
    offloaded.prepare(["a cat", "a dog", "a cat"])  # a step's prompts, before its chunks
    first, second = offloaded(["a cat"]), offloaded(["a dog"])
    assert offloaded.passes == 1 and set(offloaded.cache) == {"a cat", "a dog", ""}
    again = offloaded(["a dog", "a cat"])
    assert offloaded.passes == 1  # all cached: no encoder pass
    offloaded(["a bird"])
    assert offloaded.passes == 2
    assert torch.equal(plain.prompt_embeds, torch.cat([first.prompt_embeds, second.prompt_embeds]))
    assert torch.equal(plain.pooled, torch.cat([first.pooled, second.pooled]))
    assert torch.equal(plain.prompt_embeds, again.prompt_embeds.flip(0))
    assert torch.equal(plain.neg_prompt_embeds[:1], again.neg_prompt_embeds[:1])
    assert all(pe.device.type == "cpu" for pe, _ in offloaded.cache.values())


def test_an_iteration_and_an_evaluation_each_encode_their_new_prompts_in_one_pass(hpcnft_cache):
    """The tiny iteration (16 samples in rollout chunks of 4) with the tiny text encoders offloaded:
    one encoder pass for a step's new prompts, one for the evaluation's (in chunks too)."""
    from hpcnft.bench.shapes import _MESH, tiny_shapes
    from hpcnft.bench.stack import HpcnftStack

    stack = HpcnftStack("t", "t", tiny_shapes(), torch.device("cpu"),
                        {"perf.text_encoders": "offload", "rollout.batch_size": 4, "eval.num_prompts": 8},
                        real_text=True)
    try:
        learner, iterate = stack.train_rank, stack.iteration()[0]
        iterate()  # step 1 (its prompts: encoded at construction, for the DiT's FLOP count)
        before = learner.encoder.passes
        iterate()  # step 2: new prompts
        assert learner.encoder.passes == before + 1
        learner.evaluate()
        assert learner.encoder.passes == before + 2
    finally:
        stack.close()
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        _MESH.clear()


def test_fsdp_cpu_offload_shards_under_the_offload_policy_on_one_rank_and_trains_the_same_bits(hpcnft_cache):
    """A full fine-tune's iteration under perf.fsdp_cpu_offload: FSDP2 wraps the DiT even where
    skip_single_rank_fsdp would not, every group under CPUOffloadPolicy, and the trained weights
    are those of FSDP2 without it (on the CPU the policy's copies move nothing: the math is what
    is compared; tests/gpu checks where the state lives on a GPU)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule

    from hpcnft.bench.shapes import _MESH, tiny_shapes
    from hpcnft.bench.stack import HpcnftStack
    from hpcnft.common.tensors import local_shard

    trained = {}
    try:
        for offload in (False, True):
            stack = HpcnftStack("t", "t", tiny_shapes(), torch.device("cpu"),
                                {"train.finetune": "full", "rollout.batch_size": 4, "perf.fsdp_cpu_offload": offload,
                                 "perf.skip_single_rank_fsdp": offload})
            stack.iteration()[0]()
            states = [m._get_fsdp_state()._fsdp_param_group for m in stack.policy.transformer.modules()
                      if isinstance(m, FSDPModule)]
            assert [g for g in states if g is not None]
            assert all(isinstance(g.offload_policy, CPUOffloadPolicy) is offload for g in states if g is not None)
            trained[offload] = [local_shard(p).detach().clone() for p in stack.policy.trainable]
            stack.close()
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        _MESH.clear()
    assert len(trained[True]) == len(trained[False]) > 0
    assert all(torch.equal(a, b) for a, b in zip(trained[True], trained[False]))


def test_the_vae_decodes_in_slices_of_the_batch_it_is_given(tiny_models):
    from hpcnft.algo.sampler import decode_to_uint8
    from hpcnft.models.families import family_named

    vae = family_named("sd3").load(tiny_models[0], torch.float32, torch.device("cpu")).vae
    sizes = []
    decode = vae.decode
    vae.decode = lambda z, **k: (sizes.append(len(z)), decode(z, **k))[1]
    latents = torch.randn(5, vae.config.latent_channels, 8, 8, generator=torch.Generator().manual_seed(0))
    whole = decode_to_uint8(vae, latents)
    sliced = decode_to_uint8(vae, latents, batch=2)
    assert sizes == [5, 2, 2, 1] and sliced.shape == whole.shape
    assert (sliced.int() - whole.int()).abs().max() <= 1  # conv batch size may change a rounding
