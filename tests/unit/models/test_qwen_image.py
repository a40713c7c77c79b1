"""Qwen-Image through the family seam: the tiny Qwen-Image (real classes, byte-identical builds,
a tokenizer whose template prefix is the 34 tokens QwenImagePipeline drops) samples as
QwenImagePipeline does, bit for bit, with and without true CFG (its renormalisation included),
on the same padded embeddings and masks; prompts encode as the pipeline encodes them, padded and
masked; the DiT gets sigma, the mask and the image shapes; the VAE decodes as the pipeline does."""
from __future__ import annotations

import pytest
import torch

from hpcnft.algo.root_config import ConfigError, load_config
from hpcnft.algo.sampler import PromptEncoder, decode_to_uint8, euler_sample, guided_velocity, null_autocast
from hpcnft.models.families import QWEN_IMAGE, family_named, family_of
from hpcnft.models.families.qwen_image import pack, unpack
from hpcnft.models.tiny import tree_digest
from hpcnft.models.tiny_qwen_image import REAL_VOCAB, build_tiny_qwen_image

CPU = torch.device("cpu")
PROMPTS = ["a photo of a cat sitting on a red chair", "a bowl of ramen with chopsticks"]


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("qwen") / "qwen_image_tiny"
    path.mkdir()
    return build_tiny_qwen_image(str(path))


@pytest.fixture(scope="module")
def qwen(qwen_dir):
    return QWEN_IMAGE.load(qwen_dir, torch.float32, CPU)


def test_two_builds_of_the_tiny_qwen_image_are_byte_identical(qwen_dir, tmp_path):
    again = tmp_path / "qwen_image_tiny"
    again.mkdir()
    assert tree_digest(build_tiny_qwen_image(str(again))) == tree_digest(qwen_dir)


def test_the_tiny_parts_are_qwen_images_classes_and_its_tokenizer_drops_the_prefix_as_the_real_one(qwen):
    assert [type(getattr(qwen, p)).__name__ for p in ("transformer", "vae", "text_encoder", "tokenizer")] == \
        ["QwenImageTransformer2DModel", "AutoencoderKLQwenImage", "Qwen2_5_VLForConditionalGeneration",
         "Qwen2Tokenizer"]
    assert family_of(qwen.transformer) is QWEN_IMAGE and family_named("qwen_image") is QWEN_IMAGE
    tok, template = qwen.tokenizer, qwen.prompt_template_encode
    prefix = tok(template.split("{}")[0])["input_ids"]
    assert len(prefix) == qwen.prompt_template_encode_start_idx == 34  # each word one token, as in Qwen2's vocab
    ids = tok(template.format(PROMPTS[0]))["input_ids"]
    assert max(ids) < REAL_VOCAB and max(ids) < qwen.text_encoder.config.text_config.vocab_size
    assert tok.convert_ids_to_tokens(ids[34:])[-5:] == ["<|im_end|>", "Ċ", "<|im_start|>", "assistant", "Ċ"]


def test_prompts_encode_as_qwenimagepipeline_encodes_them_padded_and_masked(qwen):
    pe, mask = QWEN_IMAGE.encode_prompt(qwen, PROMPTS[0], 24, CPU)
    want, _ = qwen.encode_prompt(PROMPTS[0], max_sequence_length=24)
    n = want.shape[1]
    assert pe.shape == (1, 24, 32) and mask.dtype == torch.long and 0 < n < 24
    assert torch.equal(pe[:, :n], want) and not pe[:, n:].any()
    assert mask.tolist() == [[1] * n + [0] * (24 - n)]
    short, _ = QWEN_IMAGE.encode_prompt(qwen, PROMPTS[0], 8, CPU)  # cut as the pipeline cuts
    assert torch.equal(short, want[:, :8])
    assert [name for name, _, _ in QWEN_IMAGE.token_limits(qwen, 24)] == ["Qwen2.5-VL"]
    assert QWEN_IMAGE.prompt_tokens(24) == 24


def test_packing_is_qwenimagepipelines_and_unpacking_inverts_it(qwen):
    x = torch.randn(2, 16, 8, 6)
    assert torch.equal(pack(x), type(qwen)._pack_latents(x, 2, 16, 8, 6))
    assert torch.equal(unpack(pack(x), 8, 6), x)


