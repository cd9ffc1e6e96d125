"""A GGUF file's tokenizer metadata -> tokenizer.json, tokenizer_config.json and
generation_config.json, as a bundle carries them.

GGUF stores the vocabulary (`tokenizer.ggml.tokens`, token types, scores), BPE merges
when it has them, the special ids and the chat template. Two families exist:

- `gpt2`: byte-level BPE (Llama 3, Qwen, SmolLM, ...); the text is split before merging by
  the regex llama.cpp names in `tokenizer.ggml.pre` (the table below, as llama.cpp has it).
- `llama`: SentencePiece BPE with byte fallback (Llama 2, Mistral, Phi-3, Gemma). Without
  merges in the file, they are rebuilt from the vocabulary ordered by score (Gemma: by
  position, as its scores do not follow its merge order) — the rule transformers uses.

Control tokens become special added tokens, user-defined ones plain added tokens, so
they are matched whole in text, as llama.cpp does.
"""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path
from typing import Any

from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
)

from edgespec.errors import EdgespecError
from edgespec.export.gguf_reader import field as _field

CONTROL, USER_DEFINED = 3, 4
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# tokenizer.ggml.pre -> the split applied before byte-level BPE (None: GPT-2's own regex)
BPE_SPLITS: dict[str, list[pre_tokenizers.PreTokenizer] | None] = {
    "default": None, "gpt2": None,
    "smollm": [pre_tokenizers.Digits(individual_digits=True)],
    **{name: [pre_tokenizers.Split(Regex(_LLAMA3), behavior="isolated")]
       for name in ("llama3", "llama-v3", "llama-bpe", "smaug-bpe", "dbrx")},
    **{name: [pre_tokenizers.Split(Regex(_QWEN2), behavior="isolated")]
       for name in ("qwen2", "deepseek-r1-qwen")},
}


@cache
def _byte_alphabet() -> dict[int, str]:
    """GPT-2's printable spelling of the 256 byte values (bytes_to_unicode)."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return chars


def _bpe(path: Path, **kwargs: Any) -> Tokenizer:
    try:
        return Tokenizer(models.BPE(**kwargs))
    except Exception as e:  # tokenizers raises plain Exceptions for inconsistent vocabularies
        raise EdgespecError(f"{path}: its tokenizer metadata is inconsistent ({e}); the file "
                            "is damaged or from a broken converter.") from None


def _byte_level(meta: dict[str, Any], path: Path) -> Tokenizer:
    alphabet = _byte_alphabet()
    letters = set(alphabet.values())
    vocab = {t if set(t) <= letters else "".join(alphabet[b] for b in t.encode()): i
             for i, t in enumerate(meta["tokens"])}
    if not meta["merges"]:
        raise EdgespecError(f"{path}: its byte-level BPE vocabulary comes without merges; the "
                            "file is incomplete.")
    merges = [tuple(m.split(" ", 1)) for m in meta["merges"]]
    tok = _bpe(path, vocab=vocab, merges=merges, fuse_unk=False)
    pre = meta["pre"] or "default"
    if pre not in BPE_SPLITS:
        raise EdgespecError(f"{path}: pre-tokenizer '{pre}' is not known to edgespec "
                            f"(known: {', '.join(sorted(BPE_SPLITS))}).")
    split = BPE_SPLITS[pre]
    level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=split is None
                                     or pre == "smollm")
    tok.pre_tokenizer = pre_tokenizers.Sequence([*split, level]) if split else level
    tok.decoder = decoders.ByteLevel()
    return tok


def _merges_by_rank(tokens: list[str], rank: dict[str, float]) -> list[tuple[str, str]]:
    """BPE merges implied by a vocabulary: every split of a token into two tokens, best
    (highest `rank`) merged first; ties by the pieces' lengths, then ids."""
    ids = {t: i for i, t in enumerate(tokens)}
    merges = []
    for token in tokens:
        local = [(token[:i], token[i:]) for i in range(1, len(token))
                 if token[:i] in ids and token[i:] in ids]
        local.sort(key=lambda lr: (ids[lr[0]], ids[lr[1]]))
        merges += [(left, right, rank[token]) for left, right in local]
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]


def _sentencepiece(meta: dict[str, Any], arch: str, path: Path) -> Tokenizer:
    tokens = meta["tokens"]
    gemma = arch.startswith("gemma")
    if gemma:
        rank = {t: -i for i, t in enumerate(tokens)}
    else:
        rank = dict(zip(tokens, meta["scores"], strict=True))
    merges = ([tuple(m.split(" ", 1)) for m in meta["merges"]] if meta["merges"]
              else _merges_by_rank(tokens, rank))
    unk = tokens[meta["unk_id"]] if meta["unk_id"] is not None else None
    tok = _bpe(path, vocab={t: i for i, t in enumerate(tokens)}, merges=merges,
               fuse_unk=True, byte_fallback=True, unk_token=unk)
    pieces = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if gemma:
        tok.normalizer = normalizers.Replace(" ", "\u2581")
    elif arch == "phi3":
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"),
                                               normalizers.Replace(" ", "\u2581")])
    else:
        prefix = meta["add_space_prefix"] is not False
        tok.pre_tokenizer = pre_tokenizers.Metaspace(
            replacement="\u2581", prepend_scheme="first" if prefix else "never", split=False)
        if prefix:
            pieces.append(decoders.Strip(content=" ", left=1))
    tok.decoder = decoders.Sequence(pieces)
    return tok


