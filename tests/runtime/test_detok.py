"""Streaming text is exactly the final text, whatever the chunking, and each step decodes only a short window."""

from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from runtime.detok import IncrementalDetokenizer

BUNDLED = Path(__file__).resolve().parents[2] / "setup_wizard" / "bundled" / "strata-nano" / "tokenizer.json"
TOK = Tokenizer.from_file(str(BUNDLED))     # byte-level BPE: multi-byte characters span several tokens

TEXT = st.text(alphabet=st.sampled_from(list("abc def_():\n\t\"'=") + ["é", "ü", "→", "漢", "🎉", "𝔘"]),
               min_size=0, max_size=60)


class Counting:
    """The tokenizer, recording how many ids each decode call gets."""

    def __init__(self, tok):
        self.tok, self.sizes = tok, []

    def decode(self, ids, skip_special_tokens=True):
        self.sizes.append(len(ids))
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)


def _stream(ids, cuts, tok=TOK):
    d = IncrementalDetokenizer(tok)
    pieces, start = [], 0
    for c in [*sorted(set(cuts)), len(ids)]:
        if c > start:
            pieces.append(d.push(ids[start:c]))
            start = c
    pieces.append(d.flush())
    return pieces


@settings(max_examples=200, deadline=None)
@given(text=TEXT, data=st.data())
def test_streamed_pieces_concatenate_to_the_final_text(text, data):
    ids = TOK.encode(text).ids
    cuts = data.draw(st.lists(st.integers(0, max(0, len(ids))), max_size=12))
    pieces = _stream(ids, cuts)
    assert "".join(pieces) == TOK.decode(ids, skip_special_tokens=True)
    assert all("\ufffd" not in p for p in pieces[:-1])     # no half characters while streaming


def test_a_character_split_over_tokens_is_held_back_until_complete():
    ids = TOK.encode("x🎉y").ids
    d = IncrementalDetokenizer(TOK)
    out = [d.push([i]) for i in ids] + [d.flush()]
    assert "".join(out) == "x🎉y"
    assert "🎉" in out and "\ufffd" not in "".join(out)


def test_each_step_decodes_a_short_window_not_the_whole_output():
    text = "def f(x):\n    return x + 1\n" * 40
    ids = TOK.encode(text).ids
    counting = Counting(TOK)
    d = IncrementalDetokenizer(counting)
    chunk = 4
    out = [d.push(ids[i:i + chunk]) for i in range(0, len(ids), chunk)] + [d.flush()]
    assert "".join(out) == text
    assert len(ids) > 200 and max(counting.sizes) <= 2 * chunk
