"""Tiny SD3.5 and PickScore models with the real classes, for tests and the embedded default.

`build_tiny_models(out)` writes OUT/sd35_tiny (a StableDiffusion3Pipeline folder: SD3 transformer
with qk rms-norm and a dual-attention block, 16-channel VAE, flow-matching scheduler with shift
3, two CLIP text encoders and T5) and OUT/pickscore_tiny (a CLIPModel + CLIPProcessor with the
CLIP-H preprocessing). Two builds are byte-identical: the tokenizers are learned by small
pure-Python routines because the `tokenizers` trainers break ties in hash order.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile

import torch

from hpcnft.models.tiny_cache import DONE_MARKER, PICKSCORE_DIRNAME, SD3_DIRNAME
from hpcnft.models.tiny_tokenizers import finish_tokenizer_dir, make_clip_tokenizer, make_t5_tokenizer
from hpcnft.models.tiny_dims import TINY_TRANSFORMER  # noqa: F401 - the tiny SD3.5 DiT, built here
# ----------------------------------------------------------------------------------------
# Prompt corpus used to train the tiny tokenizers (and as demo prompts).
# ----------------------------------------------------------------------------------------
PROMPTS = [
    "a photo of a cat sitting on a red chair",
    "an astronaut riding a horse on the moon, digital art",
    "a bowl of ramen with chopsticks, 4k, highly detailed",
    "two dogs playing in the snow at sunrise",
    "a watercolor painting of a lighthouse at dusk",
    "a cozy cabin in the woods, cinematic lighting",
    "portrait of an old man with a beard, oil painting",
    "a futuristic city skyline at night with neon lights",
    "a red sports car parked on a wet street",
    "a bouquet of sunflowers in a blue vase",
    "a dragon flying over snowy mountains, fantasy art",
    "a plate of sushi on a wooden table",
    "a small robot reading a book in a library",
    "a sailing ship on a stormy sea, dramatic clouds",
    "a fox sleeping under a tree in autumn",
    "a cup of coffee with latte art, top view",
    "an ancient castle on a hill, matte painting",
    "a child flying a kite on the beach",
    "a panda eating bamboo in the forest",
    "a bicycle leaning against a brick wall",
    "a glass of orange juice on a kitchen counter",
    "a neon sign that says open, photorealistic",
    "a koala wearing sunglasses, studio photo",
    "an owl perched on a branch at night",
    "a field of tulips under a cloudy sky",
    "a steaming pot of soup on a stove",
    "a vintage typewriter on a desk, soft light",
    "a waterfall in a green jungle, ultra detailed",
    "a penguin standing on an iceberg",
    "a hot air balloon over a desert canyon",
    "a teddy bear on a skateboard in times square",
    "a bowl of fruit, still life, 35mm film",
    "a man and a woman dancing in the rain",
    "a white horse running through a meadow",
    "a green apple next to a yellow banana",
    "three birds sitting on a power line",
    "a pixel art castle with a moat",
    "a mountain lake reflecting pine trees",
    "a black and white photo of a busy train station",
    "an illustration of a whale swimming among stars",
]
# Make sure every lowercase/uppercase letter, digit and common punctuation is seen.
CHAR_COVERAGE = (
    "abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ 0 1 2 3 4 5 6 7 8 9 "
    ". , ; : ! ? ' \" - _ ( ) [ ] / & % + = * # @ $"
)

# ----------------------------------------------------------------------------------------
# Tiny configurations (same classes / wiring as SD3.5-medium, scaled down).
# Constraints (see StableDiffusion3Pipeline.encode_prompt):
#   caption_projection_dim == num_attention_heads * attention_head_dim   (context stream width)
#   pooled_projection_dim  == clip1.projection_dim + clip2.projection_dim
#   joint_attention_dim    == t5.d_model >= clip1.hidden_size + clip2.hidden_size
#   vae_scale_factor = 2 ** (len(vae.block_out_channels) - 1)  -> keep 4 blocks => 8x
# ----------------------------------------------------------------------------------------
TINY_VAE = dict(
    in_channels=3,
    out_channels=3,
    down_block_types=["DownEncoderBlock2D"] * 4,
    up_block_types=["UpDecoderBlock2D"] * 4,
    block_out_channels=[8, 8, 16, 16],
    layers_per_block=1,
    latent_channels=16,
    norm_num_groups=4,
    act_fn="silu",
    sample_size=128,
    scaling_factor=1.5305,  # SD3.5 values
    shift_factor=0.0609,
    use_quant_conv=False,
    use_post_quant_conv=False,
    force_upcast=True,
)
TINY_SCHEDULER = dict(num_train_timesteps=1000, shift=3.0)
TINY_CLIP_TEXT = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      max_position_embeddings=77, projection_dim=32)
TINY_T5 = dict(d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4, relative_attention_num_buckets=32,
               relative_attention_max_distance=128, feed_forward_proj="gated-gelu", dropout_rate=0.0,
               tie_word_embeddings=False, is_encoder_decoder=False, use_cache=False)
TINY_PICKSCORE = dict(
    text=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              max_position_embeddings=77, hidden_act="gelu"),
    vision=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                image_size=224, patch_size=14, hidden_act="gelu"),
    projection_dim=32,
)

# ----------------------------------------------------------------------------------------
# Tiny SD3.5 pipeline
# ----------------------------------------------------------------------------------------
def build_tiny_sd3(out_dir: str, seed: int = 0) -> str:
    from diffusers import (AutoencoderKL, FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel,
                           StableDiffusion3Pipeline)
    from transformers import CLIPTextConfig, CLIPTextModelWithProjection, T5Config, T5EncoderModel

    texts = PROMPTS + [CHAR_COVERAGE]
    tmp_tok = os.path.join(out_dir, "_tok_tmp")
    tok1 = make_clip_tokenizer(os.path.join(tmp_tok, "clip1"), texts, pad_token="<|endoftext|>")
    tok2 = make_clip_tokenizer(os.path.join(tmp_tok, "clip2"), texts, pad_token="!")  # SD3's tokenizer_2 pads with "!"
    tok3 = make_t5_tokenizer(os.path.join(tmp_tok, "t5"), texts)

    torch.manual_seed(seed)

    def clip_cfg(tok, act):
        return CLIPTextConfig(vocab_size=len(tok), hidden_act=act, bos_token_id=tok.bos_token_id,
                              eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, **TINY_CLIP_TEXT)

    text_encoder = CLIPTextModelWithProjection(clip_cfg(tok1, "quick_gelu"))  # CLIP-L uses quick_gelu
    text_encoder_2 = CLIPTextModelWithProjection(clip_cfg(tok2, "gelu"))  # OpenCLIP bigG uses gelu
    t5_vocab = (len(tok3) + 7) // 8 * 8
    text_encoder_3 = T5EncoderModel(T5Config(vocab_size=t5_vocab, pad_token_id=tok3.pad_token_id,
                                             eos_token_id=tok3.eos_token_id, decoder_start_token_id=0, **TINY_T5))
    transformer = SD3Transformer2DModel(**TINY_TRANSFORMER)
    vae = AutoencoderKL(**TINY_VAE)
    scheduler = FlowMatchEulerDiscreteScheduler(**TINY_SCHEDULER)

    pipe = StableDiffusion3Pipeline(
        transformer=transformer, scheduler=scheduler, vae=vae,
        text_encoder=text_encoder, tokenizer=tok1,
        text_encoder_2=text_encoder_2, tokenizer_2=tok2,
        text_encoder_3=text_encoder_3, tokenizer_3=tok3,
    )
    path = os.path.join(out_dir, "sd35_tiny")
    pipe.save_pretrained(path, safe_serialization=True)
    finish_tokenizer_dir(os.path.join(path, "tokenizer"), os.path.join(tmp_tok, "clip1"))
    finish_tokenizer_dir(os.path.join(path, "tokenizer_2"), os.path.join(tmp_tok, "clip2"))
    finish_tokenizer_dir(os.path.join(path, "tokenizer_3"))
    record_t5_tokenizer_fast(path, "tokenizer_3")
    shutil.rmtree(tmp_tok, ignore_errors=True)
    return path


def record_t5_tokenizer_fast(pipeline_dir: str, part: str) -> None:
    """transformers 5.x records a T5 tokenizer as "T5Tokenizer" (T5TokenizerFast is an alias there);
    the real SD3.5 and FLUX.1 model_index.json say "T5TokenizerFast", which also resolves on 4.x
    (where T5Tokenizer is the sentencepiece class)."""
    mi_path = os.path.join(pipeline_dir, "model_index.json")
    with open(mi_path) as f:
        mi = json.load(f)
    mi[part] = ["transformers", "T5TokenizerFast"]
    with open(mi_path, "w") as f:
        json.dump(mi, f, indent=2, sort_keys=True)


# ----------------------------------------------------------------------------------------
# Tiny PickScore (CLIP-H architecture family)
# ----------------------------------------------------------------------------------------
def build_tiny_pickscore(out_dir: str, seed: int = 0) -> str:
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor

    path = os.path.join(out_dir, "pickscore_tiny")
    tok = make_clip_tokenizer(os.path.join(path, "_tok_tmp"), PROMPTS + [CHAR_COVERAGE])
    image_processor = CLIPImageProcessor(
        do_resize=True, size={"shortest_edge": 224}, resample=3, do_center_crop=True,
        crop_size={"height": 224, "width": 224}, do_rescale=True, rescale_factor=1 / 255, do_normalize=True,
        image_mean=[0.48145466, 0.4578275, 0.40821073], image_std=[0.26862954, 0.26130258, 0.27577711],
        do_convert_rgb=True,
    )
    processor = CLIPProcessor(image_processor=image_processor, tokenizer=tok)
    torch.manual_seed(seed)
    cfg = CLIPConfig(
        text_config=dict(vocab_size=len(tok), bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                         pad_token_id=tok.pad_token_id, **TINY_PICKSCORE["text"]),
        vision_config=dict(TINY_PICKSCORE["vision"]),
        projection_dim=TINY_PICKSCORE["projection_dim"],
    )
    model = CLIPModel(cfg)
    model.save_pretrained(path, safe_serialization=True)
    processor.save_pretrained(path)
    finish_tokenizer_dir(path, os.path.join(path, "_tok_tmp"))
    shutil.rmtree(os.path.join(path, "_tok_tmp"), ignore_errors=True)
    return path


# ----------------------------------------------------------------------------------------
# Building into a folder, safely from several ranks at once
# ----------------------------------------------------------------------------------------


def tree_digest(path: str) -> str:
    """sha256 over every file's relative path and bytes (shows that two builds are identical)."""
    h = hashlib.sha256()
    for root, dirs, files in os.walk(path):
        dirs.sort()
        for name in sorted(files):
            full = os.path.join(root, name)
            h.update(os.path.relpath(full, path).encode())
            with open(full, "rb") as f:
                h.update(f.read())
    return h.hexdigest()


