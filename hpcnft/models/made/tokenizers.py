"""Tokenizers at the real vocabularies' sizes and special ids, for model folders made with random
weights: CLIP's byte-level BPE (49,408 tokens, <|startoftext|> 49406 and <|endoftext|> 49407, as
every CLIP text tower of SD3.5, FLUX.1 and PickScore has them) and T5's unigram (32,000 pieces and
100 sentinel tokens, <pad> 0, </s> 1, <unk> 2). The merges and pieces learned from a prompt corpus
come first; deterministic fillers take the rest of the id space, so token ids reach the whole
embedding table of the real encoders and CLIP's pooled token (the highest id, <|endoftext|>) is
where the real one is."""
from __future__ import annotations

import json
import os

from hpcnft.models.tiny_tokenizers import (_bytes_to_unicode, finish_tokenizer_dir, t5_unigram_vocab, train_clip_bpe,
                                            write_clip_bpe)

CLIP_VOCAB = 49408
T5_PIECES, T5_SENTINELS = 32000, 100


def clip_bpe(texts: list[str], size: int = CLIP_VOCAB) -> tuple[dict[str, int], list[str]]:
    """(vocab, merges) of `size` tokens in CLIP's layout: 512 byte symbols, the corpus's merges,
    filler merges of two byte symbols (rank after every learned one), the two specials last."""
    vocab, merges = train_clip_bpe(texts)
    specials = ["<|startoftext|>", "<|endoftext|>"]
    tokens = [t for t in vocab if t not in specials]
    seen = set(tokens)
    base = _bytes_to_unicode()
    want = size - len(specials)
    for a in base:  # a filler merge joins a symbol to a symbol or a word-final symbol
        for b in base + [c + "</w>" for c in base]:
            if len(tokens) >= want:
                break
            if a + b not in seen:
                seen.add(a + b)
                tokens.append(a + b)
                merges.append(f"{a} {b}")
    if len(tokens) != want:
        raise ValueError(f"cannot fill a CLIP vocabulary of {size} tokens")
    return {t: i for i, t in enumerate(tokens + specials)}, merges


def write_clip_tokenizer(out_dir: str, texts: list[str], pad_token: str = "<|endoftext|>",
                         model_max_length: int = 77):
    """A CLIPTokenizer folder (vocab.json, merges.txt, the configs and tokenizer.json) of the real
    vocabulary's size; `pad_token` "!" for OpenCLIP's towers (SD3's tokenizer_2)."""
    from transformers import CLIPTokenizer

    vocab, merges = clip_bpe(texts)
    write_clip_bpe(out_dir, vocab, merges, pad_token, model_max_length)
    tok = CLIPTokenizer.from_pretrained(out_dir)
    keep = os.path.join(out_dir, ".bpe")
    os.makedirs(keep, exist_ok=True)
    for name in ("vocab.json", "merges.txt"):
        os.replace(os.path.join(out_dir, name), os.path.join(keep, name))
    tok.save_pretrained(out_dir)
    finish_tokenizer_dir(out_dir, keep)
    for name in ("vocab.json", "merges.txt"):
        os.remove(os.path.join(keep, name))
    os.rmdir(keep)
    return tok


def t5_pieces(texts: list[str], size: int = T5_PIECES) -> list[tuple[str, float]]:
    """T5's unigram pieces: the corpus's (specials first), then filler pieces of two and three
    characters, scored below every learned piece, up to `size`."""
    pieces = t5_unigram_vocab(texts)
    seen = {p for p, _ in pieces}
    letters = "abcdefghijklmnopqrstuvwxyz"
    fillers = ([a + b for a in letters for b in letters] + ["▁" + a + b for a in letters for b in letters]
               + [p + a + b + c for p in ("", "▁") for a in letters for b in letters for c in letters])
    for text in fillers:
        if len(pieces) >= size:
            break
        if text not in seen:
            seen.add(text)
            pieces.append((text, -20.0))
    if len(pieces) != size:
        raise ValueError(f"cannot fill a T5 vocabulary of {size} pieces")
    return pieces


def write_t5_tokenizer(out_dir: str, texts: list[str], model_max_length: int = 512):
    """A T5TokenizerFast folder (tokenizer.json, the configs): 32,000 unigram pieces and the 100
    sentinels <extra_id_0> (32099) to <extra_id_99> (32000), as T5 v1.1's tokenizer numbers them."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import T5TokenizerFast

    tok = Tokenizer(models.Unigram(t5_pieces(texts), unk_id=2, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.WhitespaceSplit(),
        pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True)])
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always", split=True)
    tok.post_processor = processors.TemplateProcessing(
        single=["$A", "</s>"], pair=["$A", "</s>", "$B", "</s>"], special_tokens=[("</s>", 1)])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ("<pad>", "</s>", "<unk>")])
    sentinels = [f"<extra_id_{i}>" for i in range(T5_SENTINELS - 1, -1, -1)]  # 32000 is <extra_id_99>
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in sentinels])
    os.makedirs(out_dir, exist_ok=True)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "T5Tokenizer", "model_max_length": model_max_length, "eos_token": "</s>",
                   "unk_token": "<unk>", "pad_token": "<pad>", "extra_ids": 0,
                   "additional_special_tokens": sorted(sentinels, key=lambda t: int(t[10:-1]))}, f, indent=2)
    t5 = T5TokenizerFast.from_pretrained(out_dir)
    t5.save_pretrained(out_dir)
    finish_tokenizer_dir(out_dir)
    return t5
