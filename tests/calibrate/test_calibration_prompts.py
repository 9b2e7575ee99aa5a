"""The shipped calibration prompts: four Python-flavoured tasks, the long one above 2k tokens of a byte-level BPE
trained on Python source (the bundled pack's kind of tokenizer) yet inside a 4096-token context."""

from __future__ import annotations

import glob
import sysconfig
from pathlib import Path

import pytest

from calibrate.fixtures import (
    LONG_MIN_TOKENS,
    NEW_TOKENS,
    TASKS,
    encode_prompts,
    load_prompts,
    prompt_set_sha256,
)

BUNDLED_TOKENIZER = Path(__file__).resolve().parents[2] / "setup_wizard" / "bundled" / "strata-nano" / "tokenizer.json"


@pytest.fixture(scope="module")
def python_bpe():
    """A 4096-token byte-level BPE trained on some of the standard library (about a second)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    files = sorted(glob.glob(sysconfig.get_paths()["stdlib"] + "/*.py"))[:60]
    assert len(files) >= 30
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train(files, trainers.BpeTrainer(vocab_size=4096, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                         show_progress=False))
    return tok


def test_four_tasks_ship_as_text():
    prompts = load_prompts()
    assert tuple(prompts) == TASKS == ("code", "math", "prose", "long")
    assert all(p.isascii() and len(p) > 800 for p in prompts.values())
    assert len(prompts["long"].encode()) > 8192
    assert "def " in prompts["code"] and "Task:" in prompts["long"]
    assert len(prompt_set_sha256(prompts)) == 64


def _check_counts(tok):
    n = {t: len(tok.encode(p).ids) for t, p in load_prompts().items()}
    assert LONG_MIN_TOKENS <= n["long"] <= 4096 - NEW_TOKENS - 16 - 1, n
    assert all(100 <= n[t] <= 1024 for t in ("code", "math", "prose")), n
    return n


def test_long_prompt_is_over_2k_tokens_with_a_python_bpe(python_bpe):
    _check_counts(python_bpe)


def test_long_prompt_is_over_2k_tokens_with_the_bundled_tokenizer():
    from tokenizers import Tokenizer

    _check_counts(Tokenizer.from_file(str(BUNDLED_TOKENIZER)))


def test_prompts_are_cut_from_the_left_to_fit_the_context(python_bpe):
    enc = encode_prompts(python_bpe, load_prompts(), context=1024, new_tokens=96, max_block=16)
    full = python_bpe.encode(load_prompts()["long"]).ids
    assert enc["long"].truncated and enc["long"].ids == full[-(1024 - 96 - 16 - 1):]
    assert not enc["code"].truncated
    with pytest.raises(ValueError, match="context"):
        encode_prompts(python_bpe, load_prompts(), context=100, new_tokens=96, max_block=16)