@pytest.mark.parametrize("guidance,size,steps", [(1.0, (64, 64), 6), (4.0, (64, 96), 4)])
def test_the_euler_rollout_is_qwenimagepipelines_bit_for_bit(qwen, guidance, size, steps):
    """Same noise (packed for the pipeline), the same padded embeddings and masks (the negative
    prompt's too, with true CFG: two passes combined and renormalised per token as
    QwenImagePipeline does): the final latents and the sigma grid agree exactly."""
    height, width = size
    cond = PromptEncoder(qwen, 24, CPU, cfg=guidance > 1)(PROMPTS)
    shape = QWEN_IMAGE.latent_shape(qwen, height, width)
    noise = torch.randn((2, *shape), generator=torch.Generator().manual_seed(0))
    sigmas = QWEN_IMAGE.sigma_grid(qwen.scheduler, steps, shape)
    ours = euler_sample(qwen.transformer, noise.clone(), sigmas, cond, guidance, torch.float32, null_autocast)
    negative = dict(negative_prompt_embeds=cond.neg_prompt_embeds, negative_prompt_embeds_mask=cond.neg_pooled) \
        if guidance > 1 else {}
    theirs = qwen(prompt_embeds=cond.prompt_embeds, prompt_embeds_mask=cond.pooled, latents=pack(noise),
                  true_cfg_scale=guidance, num_inference_steps=steps, height=height, width=width,
                  output_type="latent", **negative).images
    assert torch.equal(qwen.scheduler.sigmas.float(), sigmas)
    assert torch.equal(ours, unpack(theirs, *shape[1:]))


def test_true_cfg_is_renormalised_to_the_conditional_velocitys_norm(qwen):
    cond = PromptEncoder(qwen, 24, CPU, cfg=True)(PROMPTS[:1])
    x = torch.randn(1, 16, 8, 8)
    guided = guided_velocity(qwen.transformer, x, torch.tensor(0.5), cond, 4.0, torch.float32, null_autocast)
    plain = guided_velocity(qwen.transformer, x, torch.tensor(0.5), cond, 1.0, torch.float32, null_autocast)
    assert torch.allclose(pack(guided).norm(dim=-1), pack(plain).norm(dim=-1), rtol=1e-5)
    assert not torch.allclose(guided, plain)


def test_the_vae_decodes_as_qwenimagepipeline_does(qwen):
    cond = PromptEncoder(qwen, 24, CPU, cfg=False)(PROMPTS)
    noise = torch.randn((2, 16, 8, 8), generator=torch.Generator().manual_seed(1))
    sigmas = QWEN_IMAGE.sigma_grid(qwen.scheduler, 3, (16, 8, 8))
    x0 = euler_sample(qwen.transformer, noise.clone(), sigmas, cond, 1.0, torch.float32, null_autocast)
    theirs = qwen(prompt_embeds=cond.prompt_embeds, prompt_embeds_mask=cond.pooled, latents=pack(noise),
                  true_cfg_scale=1.0, num_inference_steps=3, height=64, width=64, output_type="pt").images
    assert torch.equal((QWEN_IMAGE.decode(qwen.vae, x0) / 2 + 0.5).clamp(0, 1), theirs)
    assert decode_to_uint8(qwen.vae, x0, family=QWEN_IMAGE).shape == (2, 64, 64, 3)


def test_padding_changes_the_velocity_by_rounding_only(qwen):
    """The pipeline gives one prompt its own length and no mask; the family pads every prompt to
    rollout.max_sequence_length and masks the padding: the same velocity up to float rounding."""
    cond = PromptEncoder(qwen, 24, CPU, cfg=False)(PROMPTS[:1])
    unpadded, _ = qwen.encode_prompt(PROMPTS[0], max_sequence_length=24)
    x = torch.randn(1, 16, 8, 8)
    ours = QWEN_IMAGE.velocity(qwen.transformer, x, torch.tensor([0.5]), cond.prompt_embeds, cond.pooled,
                               torch.float32, False, 1.0)
    theirs = qwen.transformer(hidden_states=pack(x), timestep=torch.tensor([0.5]), encoder_hidden_states=unpadded,
                              img_shapes=[[(1, 4, 4)]], return_dict=False)[0]
    torch.testing.assert_close(ours, unpack(theirs, 8, 8), rtol=1e-5, atol=1e-5)


def test_the_dit_gets_sigma_the_mask_and_the_image_shapes(qwen):
    seen = []
    hook = qwen.transformer.register_forward_pre_hook(lambda m, a, kw: seen.append(kw), with_kwargs=True)
    try:
        cond = PromptEncoder(qwen, 24, CPU, cfg=True)(PROMPTS[:1])
        guided_velocity(qwen.transformer, torch.randn(1, 16, 8, 12), torch.tensor(0.75), cond, 4.0, torch.float32,
                        null_autocast)
    finally:
        hook.remove()
    assert len(seen) == 2  # the conditional pass, then the negative prompt's, as QwenImagePipeline calls
    for kw, mask in zip(seen, (cond.pooled, cond.neg_pooled)):
        assert torch.equal(kw["timestep"], torch.tensor([750.0]) / 1000) and kw["guidance"] is None
        assert kw["hidden_states"].shape == (1, 4 * 6, 64) and kw["img_shapes"] == [[(1, 4, 6)]]
        assert torch.equal(kw["encoder_hidden_states_mask"], mask)


