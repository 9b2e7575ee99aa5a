"""A byte-level BPE tokenizer in GGUF metadata (docs/formats.md, "Converted target GGUF"): written from a
`tokenizer.json` as llama.cpp's converter writes it for Qwen models, and read back into a `tokenizers.Tokenizer`.

Writing (`add_tokenizer`) follows `convert_hf_to_gguf.py`'s GPT-2-style path: `tokenizer.ggml.model = "gpt2"`, the
pre-tokenizer type, one token per id up to the config's `vocab_size` (ids no token has become `[PAD<id>]`, type
UNUSED; added tokens CONTROL when special or `<|...|>`-shaped, else USER_DEFINED), and gguf-py's `SpecialVocab` for
the merges, special token ids, `add_bos_token` and the chat template.

The pre-tokenizer type is the llama.cpp name of the regex `tokenizer.json` splits with. llama.cpp's converter finds
it by hashing the tokenization of a test string, which only recognises tokenizers it has seen (the bundled pack's
own 4096-token vocabulary is not one of them), so Strata reads the pre-tokenizer itself:
- Qwen2/Qwen3's `Split` regex followed by a ByteLevel without regex -> "qwen2" (what llama.cpp writes for Qwen3);
- a ByteLevel pre-tokenizer with GPT-2's built-in regex -> "gpt-2" (the bundled pack: its tokenizer.json splits
  with GPT-2's regex, so "qwen2", which splits digits one by one and keeps newlines apart, would tokenize code
  differently in llama.cpp).
Anything else is refused with one sentence.

Reading (`tokenizer_from_metadata`) rebuilds the same tokenizer from those keys, so a GGUF file runs on its own (a
file downloaded for llama.cpp or ollama has no tokenizer.json beside it).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from runtime.errors import LoadError, UsageError

QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
               r"\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TYPES = ("qwen2", "gpt-2")


def pre_type(tok_json: Mapping[str, Any], *, source: str = "tokenizer.json") -> str:
    """The llama.cpp pre-tokenizer type that splits text as `tok_json` does (see the module docstring)."""
    pre = tok_json.get("pre_tokenizer") or {}
    if pre.get("type") == "ByteLevel" and pre.get("use_regex", True) and not pre.get("add_prefix_space", False):
        return "gpt-2"
    if pre.get("type") == "Sequence":
        parts = pre.get("pretokenizers") or []
        if (len(parts) == 2 and parts[0].get("type") == "Split"
                and (parts[0].get("pattern") or {}).get("Regex") == QWEN2_REGEX
                and str(parts[0].get("behavior", "")).lower() == "isolated" and not parts[0].get("invert")
                and parts[1].get("type") == "ByteLevel" and not parts[1].get("use_regex", True)
                and not parts[1].get("add_prefix_space", False)):
            return "qwen2"
    raise UsageError(f"{source} uses a pre-tokenizer that llama.cpp's qwen2 and gpt-2 types do not reproduce; "
                     f"this tokenizer cannot be written to a GGUF file.")


def _looks_special(text: str) -> bool:
    """llama.cpp converter's `does_token_look_special` for the tokens a Qwen vocabulary may hold."""
    return (text in ("<pad>", "<mask>") or (text.startswith("<|") and text.endswith("|>"))
            or (text.startswith("<｜") and text.endswith("｜>")))