def read_tokenizer_metadata(reader: Any) -> dict[str, Any]:
    tokens = reader.get_field("tokenizer.ggml.tokens")
    merges = reader.get_field("tokenizer.ggml.merges")
    return {
        "model": _field(reader, "tokenizer.ggml.model"),
        "pre": _field(reader, "tokenizer.ggml.pre"),
        "tokens": tokens.contents() if tokens else None,
        "types": _field(reader, "tokenizer.ggml.token_type") or [],
        "scores": _field(reader, "tokenizer.ggml.scores"),
        "merges": merges.contents() if merges else None,
        "bos_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "unk_id": _field(reader, "tokenizer.ggml.unknown_token_id"),
        "pad_id": _field(reader, "tokenizer.ggml.padding_token_id"),
        "add_bos": _field(reader, "tokenizer.ggml.add_bos_token"),
        "add_eos": _field(reader, "tokenizer.ggml.add_eos_token"),
        "add_space_prefix": _field(reader, "tokenizer.ggml.add_space_prefix"),
        "chat_template": _field(reader, "tokenizer.chat_template"),
    }


def write_tokenizer(reader: Any, arch: str, path: Path, out: Path) -> list[int]:
    """Write the tokenizer files into `out`; returns the EOS ids."""
    meta = read_tokenizer_metadata(reader)
    if not meta["tokens"]:
        raise EdgespecError(f"{path} carries no tokenizer (no tokenizer.ggml.tokens); edgespec "
                            "needs one inside the GGUF file.")
    if meta["model"] == "gpt2":
        tok = _byte_level(meta, path)
    elif meta["model"] == "llama":
        if arch.startswith("gemma"):  # whitespace-only tokens spelled with spaces, not "▁"
            meta["tokens"] = ["\u2581" * len(t) if " " in t and not t.strip() else t
                              for t in meta["tokens"]]
        if meta["scores"] is None and not meta["merges"]:
            raise EdgespecError(f"{path}: its SentencePiece vocabulary has neither scores nor "
                                "merges; the file is incomplete.")
        tok = _sentencepiece(meta, arch, path)
    else:
        raise EdgespecError(f"{path}: tokenizer model '{meta['model']}' is not supported "
                            "(supported: gpt2 byte-level BPE, llama SentencePiece).")
    tokens = meta["tokens"]
    letters = set(_byte_alphabet().values()) if meta["model"] == "gpt2" else None
    special = [AddedToken(t, normalized=False, special=True)
               for t, kind in zip(tokens, meta["types"], strict=False)
               if kind == CONTROL and (letters is None or set(t) <= letters)]
    tok.add_special_tokens(special)
    tok.add_tokens([AddedToken(t, normalized=False, special=False)
                    for t, kind in zip(tokens, meta["types"], strict=False)
                    if kind == USER_DEFINED and tok.token_to_id(t) is not None])

    def name(i: int | None) -> str | None:
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    add_bos = meta["add_bos"] if meta["add_bos"] is not None else meta["model"] == "llama"
    bos, eos = name(meta["bos_id"]), name(meta["eos_id"])
    if add_bos and bos:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos}:0 $A:0", pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
            special_tokens=[(bos, meta["bos_id"])])
    tok.save(str(out / "tokenizer.json"), pretty=False)  # 32 MB pretty for Gemma, 13 compact
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos,
              "eos_token": eos, "unk_token": name(meta["unk_id"]),
              "pad_token": name(meta["pad_id"]), "add_bos_token": bool(add_bos and bos),
              "add_eos_token": bool(meta["add_eos"])}
    if meta["chat_template"]:
        config["chat_template"] = meta["chat_template"]
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    eos_ids = [meta["eos_id"]] if meta["eos_id"] is not None else []
    # chat models end a turn with a token of their template's own, e.g. <end_of_turn>
    for turn_end in ("<end_of_turn>", "<|im_end|>", "<|eot_id|>", "<|end|>"):
        i = tok.token_to_id(turn_end)
        if i is not None and i not in eos_ids and turn_end in (meta["chat_template"] or ""):
            eos_ids.append(i)
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": meta["bos_id"], "eos_token_id": eos_ids}, indent=2))
    return eos_ids
