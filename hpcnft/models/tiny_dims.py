"""The tiny DiTs' configurations (SD3.5's, FLUX.1-dev's and Qwen-Image's classes,
scaled down), without torch:
the start's step estimate (run/estimate.py) reads them in the spawner, which imports no torch.
models/tiny.py, models/tiny_flux.py and models/tiny_qwen_image.py build the models from them."""

# SD3.5 (SD3Transformer2DModel); the constraints tying it to the text encoders: models/tiny.py
TINY_TRANSFORMER = dict(
    sample_size=16,  # default image size = 16 * 8 = 128 px
    patch_size=2,
    in_channels=16,
    out_channels=16,
    num_layers=2,
    attention_head_dim=8,
    num_attention_heads=4,  # inner_dim 32
    joint_attention_dim=64,
    caption_projection_dim=32,
    pooled_projection_dim=64,
    pos_embed_max_size=32,  # latent grid up to 32 patches -> up to 512 px
    dual_attention_layers=(0,),  # SD3.5 MMDiT-X block
    qk_norm="rms_norm",  # SD3.5
)

# FLUX.1-dev (FluxTransformer2DModel); its constraints: models/tiny_flux.py
TINY_FLUX_TRANSFORMER = dict(
    patch_size=1,
    in_channels=64,
    num_layers=1,  # double-stream blocks (19 in FLUX.1-dev)
    num_single_layers=2,  # single-stream blocks (38)
    attention_head_dim=8,
    num_attention_heads=4,
    joint_attention_dim=64,
    pooled_projection_dim=32,
    guidance_embeds=True,  # FLUX.1-dev is guidance-distilled
    axes_dims_rope=(2, 2, 4),
)

# Qwen-Image (QwenImageTransformer2DModel, 60 double-stream blocks of 24 heads x 128 at full size);
# its constraints: models/tiny_qwen_image.py
TINY_QWEN_IMAGE_TRANSFORMER = dict(
    patch_size=2,
    in_channels=64,
    out_channels=16,
    num_layers=2,
    attention_head_dim=8,
    num_attention_heads=4,
    joint_attention_dim=32,
    axes_dims_rope=(2, 2, 4),
)

# Wan2.1 T2V (WanTransformer3DModel); its constraints: models/tiny_wan.py
TINY_WAN_TRANSFORMER = dict(
    patch_size=(1, 2, 2),
    num_attention_heads=2,
    attention_head_dim=12,  # rotary: 4 time, 4 height, 4 width dims
    in_channels=16,
    out_channels=16,
    text_dim=64,
    freq_dim=32,
    ffn_dim=64,
    num_layers=2,  # 30 in Wan2.1-T2V-1.3B
    cross_attn_norm=True,
    qk_norm="rms_norm_across_heads",
    eps=1e-6,
    rope_max_seq_len=1024,
)
