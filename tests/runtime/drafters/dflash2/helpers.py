"""Tiny random DFlash2 drafters for tests: configs, weights, HF folders and GGUF files (reusable by any area).

    from tests.runtime.drafters.dflash2.helpers import drafter_config, random_drafter_state, write_hf_drafter, write_gguf_drafter
    folder = write_hf_drafter(tmp_path / "d", drafter_config(hidden=32, vocab=64, taps=[0, 2]))
    gguf_path = write_gguf_drafter(tmp_path / "d.gguf", folder, quant="q8_0")
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from runtime.drafters.dflash2.contract import (
    KEY_QUANTIZATION,
    DFlash2Geometry,
    expected_tensors,
    hf_to_gguf,
    write_gguf_metadata,
)
from runtime.formats.registry import FORMATS


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Import into a test module to run it with one intra-op thread (restored afterwards): tiny models are faster
    so, and immune to OpenMP spin-wait collapse on a busy machine (measured: the e2e module took 5 minutes with 2
    threads under load, 15 s with one). Not a conftest.py: several `conftest` modules in rootdir mode collide."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def drafter_config(*, hidden: int = 64, inter: int = 96, layers: int = 2, heads: int = 2, kv_heads: int = 1,
                   head_dim: int = 32, vocab: int = 80, taps: list[int] | tuple[int, ...] = (0, 2),
                   num_target_layers: int | None = None, block_size: int = 8, kernel: int = 2, group: int = 16,
                   rank: int = 16, top_k: int = 4, mask_token_id: int | None = None,
                   output_multiplier: float = 0.7, softcap: float | None = 8.0, embed_scale: float = 1.0,
                   **extra: Any) -> dict:
    """A DFlash2 config.json dict at a tiny geometry (official key layout)."""
    dc: dict[str, Any] = {
        "block_size": block_size, "mask_token_id": vocab - 1 if mask_token_id is None else mask_token_id,
        "target_layer_ids": list(taps), "conv_kernel_size": kernel, "conv_group_size": group,
        "selector_rank": rank, "selector_top_k": top_k, "output_multiplier": output_multiplier,
        "input_embedding_scale": embed_scale,
    }
    if softcap is not None:
        dc["final_logit_softcapping"] = softcap
    cfg: dict[str, Any] = {
        "architectures": ["DFlash2DraftModel"], "hidden_size": hidden, "intermediate_size": inter,
        "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
        "head_dim": head_dim, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "vocab_size": vocab,
        "dflash_config": dc,
    }
    if num_target_layers is not None:
        cfg["num_target_layers"] = num_target_layers
    cfg.update(extra)
    return cfg


def random_drafter_state(cfg: dict, *, seed: int = 0, v1: bool = False, dtype: torch.dtype = torch.bfloat16,
                         scale: float = 0.3) -> dict[str, torch.Tensor]:
    """Random weights with checkpoint names (norm weights near 1, conv kernels small but non-zero)."""
    geom = DFlash2Geometry.from_config(cfg)
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, (shape, kind) in expected_tensors(geom, v1=v1).items():
        if kind == "norm":
            t = 1.0 + 0.2 * torch.randn(shape, generator=gen)
        elif name.endswith("base_kernel"):
            t = 0.5 * torch.randn(shape, generator=gen)
            t[:, 0] += 1.0
        elif kind in ("selector", "conv"):
            t = 0.5 * torch.randn(shape, generator=gen)
        else:
            t = scale * torch.randn(shape, generator=gen) / shape[1] ** 0.5 * 3
        out[name] = t.to(dtype).contiguous()
    return out


def write_hf_drafter(folder: str | Path, cfg: dict, state: dict[str, torch.Tensor] | None = None, *,
                     seed: int = 0, v1: bool = False) -> Path:
    """Write config.json + model.safetensors (BF16 unless `state` says otherwise) and return the folder."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    if state is None:
        state = random_drafter_state(cfg, seed=seed, v1=v1)
    (folder / "config.json").write_text(json.dumps(cfg, indent=1))
    save_file({k: v.contiguous() for k, v in state.items()}, str(folder / "model.safetensors"))
    return folder