def build_tiny_models(out_dir: str) -> tuple[str, str]:
    """Write OUT/sd35_tiny and OUT/pickscore_tiny (replacing them); returns both paths."""
    from hpcnft.models.folders import quiet_libraries

    quiet_libraries()
    os.makedirs(out_dir, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out_dir, prefix=".build-") as tmp:
        sd3 = build_tiny_sd3(tmp)
        ps = build_tiny_pickscore(tmp)
        for built, name in ((sd3, SD3_DIRNAME), (ps, PICKSCORE_DIRNAME)):
            final = os.path.join(out_dir, name)
            if os.path.exists(final):
                shutil.rmtree(final)
            os.replace(built, final)
    return os.path.join(out_dir, SD3_DIRNAME), os.path.join(out_dir, PICKSCORE_DIRNAME)


def ensure_tiny_models(cache_dir: str) -> tuple[str, str]:
    """The tiny models in `cache_dir`, built on first use. Ranks that start together take a
    file lock so that exactly one builds and the others wait for it."""
    import fcntl

    os.makedirs(cache_dir, exist_ok=True)
    done = os.path.join(cache_dir, DONE_MARKER)
    paths = (os.path.join(cache_dir, SD3_DIRNAME), os.path.join(cache_dir, PICKSCORE_DIRNAME))
    if os.path.exists(done):
        return paths
    with open(os.path.join(cache_dir, ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not os.path.exists(done):
            build_tiny_models(cache_dir)
            from hpcnft.models.folders import PICKSCORE_REQUIRED, SD3_REQUIRED, check_folder

            check_folder("models.sd3_dir", paths[0], SD3_REQUIRED)  # never mark a partial build done
            check_folder("models.pickscore_dir", paths[1], PICKSCORE_REQUIRED)
            with open(done, "w") as f:
                f.write(tree_digest(paths[0]) + " " + tree_digest(paths[1]) + "\n")
    return paths
