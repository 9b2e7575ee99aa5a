"""Write a Qwen3-30B-A3B-shaped GGUF in llama.cpp's `qwen3moe` layout for timing llama.cpp on the same shape as
our benchmarks (bench/peer_llama.sh, docs/peers.md): every matrix Q4_0 with random 4-bit codes and block scales of
0.01, norms of ones, a random F32 router (std 0.02), a byte-level BPE vocabulary of 256 byte symbols, one merge and
padding tokens. Values mean nothing; bytes, shapes and layout are real. Needs gguf-py (the wheel, or llama.cpp's
gguf-py folder on PYTHONPATH).

    python bench/peer_a3b_gguf.py OUT.gguf          (about 17 GB; A3B_LAYERS / A3B_VOCAB make it smaller)
"""

from __future__ import annotations

import os
import sys
import time

import numpy as np


def byte_symbols() -> list[str]:
    """GPT-2's printable stand-ins for the 256 byte values, in byte order of its table."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    chars, extra = keep[:], 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + extra)
            extra += 1
    return [chr(c) for c in chars]


def main() -> None:
    import gguf

    if len(sys.argv) != 2:
        raise SystemExit("usage: python bench/peer_a3b_gguf.py OUT.gguf")
    out = sys.argv[1]
    H, inter, E, k, nh, nkv, hd = 2048, 768, 128, 8, 32, 4, 128
    layers, vocab = int(os.environ.get("A3B_LAYERS", 48)), int(os.environ.get("A3B_VOCAB", 151936))
    t0 = time.time()
    rng = np.random.default_rng(0)
    pool = rng.integers(0, 256, size=64 << 20, dtype=np.uint8)        # random code bytes, tiled
    scale = np.frombuffer(np.float16(0.01).tobytes(), dtype=np.uint8)

    def q4_0(shape: tuple[int, ...]) -> np.ndarray:
        """Q4_0 blocks (2-byte scale + 16 bytes of codes per 32 values) for a matrix of `shape`."""
        rows, blocks = int(np.prod(shape[:-1])), shape[-1] // 32
        b = np.resize(pool, rows * blocks * 18).reshape(rows * blocks, 18)
        b[:, 0:2] = scale
        return b.reshape(*shape[:-1], blocks * 18)

    w = gguf.GGUFWriter(out, "qwen3moe")
    w.add_block_count(layers)
    w.add_context_length(40960)
    w.add_embedding_length(H)
    w.add_feed_forward_length(6144)
    w.add_head_count(nh)
    w.add_head_count_kv(nkv)
    w.add_rope_freq_base(1e6)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_expert_count(E)
    w.add_expert_used_count(k)
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_expert_feed_forward_length(inter)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_0)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    symbols = byte_symbols()
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(symbols + ['!"'] + [f"[PAD{i}]" for i in range(vocab - 257)])
    w.add_token_types([gguf.TokenType.NORMAL] * vocab)
    w.add_token_merges(['! "'])
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)

    def quant(name: str, shape: tuple[int, ...]) -> None:
        w.add_tensor(name, q4_0(shape), raw_dtype=gguf.GGMLQuantizationType.Q4_0)

    def ones(name: str, n: int) -> None:
        w.add_tensor(name, np.ones(n, np.float32))

    quant("token_embd.weight", (vocab, H))
    for i in range(layers):
        p = f"blk.{i}."
        ones(p + "attn_norm.weight", H)
        quant(p + "attn_q.weight", (nh * hd, H))
        quant(p + "attn_k.weight", (nkv * hd, H))
        quant(p + "attn_v.weight", (nkv * hd, H))
        quant(p + "attn_output.weight", (H, nh * hd))
        ones(p + "attn_q_norm.weight", hd)
        ones(p + "attn_k_norm.weight", hd)
        ones(p + "ffn_norm.weight", H)
        w.add_tensor(p + "ffn_gate_inp.weight", rng.standard_normal((E, H), dtype=np.float32) * 0.02)
        quant(p + "ffn_gate_exps.weight", (E, inter, H))
        quant(p + "ffn_up_exps.weight", (E, inter, H))
        quant(p + "ffn_down_exps.weight", (E, H, inter))
    ones("output_norm.weight", H)
    quant("output.weight", (vocab, H))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file(progress=False)
    w.close()
    print(f"wrote {out} in {time.time() - t0:.1f} s", flush=True)


if __name__ == "__main__":
    main()