def write_gguf_drafter(path: str | Path, hf_folder: str | Path, *, quant: str = "bf16",
                       tamper: dict[str, np.ndarray] | None = None) -> Path:
    """Convert an HF drafter folder to GGUF with the contract's names and keys (a test-side converter).

    Backbone matrices are block-quantized with `gguf.quants.quantize` for q8_0/q5_0/q4_0; everything else keeps
    its BF16 bits. `tamper` replaces the stored bytes/bits of named tensors (HF names) to make bad files.
    """
    import gguf

    folder = Path(hf_folder)
    cfg = json.loads((folder / "config.json").read_text())
    geom = DFlash2Geometry.from_config(cfg)
    state = load_file(str(folder / "model.safetensors"))
    v1 = not any(k.startswith("candidate_selector.") for k in state)
    kinds = expected_tensors(geom, v1=v1)
    w = gguf.GGUFWriter(str(path), "dflash2")
    write_gguf_metadata(w, geom)
    w.add_uint32("general.file_type", FORMATS[quant].file_type)
    w.add_string(KEY_QUANTIZATION, quant)
    for name, t in state.items():
        bits = t.contiguous().view(torch.int16).numpy().view(np.uint16)
        if quant != "bf16" and kinds[name][1] == "backbone":
            qt = getattr(gguf.GGMLQuantizationType, quant.upper())
            data = gguf.quants.quantize(t.float().numpy(), qt)
            raw = qt
        else:
            data, raw = bits, gguf.GGMLQuantizationType.BF16
        if tamper and name in tamper:
            data = tamper[name]
        w.add_tensor(hf_to_gguf(name), data, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return Path(path)


def tiny_target(*, hidden: int = 64, vocab: int = 80, layers: int = 3, seed: int = 0, **kw: Any):
    """An in-memory tiny Qwen3-MoE target (fp32) for drafter tests."""
    from runtime.models.qwen3_moe import Qwen3MoeModel
    from runtime.models.target_config import Qwen3MoeConfig
    from tests.runtime.tiny import tiny_config

    torch.manual_seed(seed)
    cfg = tiny_config(vocab=vocab, hidden=hidden, layers=layers, mtp=False, **kw)
    return Qwen3MoeModel(Qwen3MoeConfig.from_dict(cfg)).eval()


def train_on_sequence(cfg: dict, target, seq: torch.Tensor, *, first_anchor: int, width: int | None = None,
                      steps: int = 120, lr: float = 3e-3, seed: int = 4, until_runs: float | None = None,
                      walk_from: int | None = None, margin: float = 0.5, round_steps: int = 60, max_steps: int = 1200) -> dict[str, torch.Tensor]:
    """Fit a tiny drafter to one target sequence (teacher forcing, the training API end to end) and return its
    BF16 state dict. Every anchor from `first_anchor` on is one window; all windows share one context (the
    sequence's taps) and see positions before their anchor. Loss: draft logits CE + selector CE with the true
    token placed first among the candidates.

    `until_runs`: after the first `steps`, keep training (`round_steps` at a time, at most `max_steps` in all)
    until the BF16-rounded drafter, walking greedily through the sequence as the speculative loop does (window at
    the anchor `walk_from`, default `first_anchor`; the next window after the accepted proposals and the bonus
    token; windows that fit in the sequence), accepts at least
    `until_runs` proposals per window on average, every accepted pick ahead of the runner-up candidate by at least
    `margin` (so rounding in another code path cannot flip it). A fixed step count alone is fragile: how far it
    gets differs across CPUs. A fit that never gets there fails the test (pytest.fail), never returns half-made."""
    import torch.nn.functional as F

    from runtime.drafters.dflash2.model import DFlash2Model

    geom = DFlash2Geometry.from_config(cfg)
    W = width or geom.block_size
    model = DFlash2Model(geom)
    model.load_state_dict({k: v.float() for k, v in random_drafter_state(cfg, seed=seed).items()})
    with torch.no_grad():
        taps = target(seq[None], taps=tuple(geom.target_layer_ids), logits_to_keep=-1).taps
    S = seq.shape[0]
    anchors = torch.arange(first_anchor, S - W + 1)
    B = anchors.shape[0]
    ids = torch.full((B, W), geom.mask_token_id)
    ids[:, 0] = seq[anchors]
    positions = anchors[:, None] + torch.arange(W)[None]
    labels, prev = seq[positions[:, 1:]], seq[positions[:, :-1]]
    embed, head = target.model.embed_tokens, target.lm_head
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    k = geom.selector_top_k

    def fit(n: int) -> None:
        for _ in range(n):
            out = model(taps, torch.arange(S), ids, positions, embed=embed, lm_head=head, ctx_lengths=anchors)
            loss = F.cross_entropy(out.logits.reshape(-1, geom.vocab_size), labels.reshape(-1))
            cand = torch.cat([labels[..., None], torch.topk(out.logits.detach(), k - 1, dim=-1).indices], dim=-1)
            scores, _ = model.selector_scores(out.hs, out.logits, prev, candidates=cand)
            loss = loss + F.cross_entropy(scores.reshape(-1, k), torch.zeros(scores.shape[0] * scores.shape[1],
                                                                              dtype=torch.long))
            opt.zero_grad()
            loss.backward()
            opt.step()

    def bf16_state() -> dict[str, torch.Tensor]:
        return {name: t.detach().to(torch.bfloat16).contiguous() for name, t in model.state_dict().items()}

    def mean_run() -> float:
        """Proposals accepted per window by a greedy walk of the BF16-rounded drafter through the sequence.
        Teacher-forced rows equal free-running ones as long as every earlier row was right, so a window's
        accepted run is its count of leading rows whose pick is the true token (by `margin`)."""
        check = DFlash2Model(geom)
        check.load_state_dict({n: t.float() for n, t in bf16_state().items()})
        with torch.no_grad():
            out = check(taps, torch.arange(S), ids, positions, embed=embed, lm_head=head, ctx_lengths=anchors)
            scores, cand = check.selector_scores(out.hs, out.logits, prev)
        hit = cand == labels[..., None]
        true = scores.masked_fill(~hit, float("-inf")).amax(-1)
        other = scores.masked_fill(hit, float("-inf")).amax(-1)
        good = (hit.any(-1) & (true - other >= margin)).int()          # [B, W-1]
        run = good.cumprod(-1).sum(-1)                                  # leading right rows per window
        a, runs = (walk_from if walk_from is not None else first_anchor) - first_anchor, []
        while a < B:
            runs.append(int(run[a]))
            a += int(run[a]) + 1
        return sum(runs) / len(runs)

    fit(steps)
    done = steps
    while until_runs is not None and mean_run() < until_runs:
        if done >= max_steps:
            pytest.fail(f"the test drafter did not learn its sequence in {max_steps} steps (mean run "
                        f"{mean_run():.2f} < {until_runs}); raise max_steps.")
        fit(round_steps)
        done += round_steps
    return bf16_state()
