"""Review findings: a tampered artifact in the store is never reused as 'verified'."""

from __future__ import annotations

from artifacts_helpers import write_checkpoint

from setup_wizard.convert import convert_to_store
from setup_wizard.store import Store, sha256_file


def test_converted_cache_rebuilds_a_same_size_tampered_file(tmp_path, home):
    ckpt = write_checkpoint(tmp_path / "ckpt")
    store = Store()
    a = convert_to_store(ckpt, "q8_0", store)
    good = a.path.read_bytes()
    bad = bytearray(good)
    bad[-100] ^= 0xFF  # one weight byte: header, tensor table and size all still check out
    a.path.write_bytes(bytes(bad))
    b = convert_to_store(ckpt, "q8_0", store)
    assert not b.reused
    assert b.path.read_bytes() == good and b.sha256 == a.sha256 == sha256_file(b.path)