def test_the_sigma_grid_is_shifted_and_ends_at_qwen_images_terminal(qwen):
    grid = QWEN_IMAGE.sigma_grid(qwen.scheduler, 10, (16, 128, 128))
    assert grid[0] == 1.0 and grid[-1] == 0.0 and abs(float(grid[-2]) - 0.02) < 1e-6
    assert (grid[1:] < grid[:-1]).all()


def test_fsdp_units_are_the_dit_blocks(qwen):
    assert QWEN_IMAGE.fsdp_blocks(qwen.transformer) == list(qwen.transformer.transformer_blocks)


@pytest.mark.parametrize("lever", ["fuse_qkv", "fused_lora", "gelu_epilogue", "rollout_fp8", "v_old_fp8"])
def test_levers_written_for_sd3_are_refused_for_qwen_image(lever):
    with pytest.raises(ConfigError, match=f"perf.{lever}: works on SD3's blocks only"):
        load_config("tiny_qwen_image", [f"perf.{lever}=true", "perf.merge_lora_nograd=true"])


def test_qwen_image_takes_at_most_1024_text_tokens():
    with pytest.raises(ConfigError, match="rollout.max_sequence_length: Qwen-Image's text encoder takes at most 1024"):
        load_config("tiny_qwen_image", ["rollout.max_sequence_length=1025"])


def test_the_folder_check_follows_the_text_encoders_saved_names(qwen_dir):
    """transformers 5 writes Qwen2.5-VL's tensors under its checkpoints' names (model.*, visual.*),
    not the class's (model.language_model.*, model.visual.*): the rank's check reads them so."""
    from hpcnft.models.folder_check import check_tensors

    check_tensors("models.qwen_image_dir", qwen_dir)


def test_the_unreached_modules_are_those_no_gradient_reaches(qwen_dir):
    """Full fine-tune: after a backward of the velocity, the parameters without a gradient are
    exactly those of the family's unreached modules (the last block's text stream), which the
    policy freezes so that the optimizer's state, and a checkpoint's, covers every trained one."""
    dit = QWEN_IMAGE.load(qwen_dir, torch.float32, CPU).transformer.requires_grad_(True)
    cond = PromptEncoder(QWEN_IMAGE.load(qwen_dir, torch.float32, CPU), 24, CPU, cfg=False)(PROMPTS[:1])
    QWEN_IMAGE.velocity(dit, torch.randn(1, 16, 8, 8), torch.tensor([0.5]), cond.prompt_embeds, cond.pooled,
                        torch.float32, False, 1.0).square().sum().backward()
    unreached = {id(p) for m in QWEN_IMAGE.unreached(dit) for p in m.parameters()}
    assert unreached and {id(p) for p in dit.parameters() if p.grad is None} == unreached


def test_the_pickscore_recipe_is_flow_factorys_nft_recipe_on_qwen_image():
    cfg = load_config("qwen_image_pickscore")
    assert cfg.models.family == "qwen_image" and cfg.models.qwen_image_dir == "models/Qwen-Image"
    assert (cfg.rollout.samples_per_prompt, cfg.samples_per_step, cfg.rollout.guidance_scale) == (16, 48, 4.0)
    assert (cfg.train.lora_rank, cfg.train.lora_alpha, cfg.optim.lr, cfg.rollout.max_sequence_length) == \
        (64, 128, 3e-4, 512)


def test_fp8_storage_keeps_qwen_images_modulation_linears_as_loaded(qwen):
    from hpcnft.perf.fp8_storage import stored_linears

    block = qwen.transformer.transformer_blocks[0]
    stored = {id(m) for m in stored_linears([block])}
    assert id(block.attn.to_q) in stored and id(block.img_mlp.net[2]) in stored
    assert id(block.img_mod[1]) not in stored and id(block.txt_mod[1]) not in stored


def test_flash_attention_is_refused_for_qwen_image_whose_dit_masks_the_padding():
    with pytest.raises(ConfigError, match="perf.attention_backend: flash attention takes no mask"):
        load_config("tiny_qwen_image", ["perf.attention_backend=flash"])
    assert load_config("tiny_qwen_image", ["perf.attention_backend=efficient"]).perf.attention_backend == "efficient"
