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
import re
import shutil
import tempfile

import torch

from hpcnft.models.tiny_cache import DONE_MARKER, PICKSCORE_DIRNAME, SD3_DIRNAME
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

CLIP_SPLIT_PATTERN = (
    r"""<\|startoftext\|>|<\|endoftext\|>|'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+"""
)

# ----------------------------------------------------------------------------------------
# Tiny configurations (same classes / wiring as SD3.5-medium, scaled down).
# Constraints (see StableDiffusion3Pipeline.encode_prompt):
#   caption_projection_dim == num_attention_heads * attention_head_dim   (context stream width)
#   pooled_projection_dim  == clip1.projection_dim + clip2.projection_dim
#   joint_attention_dim    == t5.d_model >= clip1.hidden_size + clip2.hidden_size
#   vae_scale_factor = 2 ** (len(vae.block_out_channels) - 1)  -> keep 4 blocks => 8x
# ----------------------------------------------------------------------------------------
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
# Tokenizers
# ----------------------------------------------------------------------------------------
def _bytes_to_unicode() -> list[str]:
    """GPT-2/CLIP byte -> printable unicode table, in CLIP's vocab order."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for c in cs]


def _clip_pretokenize(texts: list[str]) -> list[str]:
    """CLIP normalisation + pre-tokenisation (same pipeline as transformers' CLIPTokenizer),
    returning byte-level-mapped words."""
    from tokenizers import Regex, normalizers, pre_tokenizers

    norm = normalizers.Sequence(
        [normalizers.NFC(), normalizers.Replace(Regex(r"\s+"), " "), normalizers.Lowercase()]
    )
    pre = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(CLIP_SPLIT_PATTERN), behavior="removed", invert=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False),
    ])
    words = []
    for t in texts:
        words += [w for w, _ in pre.pre_tokenize_str(norm.normalize_str(t))]
    return words


def train_clip_bpe(texts: list[str], num_merges: int = 400) -> tuple[dict[str, int], list[str]]:
    """Learn CLIP-style byte-level BPE merges with a small, fully deterministic pure-Python
    learner (the `tokenizers` BpeTrainer breaks count ties in hash order, so its merges - and
    hence token ids - change from run to run).  Returns (vocab, merges) laid out like CLIP's
    vocab.json: 256 byte symbols, the same 256 + '</w>', merged tokens in merge order, then
    <|startoftext|>, <|endoftext|> last."""
    from collections import Counter

    word_freq = Counter(_clip_pretokenize(texts))
    words = {tuple(w[:-1]) + (w[-1] + "</w>",): f for w, f in sorted(word_freq.items())}
    merges: list[tuple[str, str]] = []
    for _ in range(num_merges):
        pairs: Counter = Counter()
        for w, f in words.items():
            for a, b in zip(w, w[1:]):
                pairs[(a, b)] += f
        if not pairs:
            break
        best = min(pairs, key=lambda p: (-pairs[p], p))  # highest count, ties -> lexicographic
        merges.append(best)
        new_words: dict = {}
        for w, f in words.items():
            out, i = [], 0
            while i < len(w):
                if i + 1 < len(w) and (w[i], w[i + 1]) == best:
                    out.append(w[i] + w[i + 1])
                    i += 2
                else:
                    out.append(w[i])
                    i += 1
            new_words[tuple(out)] = new_words.get(tuple(out), 0) + f
        words = new_words

    base = _bytes_to_unicode()
    vocab_list = base + [b + "</w>" for b in base]
    seen = set(vocab_list)
    for a, b in merges:
        if a + b not in seen:
            seen.add(a + b)
            vocab_list.append(a + b)
    vocab_list += ["<|startoftext|>", "<|endoftext|>"]
    return {t: i for i, t in enumerate(vocab_list)}, [f"{a} {b}" for a, b in merges]


def make_clip_tokenizer(out_dir: str, texts: list[str], pad_token: str = "<|endoftext|>"):
    """Write vocab.json + merges.txt (CLIP's on-disk format) and load them with
    CLIPTokenizer.from_pretrained, which then also writes tokenizer.json on save."""
    from transformers import CLIPTokenizer

    vocab, merges = train_clip_bpe(texts)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "vocab.json"), "w", encoding="utf-8") as f:
        json.dump(vocab, f, ensure_ascii=False)
    with open(os.path.join(out_dir, "merges.txt"), "w", encoding="utf-8") as f:
        f.write("#version: 0.2\n" + "\n".join(merges) + "\n")
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "CLIPTokenizer", "model_max_length": 77, "pad_token": pad_token,
                   "bos_token": "<|startoftext|>", "eos_token": "<|endoftext|>",
                   "unk_token": "<|endoftext|>", "do_lower_case": True}, f, indent=2)
    tok = CLIPTokenizer.from_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    return tok


def t5_unigram_vocab(texts: list[str]) -> list[tuple[str, float]]:
    """Deterministic SentencePiece-like Unigram vocab in T5's layout (<pad>=0, </s>=1, <unk>=2):
    every corpus word as '▁word' scored by log-frequency, plus every character with and
    without the '▁' prefix as a low-score fallback.  (The `tokenizers` UnigramTrainer gives
    run-to-run differences in the last float digits and thus in piece order.)"""
    import math
    from collections import Counter

    toks = [t for text in texts for t in re.findall(r"\w+|[^\w\s]", text)]
    word_freq = Counter(t for t in toks if re.fullmatch(r"\w+", t))
    total = sum(word_freq.values())
    pieces = {"<pad>": 0.0, "</s>": 0.0, "<unk>": 0.0, "▁": -2.0}
    for w, f in sorted(word_freq.items(), key=lambda kv: (-kv[1], kv[0])):
        pieces["▁" + w] = math.log(f / total)
    for c in sorted({c for text in texts for c in text if not c.isspace()}):
        pieces.setdefault("▁" + c, -12.0)
        pieces.setdefault(c, -13.0)
    return list(pieces.items())  # dicts keep insertion order: specials first


def make_t5_tokenizer(out_dir: str, texts: list[str]):
    """Write a T5-style tokenizer.json (Unigram + Metaspace, '</s>' appended) and load it with
    T5TokenizerFast.from_pretrained (works with transformers 4.x and 5.x)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import T5TokenizerFast

    vocab = t5_unigram_vocab(texts)
    tok = Tokenizer(models.Unigram(vocab, unk_id=2, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.WhitespaceSplit(),
        pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True),
    ])
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always", split=True)
    tok.post_processor = processors.TemplateProcessing(
        single=["$A", "</s>"], pair=["$A", "</s>", "$B", "</s>"], special_tokens=[("</s>", 1)])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<pad>", "</s>", "<unk>")])
    os.makedirs(out_dir, exist_ok=True)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "T5Tokenizer", "model_max_length": 512, "eos_token": "</s>",
                   "unk_token": "<unk>", "pad_token": "<pad>", "extra_ids": 0,
                   "additional_special_tokens": []}, f, indent=2)
    t5 = T5TokenizerFast.from_pretrained(out_dir)
    t5.save_pretrained(out_dir)
    return t5


