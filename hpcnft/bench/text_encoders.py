"""SD3.5's text encoders at their real shapes (random weights) for the bench's whole iteration,
so that what an iteration holds on the GPU and the time it spends encoding prompts are the
job's: CLIP-L and OpenCLIP bigG (with projections) and T5-XXL's encoder, about 5.5 B parameters,
11 GB in fp16. The tokenizers are the tiny models' (token ids within the real vocabularies);
a prompt's embedding is [1, 77 + T5 tokens, 4096], as StableDiffusion3Pipeline.encode_prompt
makes it."""
from __future__ import annotations

from hpcnft.bench.shapes import Shapes, _torch

CLIP_L = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12, num_attention_heads=12,
              max_position_embeddings=77, projection_dim=768, hidden_act="quick_gelu", vocab_size=49408)
CLIP_G = dict(hidden_size=1280, intermediate_size=5120, num_hidden_layers=32, num_attention_heads=20,
              max_position_embeddings=77, projection_dim=1280, hidden_act="gelu", vocab_size=49408)
T5_XXL = dict(d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64, relative_attention_num_buckets=32,
              relative_attention_max_distance=128, feed_forward_proj="gated-gelu", dropout_rate=0.0,
              tie_word_embeddings=False, is_encoder_decoder=False, use_cache=False, vocab_size=32128)


def _build(make, dtype, dev, place):
    """Drawn on `dev` (fast) in `dtype` (T5-XXL in fp32 alone would take 19 GB), then moved to `place`."""
    torch = _torch()
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(dev):
            model = make()
    finally:
        torch.set_default_dtype(default)
    return model.to(place).eval().requires_grad_(False)


def real_text_pipeline(S: Shapes, transformer, vae, scheduler, dtype, dev, offload: bool):
    """A StableDiffusion3Pipeline of the bench's DiT and VAE with SD3.5's three text encoders at
    their real shapes; with `offload` (perf.text_encoders) the encoders wait in CPU memory."""
    if S.family != "sd3":
        raise ValueError(f"real text encoders: SD3 only, not {S.family!r}")
    from diffusers import StableDiffusion3Pipeline
    from transformers import AutoTokenizer, CLIPTextConfig, CLIPTextModelWithProjection, T5Config, T5EncoderModel

    from hpcnft.models.tiny import ensure_tiny_models
    from hpcnft.models.tiny_cache import cache_dir

    tiny, _ = ensure_tiny_models(cache_dir())
    toks = [AutoTokenizer.from_pretrained(f"{tiny}/{name}") for name in ("tokenizer", "tokenizer_2", "tokenizer_3")]
    place = "cpu" if offload else dev
    if S.name.startswith("tiny"):  # the tiny models' own encoder shapes: the same path on a CPU
        from hpcnft.models.tiny import TINY_CLIP_TEXT, TINY_T5

        tiny_clip = dict(TINY_CLIP_TEXT, vocab_size=len(toks[0]))
        specs = (dict(tiny_clip, hidden_act="quick_gelu"), dict(tiny_clip, vocab_size=len(toks[1]), hidden_act="gelu"),
                 dict(TINY_T5, vocab_size=(len(toks[2]) + 7) // 8 * 8))
    else:
        specs = (CLIP_L, CLIP_G, T5_XXL)

    def clip(spec, tok):
        return CLIPTextModelWithProjection(CLIPTextConfig(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                                                          pad_token_id=tok.pad_token_id, **spec))
    def t5():
        return T5EncoderModel(T5Config(pad_token_id=toks[2].pad_token_id, eos_token_id=toks[2].eos_token_id,
                                       decoder_start_token_id=0, **specs[2]))
    encoders = [_build(lambda: clip(specs[0], toks[0]), dtype, dev, place),
                _build(lambda: clip(specs[1], toks[1]), dtype, dev, place), _build(t5, dtype, dev, place)]
    pipe = StableDiffusion3Pipeline(transformer=transformer, scheduler=scheduler, vae=vae,
                                    text_encoder=encoders[0], tokenizer=toks[0], text_encoder_2=encoders[1],
                                    tokenizer_2=toks[1], text_encoder_3=encoders[2], tokenizer_3=toks[2])
    pipe.set_progress_bar_config(disable=True)
    return pipe


def parameter_count(pipe) -> int:
    return sum(p.numel() for enc in (pipe.text_encoder, pipe.text_encoder_2, pipe.text_encoder_3)
               for p in enc.parameters())
