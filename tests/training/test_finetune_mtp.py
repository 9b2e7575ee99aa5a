"""The MTP chain fine-tune (training/finetune_mtp.py) trains the chain the runtime drafts with: its teacher-forced
chain gives the runtime chain's own draft distributions, and merging a head changes only the mtp.* tensors."""

from __future__ import annotations

import shutil

import torch
from safetensors.torch import load_file

from bench.common import NANO
from runtime.engine import Engine
from runtime.loading import load_target
from runtime.sampling import SamplingParams
from training import finetune_mtp
from training.common import save_bf16

PROMPT = "import os\n\n\ndef read_lines(path):\n    \"\"\"Return the lines of a file.\"\"\"\n    with open(path) as f:\n"


def test_depth_one_is_the_teacher_forced_mtp():
    model = load_target(NANO, device="cpu", dtype=torch.float32).eval()
    ids = torch.randint(2, model.cfg.vocab_size, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        hidden = model(ids, logits_to_keep=-1).hidden
        want = model.mtp_logits(ids, hidden)
        got = finetune_mtp.chain_logits(model, ids, hidden, 1)[0]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


def test_the_chain_gives_the_runtime_chains_draft_distributions():
    eng = Engine.build(NANO, "mtp", device="cpu", context=512, block=4)
    d = eng.drafter
    d.head8 = None                        # the target's own fp32 head, as the training computes it
    ids = eng.tokenizer.encode(PROMPT).ids
    first = eng.generate(ids, max_new_tokens=1, stop_ids=set()).token_ids[-1]
    d.flush()
    sp = SamplingParams(temperature=1.0, seed=3)
    prop = d.propose(first, d.next_pos, 3, sampling=sp, generator=torch.Generator().manual_seed(3))
    drafts = [int(t) for t in prop.tokens]
    assert len(drafts) == 3 and prop.q.shape[0] == 3
    seq = torch.tensor([ids + [first] + drafts[:2]])
    a = len(ids)                          # the anchor's position
    with torch.no_grad():
        hidden = eng.model(seq, logits_to_keep=-1).hidden
        chain = finetune_mtp.chain_logits(eng.model, seq, hidden, 3)
    for depth in range(1, 4):
        row = a + depth - 2               # depth d's row at position a + d - 1
        q = torch.softmax(chain[depth - 1][0, row].float(), -1)
        torch.testing.assert_close(q, prop.q[depth - 1].float(), atol=2e-5, rtol=1e-3)


def test_chain_mask_sees_committed_rows_up_to_the_anchor_and_its_own_chain():
    m = finetune_mtp.chain_mask(5, 3, torch.device("cpu"))
    # depth 3, row 4: committed rows 0..2 (anchor at row 2), depth 2's row 3, its own row 4
    assert m[4].nonzero().flatten().tolist() == [0, 1, 2, 5 + 3, 10 + 4]
    assert m[0].nonzero().flatten().tolist() == [10]          # no chain yet: only itself (not used)


def test_merge_changes_only_the_mtp_tensors(tmp_path):
    pack = tmp_path / "pack"
    shutil.copytree(NANO, pack / "strata-nano")
    before = load_file(str(pack / "strata-nano" / "model.safetensors"))
    head = {k: v.float() + 1 for k, v in before.items() if k.startswith("mtp.")}
    save_bf16(head, tmp_path / "mtp_head.safetensors")
    finetune_mtp.main(["--pack", str(pack), "--merge", str(tmp_path / "mtp_head.safetensors")])
    after = load_file(str(pack / "strata-nano" / "model.safetensors"))
    assert after.keys() == before.keys()
    for k, v in after.items():
        want = head[k].to(torch.bfloat16) if k.startswith("mtp.") else before[k]
        assert torch.equal(v, want), k


def test_acceptance_of_a_one_draft_chain_is_one_plus_its_hit_rate():
    model = load_target(NANO, device="cpu", dtype=torch.float32).eval()
    seqs = torch.randint(2, model.cfg.vocab_size, (3, 30), generator=torch.Generator().manual_seed(1))
    r = finetune_mtp.chain_acceptance(model, seqs, 10, 1, torch.device("cpu"))
    assert r["anchors"] == 3 * (29 - 10 + 1)
    assert abs(r["tokens_per_window"] - (1 + r["top1_by_depth"][0])) < 1e-3
    r3 = finetune_mtp.chain_acceptance(model, seqs, 10, 3, torch.device("cpu"))
    assert r3["anchors"] == 3 * (29 - 10 - 1)