def _finish_tokenizer_dir(tok_dir: str, bpe_src: str | None = None) -> None:
    """Make a tokenizer folder saved by transformers 5.x loadable by 4.x too:
    - copy vocab.json/merges.txt next to tokenizer.json (4.x's slow CLIPTokenizer, which is what
      model_index.json's "CLIPTokenizer" resolves to there, needs them; 5.x reads tokenizer.json);
    - drop keys 5.x writes that 4.x chokes on or that only leak load-time kwargs."""

    if bpe_src is not None:
        for name in ("vocab.json", "merges.txt"):
            shutil.copy(os.path.join(bpe_src, name), os.path.join(tok_dir, name))
    cfg_path = os.path.join(tok_dir, "tokenizer_config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    for k in ("is_local", "local_files_only"):
        cfg.pop(k, None)
    if cfg.get("extra_special_tokens") in ([], {}):
        cfg.pop("extra_special_tokens")
    with open(cfg_path, "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)


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
    _finish_tokenizer_dir(os.path.join(path, "tokenizer"), os.path.join(tmp_tok, "clip1"))
    _finish_tokenizer_dir(os.path.join(path, "tokenizer_2"), os.path.join(tmp_tok, "clip2"))
    _finish_tokenizer_dir(os.path.join(path, "tokenizer_3"))
    # transformers 5.x records tokenizer_3 as "T5Tokenizer" (T5TokenizerFast is an alias there); the real
    # SD3.5 model_index.json says "T5TokenizerFast", which also resolves on 4.x (where T5Tokenizer is the
    # sentencepiece class).
    mi_path = os.path.join(path, "model_index.json")
    with open(mi_path) as f:
        mi = json.load(f)
    mi["tokenizer_3"] = ["transformers", "T5TokenizerFast"]
    with open(mi_path, "w") as f:
        json.dump(mi, f, indent=2, sort_keys=True)
    shutil.rmtree(tmp_tok, ignore_errors=True)
    return path


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
    _finish_tokenizer_dir(path, os.path.join(path, "_tok_tmp"))
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
    from hpcnft.models.loading import quiet_libraries

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
            from hpcnft.models.loading import PICKSCORE_REQUIRED, SD3_REQUIRED, check_folder

            check_folder("models.sd3_dir", paths[0], SD3_REQUIRED)  # never mark a partial build done
            check_folder("models.pickscore_dir", paths[1], PICKSCORE_REQUIRED)
            with open(done, "w") as f:
                f.write(tree_digest(paths[0]) + " " + tree_digest(paths[1]) + "\n")
    return paths
