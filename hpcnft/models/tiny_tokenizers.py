"""The tiny models' tokenizers (two CLIP BPEs and a T5 unigram), learned from the prompt corpus
by small pure-Python routines: the `tokenizers` trainers break ties in hash order, and two
builds must be byte-identical."""
from __future__ import annotations

import json
import os
import re
import shutil

CLIP_SPLIT_PATTERN = (
    r"""<\|startoftext\|>|<\|endoftext\|>|'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+"""
)


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


def learn_merges(words: dict[tuple[str, ...], int], num_merges: int | None = None) -> list[tuple[str, str]]:
    """BPE merges of `words` (symbol tuple -> count), deterministically: each merge the pair of the
    highest count, ties in lexicographic order; `num_merges` of them, or (None) until no word has
    two symbols left."""
    from collections import Counter

    merges: list[tuple[str, str]] = []
    while num_merges is None or len(merges) < num_merges:
        pairs: Counter = Counter()
        for w, f in words.items():
            for a, b in zip(w, w[1:]):
                pairs[(a, b)] += f
        if not pairs:
            break
        best = min(pairs, key=lambda p: (-pairs[p], p))
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
    return merges


def train_clip_bpe(texts: list[str], num_merges: int = 400) -> tuple[dict[str, int], list[str]]:
    """Learn CLIP-style byte-level BPE merges with a small, fully deterministic pure-Python
    learner (the `tokenizers` BpeTrainer breaks count ties in hash order, so its merges - and
    hence token ids - change from run to run).  Returns (vocab, merges) laid out like CLIP's
    vocab.json: 256 byte symbols, the same 256 + '</w>', merged tokens in merge order, then
    <|startoftext|>, <|endoftext|> last."""
    from collections import Counter

    word_freq = Counter(_clip_pretokenize(texts))
    words = {tuple(w[:-1]) + (w[-1] + "</w>",): f for w, f in sorted(word_freq.items())}
    merges = learn_merges(words, num_merges)

    base = _bytes_to_unicode()
    vocab_list = base + [b + "</w>" for b in base]
    seen = set(vocab_list)
    for a, b in merges:
        if a + b not in seen:
            seen.add(a + b)
            vocab_list.append(a + b)
    vocab_list += ["<|startoftext|>", "<|endoftext|>"]
    return {t: i for i, t in enumerate(vocab_list)}, [f"{a} {b}" for a, b in merges]


def write_clip_bpe(out_dir: str, vocab: dict[str, int], merges: list[str], pad_token: str,
                   model_max_length: int = 77) -> None:
    """CLIP's on-disk tokenizer: vocab.json, merges.txt and a tokenizer_config.json."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "vocab.json"), "w", encoding="utf-8") as f:
        json.dump(vocab, f, ensure_ascii=False)
    with open(os.path.join(out_dir, "merges.txt"), "w", encoding="utf-8") as f:
        f.write("#version: 0.2\n" + "\n".join(merges) + "\n")
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "CLIPTokenizer", "model_max_length": model_max_length, "pad_token": pad_token,
                   "bos_token": "<|startoftext|>", "eos_token": "<|endoftext|>",
                   "unk_token": "<|endoftext|>", "do_lower_case": True}, f, indent=2)


def make_clip_tokenizer(out_dir: str, texts: list[str], pad_token: str = "<|endoftext|>"):
    """Write vocab.json + merges.txt (CLIP's on-disk format) and load them with
    CLIPTokenizer.from_pretrained, which then also writes tokenizer.json on save."""
    from transformers import CLIPTokenizer

    vocab, merges = train_clip_bpe(texts)
    write_clip_bpe(out_dir, vocab, merges, pad_token)
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


def finish_tokenizer_dir(tok_dir: str, bpe_src: str | None = None) -> None:
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