def vocab_lists(folder: Path, vocab_size: int) -> tuple[str, list[str], list[int]]:
    """(pre-tokenizer type, token strings, token types) for `tokenizer.json` in `folder`, padded to `vocab_size`."""
    import gguf

    path = Path(folder) / "tokenizer.json"
    try:
        tj = json.loads(path.read_text(encoding="utf-8"))
        model = tj["model"]
    except (OSError, ValueError, KeyError, TypeError):
        raise UsageError(f"{path} is missing or not a tokenizers file; the target needs its tokenizer.json.") from None
    if model.get("type") != "BPE" or model.get("byte_fallback") or (tj.get("decoder") or {}).get("type") != "ByteLevel":
        raise UsageError(f"{path} is not a byte-level BPE tokenizer, the only kind this GGUF layout holds.")
    pre = pre_type(tj, source=str(path))
    reverse: dict[int, str] = {int(i): t for t, i in model["vocab"].items()}
    added: dict[int, dict] = {}
    for a in tj.get("added_tokens") or []:
        reverse[int(a["id"])] = a["content"]
        added[int(a["id"])] = a
    if reverse and max(reverse) >= vocab_size:
        raise UsageError(f"{path} has token id {max(reverse)}, beyond config.json's vocab_size {vocab_size}.")
    tokens: list[str] = []
    types: list[int] = []
    for i in range(vocab_size):
        if i not in reverse:
            tokens.append(f"[PAD{i}]")
            types.append(int(gguf.TokenType.UNUSED))
        elif i in added:
            text = reverse[i]
            if added[i].get("special") or _looks_special(text):
                types.append(int(gguf.TokenType.CONTROL))
            else:
                text = text.replace("\u2581", " ")   # pre-normalised user-defined spaces, as llama.cpp's converter
                types.append(int(gguf.TokenType.USER_DEFINED))
            tokens.append(text)
        else:
            tokens.append(reverse[i])
            types.append(int(gguf.TokenType.NORMAL))
    return pre, tokens, types


def add_tokenizer(w: Any, folder: Path, vocab_size: int) -> None:
    """Write the tokenizer metadata of the checkpoint in `folder` (tokenizer.json, tokenizer_config.json,
    config.json) as llama.cpp's converter does for a GPT-2-style BPE vocabulary."""
    import gguf

    pre, tokens, types = vocab_lists(folder, vocab_size)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    special = gguf.SpecialVocab(Path(folder), load_merges=True, n_vocab=vocab_size)
    if not special.merges:
        raise UsageError(f"{Path(folder) / 'tokenizer.json'} has no BPE merges; it cannot be written to GGUF.")
    special.add_to_gguf(w, quiet=True)


def tokenizer_from_metadata(meta: Mapping[str, Any], *, source: str = "the GGUF file"):
    """A `tokenizers.Tokenizer` equal to the one the metadata was written from (byte-level BPE, `gpt2` model with a
    `qwen2` or `gpt-2` pre-tokenizer). LoadError for anything else."""
    import gguf
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    K = gguf.Keys.Tokenizer
    if meta.get(K.MODEL) != "gpt2":
        raise LoadError(f"{source} holds a {meta.get(K.MODEL)!r} tokenizer; Strata reads byte-level BPE ('gpt2') only.")
    pre = meta.get(K.PRE, "default")
    if pre not in PRE_TYPES:
        raise LoadError(f"{source} uses the pre-tokenizer {pre!r}; Strata reads {' and '.join(PRE_TYPES)}.")
    tokens, merges = meta.get(K.LIST), meta.get(K.MERGES)
    if not tokens or not merges:
        raise LoadError(f"{source} has no token list or merges; its tokenizer cannot be rebuilt.")
    types = list(meta.get(K.TOKEN_TYPE) or [int(gguf.TokenType.NORMAL)] * len(tokens))
    pairs = []
    for m in merges:
        a, sep, b = str(m).partition(" ")
        if not sep:
            raise LoadError(f"{source} has a malformed BPE merge {m!r}.")
        pairs.append((a, b))
    vocab = {t: i for i, t in enumerate(tokens)}
    if len(vocab) != len(tokens):
        raise LoadError(f"{source} lists a token twice; its tokenizer cannot be rebuilt.")
    try:
        tok = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
    except Exception as exc:   # tokenizers raises a bare Exception for a merge outside the vocabulary
        raise LoadError(f"{source} has a tokenizer that cannot be rebuilt ({exc}).") from None
    if pre == "qwen2":
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(QWEN2_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=False, use_regex=False)])
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    control = [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types, strict=True)
               if ty == int(gguf.TokenType.CONTROL)]
    user = [AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types, strict=True)
            if ty == int(gguf.TokenType.USER_DEFINED)]
    if control:
        tok.add_special_tokens(control)
    if user:
        tok.add_tokens(user)
    return tok
