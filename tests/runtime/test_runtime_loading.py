"""Loading a Hub folder: single and sharded safetensors agree; wrong inventories fail with one clear message."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from runtime.errors import LoadError
from runtime.loading import load_target, load_tokenizer
from tests.runtime.tiny import make_tiny_target, single_thread  # noqa: F401

pytestmark = pytest.mark.usefixtures("single_thread")


def test_sharded_equals_single(tmp_path):
    a = load_target(make_tiny_target(tmp_path, "single", seed=3))
    b = load_target(make_tiny_target(tmp_path, "sharded", seed=3, sharded=True))
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert a.mtp is not None and a.cfg.mtp_sparse


def test_dtype_and_mtp_flags_follow_the_tensors(tmp_path):
    folder = make_tiny_target(tmp_path, mtp=False)
    m = load_target(folder, dtype=torch.bfloat16)
    assert m.mtp is None and m.lm_head.weight.dtype == torch.bfloat16
    ids = torch.tensor([[2, 3, 4]])
    assert m(ids).logits.shape == (1, 3, 64)


def test_tied_embeddings_share_storage(tmp_path):
    m = load_target(make_tiny_target(tmp_path, tie=True))
    assert m.lm_head.weight.data_ptr() == m.model.embed_tokens.weight.data_ptr()


def test_tokenizer_round_trip(tmp_path):
    tok = load_tokenizer(make_tiny_target(tmp_path))
    ids = tok.encode("hello, world").ids
    assert tok.decode(ids) == "hello, world"


def _edit(folder, fn):
    st = load_file(str(folder / "model.safetensors"))
    fn(st)
    save_file(st, str(folder / "model.safetensors"))


@pytest.mark.parametrize("edit, msg", [
    (lambda st: st.pop("model.layers.1.mlp.experts.2.up_proj.weight"),
     "lacks tensor model.layers.1.mlp.experts.2.up_proj.weight"),
    (lambda st: st.__setitem__("model.norm.weight", torch.ones(31)),
     r"model.norm.weight has shape \(31,\), expected \(32,\)"),
    (lambda st: st.__setitem__("model.layers.9.extra.weight", torch.ones(3)),
     "unexpected tensor model.layers.9.extra.weight"),
    (lambda st: st.__setitem__("model.norm.weight", torch.ones(32, dtype=torch.int32)), "dtype"),
])
def test_bad_inventory_is_one_clear_error(tmp_path, edit, msg):
    folder = make_tiny_target(tmp_path)
    _edit(folder, edit)
    with pytest.raises(LoadError, match=msg):
        load_target(folder)


def test_missing_files(tmp_path):
    with pytest.raises(LoadError, match="does not exist"):
        load_target(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(LoadError, match="no config.json"):
        load_target(tmp_path / "empty")
    folder = make_tiny_target(tmp_path)
    (folder / "model.safetensors").unlink()
    with pytest.raises(LoadError, match="no model.safetensors"):
        load_target(folder)
    (folder / "pytorch_model.bin").write_bytes(b"x")
    with pytest.raises(LoadError, match="pickle"):
        load_target(folder)


def test_index_cannot_escape_the_folder(tmp_path):
    folder = make_tiny_target(tmp_path, sharded=True)
    idx = json.loads((folder / "model.safetensors.index.json").read_text())
    k = next(iter(idx["weight_map"]))
    idx["weight_map"][k] = "../evil.safetensors"
    (folder / "model.safetensors.index.json").write_text(json.dumps(idx))
    with pytest.raises(LoadError, match="outside the folder"):
        load_target(folder)


def test_config_mismatch_with_tensors(tmp_path):
    folder = make_tiny_target(tmp_path)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["hidden_size"] = 48
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(LoadError, match="expected"):
        load_target(folder)
