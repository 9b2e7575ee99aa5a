"""The runtime's DFlash2 drafter against an independent transcription of z-lab's reference (zlab_reference.py).

The drafter is loaded the way the engine loads it (`load_dflash2_drafter` on a checkpoint folder: the contract
reads config.json, the loader builds the modules), then drives windows through `observe`/`propose`. The reference
gets the same checkpoint through transformers' `Qwen3Config`, so every attention default (`use_sliding_window`,
`max_window_layers`, `layer_types`, `is_causal`) is the reference's, not ours. Compared per window: the hidden
rows, the logits and the greedy selector walk, over three windows with the context growing between them (the
cache crop of the reference against our context cache), for every causal/sliding combination.
"""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from runtime.drafters.dflash2.loading import load_dflash2_drafter
from tests.runtime.drafters.dflash2.helpers import (
    drafter_config,
    one_thread,  # noqa: F401  (autouse fixture)
    tiny_target,
    write_hf_drafter,
)
from tests.runtime.drafters.dflash2.zlab_reference import (
    RefDFlash2,
    RefDrafting,
    layer_attention,
    reference_config,
)

HIDDEN, VOCAB, LAYERS = 64, 80, 3
SLIDING = ["sliding_attention"] * LAYERS
MIXED = ["sliding_attention", "full_attention", "sliding_attention"]

# how the config asks for windows (the window is 3 positions: it cuts into a 9-position context and 6-row block)
WINDOWS = {
    "none": {},
    "use_sliding_window, every layer": {"use_sliding_window": True, "sliding_window": 3, "max_window_layers": 0},
    "use_sliding_window, mixed layer_types": {"use_sliding_window": True, "sliding_window": 3, "layer_types": MIXED},
    "sliding layer_types, no use_sliding_window": {"sliding_window": 3, "layer_types": SLIDING},
    "use_sliding_window, max_window_layers 28": {"use_sliding_window": True, "sliding_window": 3},
}
CAUSAL = {"is_causal absent": {}, "is_causal false": {"is_causal": False}, "is_causal true": {"is_causal": True}}


@pytest.fixture(scope="module")
def target():
    return tiny_target(hidden=HIDDEN, vocab=VOCAB, layers=3, seed=2)


@pytest.mark.parametrize("causal", list(CAUSAL))
@pytest.mark.parametrize("windows", list(WINDOWS))
def test_drafter_matches_the_reference(tmp_path, target, windows, causal):
    cfg = drafter_config(hidden=HIDDEN, vocab=VOCAB, layers=LAYERS, heads=4, kv_heads=2, head_dim=16,
                         taps=(0, 2), num_target_layers=3, block_size=8, top_k=6, rank=16, embed_scale=1.5,
                         **WINDOWS[windows], **CAUSAL[causal])
    folder = write_hf_drafter(tmp_path / "head", cfg, seed=11)
    ours = load_dflash2_drafter(folder, target, device="cpu", dtype=torch.float32, context=64)

    rc = reference_config(cfg)
    ref = RefDFlash2(rc)
    ref.load_state_dict({k: v.float() for k, v in RefDFlash2.checkpoint_names(load_file(folder / "model.safetensors"))
                         .items()}, strict=True)
    ref.eval()
    drafting = RefDrafting(ref, target.model.embed_tokens.weight, target.lm_head, scale=1.5)

    # both sides agree on what each layer does, and the combination really is the one named
    for i, layer in enumerate(ours.model.layers):
        assert (layer.causal, layer.window) == layer_attention(rc, i)
    kinds = {(layer.causal, layer.window) for layer in ours.model.layers}
    assert kinds == {layer_attention(rc, i) for i in range(LAYERS)}

    g = torch.Generator().manual_seed(3)
    taps = torch.randn(20, 2 * HIDDEN, generator=g)
    ours.observe(torch.zeros(9, dtype=torch.long), torch.zeros(9, HIDDEN), taps[:9], 0)
    start, fed, width, anchor = 9, 0, 6, 17
    for step in range(3):
        prop = ours.propose(anchor, start, width - 1)
        logits = ours.logits_buf[: width - 1].clone()
        hs = ours.model.draft_hidden(anchor, start, width, ours.cache, target.model.embed_tokens.weight)
        ref_hs, ref_logits, ref_tokens = drafting.window(taps[fed:start], anchor, start, width)
        torch.testing.assert_close(hs, ref_hs, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(logits, ref_logits, rtol=1e-4, atol=1e-4)
        assert prop.tokens.tolist() == ref_tokens.tolist(), step
        # commit a few positions (as accepted tokens and a bonus would), then the next window
        n = (2, 3, 1)[step]
        ours.observe(torch.zeros(n, dtype=torch.long), torch.zeros(n, HIDDEN), taps[start:start + n], start)
        fed, start, anchor = start, start + n, int(ref_tokens[0])
