"""Byte-level BPE tokenizer for strata-nano (trained with `tokenizers`), and its Hugging Face side files."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

EOS_TOKEN = "<|endoftext|>"
MASK_TOKEN = "<|mask|>"
EOS = 0  # ids fixed by the order of the special tokens given to the trainer
MASK = 1


def train_tokenizer(texts: Iterable[str], vocab_size: int = 4096) -> Tokenizer:
    """Fit a GPT-2 style byte-level BPE (no prefix space) with EOS = 0 and MASK = 1."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOS_TOKEN, MASK_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    if tok.token_to_id(EOS_TOKEN) != EOS or tok.token_to_id(MASK_TOKEN) != MASK:
        raise RuntimeError("special token ids moved; expected <|endoftext|>=0 and <|mask|>=1")
    return tok


def write_hf_files(folder: Path, tokenizer_json: Path, max_length: int) -> None:
    """Copy tokenizer.json and write tokenizer_config.json / generation_config.json next to it."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "tokenizer.json").write_bytes(tokenizer_json.read_bytes())
    tcfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": max_length,
        "eos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
        "mask_token": MASK_TOKEN,
        "bos_token": None,
        "add_bos_token": False,
        "clean_up_tokenization_spaces": False,
    }
    gcfg = {"eos_token_id": EOS, "pad_token_id": EOS, "do_sample": False}
    (folder / "tokenizer_config.json").write_text(json.dumps(tcfg, indent=2) + "\n")
    (folder / "generation_config.json").write_text(json.dumps(gcfg, indent=2) + "\n")
