"""bench/kernel_sass.py without a GPU: its SASS reading (loops found by their backward branches, opcodes counted
with predicates and modifiers stripped) and its compile of a recorded launch for sm_90 with this machine's Triton
(the shipped one-row Q4_0 gate/up tile, as the step launches it)."""

import pytest

from bench.kernel_sass import compile_entry, gemv_values_per_pass, instructions, loops, sass_and_regs

SASS = """
        /*0000*/                   LDC R1, c[0x0][0x28] ;
        /*0010*/                   S2R R0, SR_TID.X ;
        /*0020*/                   LDG.E.U16 R4, desc[UR4][R2.64] ;
        /*0030*/              @!P0 LOP3.LUT R5, R4, 0xf, RZ, 0xc0, !PT ;
        /*0040*/                   FFMA R6, R5, R7, R6 ;
        /*0050*/                   BAR.SYNC.DEFER_BLOCKING 0x0 ;
        /*0060*/               @P1 BRA 0x20 ;
        /*0070*/                   SHFL.BFLY PT, R8, R6, 0x1, 0x1f ;
        /*0080*/                   EXIT ;
        /*0090*/                   BRA 0x90;
"""


def test_loops_and_opcodes_from_sass():
    ops = [op for _, op in instructions(SASS)]
    assert ops == ["LDC", "S2R", "LDG", "LOP3", "FFMA", "BAR", "BRA", "SHFL", "EXIT", "BRA"]
    (lp,) = loops(SASS)                  # the self-branch at 0x90 is no loop; the shuffle is outside the one
    assert (lp["start"], lp["end"], lp["instructions"]) == ("0x20", "0x60", 5)
    assert lp["not_arithmetic"] == {"BAR": 1}


def test_values_per_pass_of_a_gemv_tile():
    # Q4_0 gate/up, 4 rows each of gate and up, 32 blocks a pass, 4 warps: 32 * 32 * 8 values over 128 threads
    assert gemv_values_per_pass({"QT": 3, "BN": 4, "NBC": 32, "UP": True, "MB": 1}, 4) == 64
    assert gemv_values_per_pass({"QT": 3, "BN": 4, "NBC": 32, "ONE": True}, 4) is None


def test_the_shipped_q4_0_tile_compiles_for_sm90_and_has_its_loop():
    pytest.importorskip("triton")
    e = {"format": "q4_0", "module": "runtime.gpu.moe_gemv", "name": "_gemv_kernel", "num_warps": 4,
         "num_stages": 1, "params": [
             ["x_ptr", {"tensor": "bf16", "aligned": True}], ["tok_ptr", {"tensor": "i32", "aligned": True}],
             ["se_ptr", {"tensor": "i32", "aligned": True}], ["slot_ptr", {"tensor": "i32", "aligned": True}],
             ["ord_ptr", {"tensor": "i32", "aligned": True}], ["wt_ptr", {"tensor": "bf16", "aligned": True}],
             ["w_ptr", {"tensor": "i16", "aligned": True}], ["o_ptr", {"tensor": "bf16", "aligned": True}],
             ["NP", {"int": 8}], ["E", {"int": 128}], ["N", {"int": 768}], ["NBLK", {"int": 64}],
             ["K", {"int": 2048}], ["mg", {"int": 0x4B000000}], ["stride_xm", {"int": 2048}],
             ["stride_we", {"int": 884736}], ["stride_om", {"int": 768}], ["d_ptr", {"tensor": "bf16", "aligned": True}],
             ["nw_ptr", {"tensor": "bf16", "aligned": True}], ["xo_ptr", {"tensor": "bf16", "aligned": True}],
             ["ho_ptr", {"tensor": "bf16", "aligned": True}], ["eps", {"float": 0.0}],
             ["SWN", {"int": 576}], ["EVEN", {"bool": True}], ["UP", {"bool": True}], ["HAS_SLOT", {"bool": False}],
             ["QT", {"int": 3}], ["ZERO", {"bool": False}], ["BM", {"int": 1}], ["MB", {"int": 1}],
             ["BN", {"int": 4}], ["NBC", {"int": 32}], ["PF", {"int": 0}], ["KMASK", {"bool": False}],
             ["J", {"int": 2}], ["ONE", {"bool": False}]]}
    k, consts = compile_entry(e, 90)
    assert consts["GDC"] is True and consts["QT"] == 3
    sass, regs = sass_and_regs(k)
    assert regs is not None and 16 <= regs <= 255
    lp = loops(sass)
    assert lp, "the looped tile compiles to a loop"
    per_value = lp[0]["instructions"] / gemv_values_per_pass(consts, 4)
    # three operations a value at the least (field, float, product); the shipped tile is near five on Triton 3.6
    assert 3 <= per_value <= 20


def test_r1_tables_follow_the_triton_version(monkeypatch):
    """From Triton 3.9 on (outside the interpreter) the Q8_0 / Q4_0 / IQ4_NL experts and one-row products take the
    row-by-row tiles, every width alike; before, the tables tuned on Triton 3.6; a table naming an R1 tile for a
    format it does not read is refused in one sentence."""
    import os

    from runtime.gpu import dense_kernels, moe_gemv
    from runtime.gpu.kernels import triton_version

    on = moe_gemv.r1_tables()
    assert on == (triton_version() >= (3, 9) and os.environ.get("TRITON_INTERPRET") != "1")
    for fmt in moe_gemv.R1_DECODE:
        for rows in (1, 4, 16):
            assert bool(moe_gemv.variant(fmt, rows).get("R1")) == on, (fmt, rows)
    assert (dense_kernels.QUANT_ONE_ROW[("q4_0", "qkv")] == "r4d8k2w4j2") == on
    assert dense_kernels.QUANT_ONE_ROW[("q4_0", "o_proj")] == "n8j2k4np"       # faster on both Tritons
    monkeypatch.setitem(moe_gemv.DECODE_GEMV, "q5_0", "r4d8k2w4j2")
    with pytest.raises(ValueError, match="row-by-row tile, which reads q8_0, q4_0, iq4_nl, q4_k only"):
        moe_gemv.variant("q5_0")


# the one-row BF16 split attention and the A3B o_proj tile (4 rows of 4096) as the step launches them, recorded
# launches in bench/kernel_sass.py's form; `_with` adds the parameters a test varies
_SPLIT = {"format": "bf16", "module": "runtime.gpu.attention_kernels", "name": "_attn_split_kernel", "num_warps": 4,
          "num_stages": 3, "params": [
              [n, {"tensor": t, "aligned": True}] for n, t in (
                  ("q_ptr", "bf16"), ("k_ptr", "bf16"), ("v_ptr", "bf16"), ("ks_ptr", "bf16"), ("vs_ptr", "bf16"),
                  ("pos_ptr", "i32"), ("acc_ptr", "fp32"), ("ml_ptr", "fp32"))] + [
              ["scale", {"float": 0.0883883}], ["stride_qw", {"int": 4096}], ["stride_qh", {"int": 128}],
              ["stride_ch", {"int": 16384}], ["stride_cs", {"int": 128}], ["stride_sh", {"int": 0}],
              ["stride_ss", {"int": 0}], ["NC", {"int": 1}], ["W", {"int": 1}], ["G", {"int": 8}], ["GP", {"int": 16}],
              ["RB", {"int": 4}], ["HD", {"int": 128}], ["BS", {"int": 64}], ["C0", {"int": 128}], ["E0", {"int": 4096}],
              ["C1", {"int": 256}], ["E1", {"int": 32768}], ["C2", {"int": 1024}], ["E2", {"int": 32768}],
              ["C3", {"int": 1024}], ["Q8", {"bool": False}],
              ["NB", {"int": 1}], ["QB", {"int": 1}], ["Q8_PF", {"int": 0}], ["CVT", {"int": 0}],
              ["EXIT", {"bool": True}]]}
_O_PROJ = {"format": "bf16", "module": "runtime.gpu.moe_gemv", "name": "_one_dense_kernel", "num_warps": 4,
           "num_stages": 1, "params": [
               ["x_ptr", {"tensor": "bf16", "aligned": True}], ["w_ptr", {"tensor": "bf16", "aligned": True}],
               ["y_ptr", {"tensor": "bf16", "aligned": True}], ["N", {"int": 2048}], ["K", {"int": 4096}],
               ["SWN", {"int": 4096}], ["BN", {"int": 4}], ["KC", {"int": 4096}], ["EVEN", {"bool": True}],
               ["EARLY", {"bool": True}]]}


def _with(entry: dict, *params: list) -> dict:
    return {**entry, "params": entry["params"] + list(params)}


def _ops(entry: dict) -> tuple[list[str], str, int]:
    sass, regs = sass_and_regs(compile_entry(entry, 90)[0])
    return [op for _, op in instructions(sass)], sass, regs


def test_split_attention_asks_its_kv_into_l2_before_its_wait():
    """attention_kernels.SPLIT_KV_PREFETCH: the one-row BF16 split kernel (as the step launches it at PDL) compiled
    for sm_90 with the prefetch on has one bulk L2 prefetch for K and one for V, both before its PDL wait, and
    the same chunk loops as without it; off, none."""
    pytest.importorskip("triton")
    found = {}
    for pf in (0, 128):
        ops, sass, _ = _ops(_with(_SPLIT, ["PF", {"int": pf}]))
        wait = ops.index("ACQBULK")
        found[pf] = ([i for i, op in enumerate(ops) if op == "UBLKPF"], wait,
                     [lp["instructions"] for lp in loops(sass)])
    assert found[0][0] == []
    pf_at, wait, lps = found[128]
    assert len(pf_at) == 2 and max(pf_at) < wait
    assert len(lps) == len(found[0][2]) and all(abs(a - b) <= 8 for a, b in zip(lps, found[0][2], strict=True))


def test_lean_o_proj_lets_the_next_kernel_in_at_its_start_without_more_registers():
    """moe_gemv "one_d4leantop": the A3B o_proj tile (4 rows of 4096) compiled for sm_90 lets the next kernel in
    (PREEXIT: griddepcontrol.launch_dependents) before its first weight load and waits (ACQBULK) after it, in as
    few registers as the form that lets it in after its sums."""
    pytest.importorskip("triton")
    got = {}
    for top in (False, True):
        ops, _, regs = _ops(_with(_O_PROJ, ["TOP", {"bool": top}]))
        got[top] = (ops.index("PREEXIT"), ops.index("LDG"), ops.index("ACQBULK"), regs)
    pre, ldg, acq, regs = got[True]
    assert pre < ldg < acq
    assert got[False][0] > got[False][2]          # after the sums: past the wait
    assert regs <= got[False][3]


def test_sm_marks_are_written_and_read_before_the_waits():
    """pdl.MARK_SMS (arm o-aware): the split kernel stores its SM's mark before its PDL wait (with pdl.MARK_MAX too);
    o_proj's "one_d4leanaware" tile reads the mark before its first weight load and has a wait on either side of
    those loads (one taken), in registers that still let five programs share an SM."""
    pytest.importorskip("triton")
    for most in (0, 64):             # every working program, or only while at most 64 work (pdl.MARK_MAX)
        ops, _, _ = _ops(_with(_SPLIT, ["mark_ptr", {"tensor": "i32", "aligned": True}], ["PF", {"int": 64}],
                               ["MARK", {"bool": True}], ["MARK_MAX", {"int": most}]))
        assert "STG" in ops[:ops.index("ACQBULK")], most
    ops, _, regs = _ops(_with(_O_PROJ, ["mark_ptr", {"tensor": "i32", "aligned": True}], ["TOP", {"bool": True}],
                              ["AWARE", {"bool": True}]))
    waits = [i for i, op in enumerate(ops) if op == "ACQBULK"]
    loads = [i for i, op in enumerate(ops) if op == "LDG"]
    assert len(waits) == 2 and loads[0] < waits[0] < loads[1] < waits[1]
    assert regs * 128 * 5 <= 65536


def _q8(entry: dict) -> dict:
    """The split kernel's launch over a q8_0 cache (int8 codes, fp16 scales: 4 blocks of 32 a 128-value row)."""
    kinds = {"k_ptr": "i8", "v_ptr": "i8", "ks_ptr": "fp16", "vs_ptr": "fp16"}
    value = {"stride_sh": {"int": 4096}, "stride_ss": {"int": 4}, "Q8": {"bool": True}, "NB": {"int": 4},
             "QB": {"int": 32}, "Q8_PF": {"bool": True}}
    params = [[n, {**d, "tensor": kinds[n]} if n in kinds else value.get(n, d)] for n, d in entry["params"]]
    return {**entry, "params": params}


def test_split_attention_over_a_q8_0_cache_compiles_with_its_l2_prefetch():
    """The one-row split kernel over a q8_0 cache as a Hopper GPU launches it by default (the first chunk's K, V and
    their scales asked into L2 before the PDL wait: attention_kernels.SPLIT_KV_PREFETCH; the SM marks of pdl too)
    compiles for sm_90: four bulk prefetches before the wait, none without the prefetch. The interpreter runs no
    type check across loop iterations, so only a compile finds a name the prefetch shares with a loop (a q8_0
    cache once sent the step to plain torch, 38x slower, on every Hopper GPU)."""
    pytest.importorskip("triton")
    from runtime.gpu import attention_kernels

    pf = int(attention_kernels.SPLIT_KV_PREFETCH) or 64
    for extra, n_pf in (([["PF", {"int": 0}]], 0), ([["PF", {"int": pf}]], 4),
                        ([["mark_ptr", {"tensor": "i32", "aligned": True}], ["PF", {"int": pf}],
                          ["MARK", {"bool": True}]], 4)):
        ops, _, _ = _ops(_with(_q8(_SPLIT), *extra))
        pf_at = [i for i, op in enumerate(ops) if op == "UBLKPF"]
        assert len(pf_at) == n_pf and all(i < ops.index("ACQBULK") for i in pf_at), (extra, pf_at)


_REDUCE = {"format": "bf16", "module": "runtime.gpu.attention_kernels", "name": "_attn_reduce_kernel", "num_warps": 2,
           "num_stages": 3, "params": [
               [n, {"tensor": t, "aligned": True}] for n, t in (
                   ("acc_ptr", "fp32"), ("ml_ptr", "fp32"), ("pos_ptr", "i32"), ("o_ptr", "bf16"))] + [
               ["NC", {"int": 64}], ["stride_ow", {"int": 4096}], ["stride_oh", {"int": 128}], ["HD", {"int": 128}],
               ["DB", {"int": 32}], ["C0", {"int": 128}], ["E0", {"int": 4096}], ["C1", {"int": 256}],
               ["E1", {"int": 32768}], ["C2", {"int": 1024}], ["E2", {"int": 32768}], ["C3", {"int": 1024}],
               ["NCB", {"int": 64}]]}


def test_one_row_chunk_layout_compiles_for_sm90():
    """runtime/kv.py ONE_ROW_CHUNKS (and ONE_ROW_CHUNKS_Q8's form over a q8_0 cache): the split kernel and its
    reduction with the chunk size computed from the row's length compile for sm_90, the split still asking its
    first chunk's K/V into L2 before its PDL wait."""
    pytest.importorskip("triton")
    from runtime.kv import ONE_ROW_CHUNKS, one_row_layout

    t, cmin, cmax = one_row_layout(ONE_ROW_CHUNKS or (64, 32, 2048))
    lay = [["AT", {"int": t}], ["AMIN", {"int": cmin}], ["AND", {"int": (cmax // cmin).bit_length() - 1}]]
    for entry, n_pf in ((_SPLIT, 2), (_q8(_SPLIT), 4)):
        ops, sass, regs = _ops(_with(entry, ["PF", {"int": 64}], *lay))
        pf_at = [i for i, op in enumerate(ops) if op == "UBLKPF"]
        assert len(pf_at) == n_pf and max(pf_at) < ops.index("ACQBULK") and regs <= 255
        assert sass != _ops(_with(entry, ["PF", {"int": 64}]))[1]          # the layout's code, not the tiers'
    ops, _, _ = _ops(_with(_REDUCE, *lay))
    assert "ACQBULK" in ops


@pytest.mark.timeout(300)
def test_every_kernel_of_the_one_row_step_compiles_for_sm90(tmp_path, monkeypatch):
    """Every kernel the fused one-row step launches (a narrow model of the A3B's head shape, BF16 / Q4_0 / Q8_0
    targets, a q8_0 cache), recorded in the interpreter and compiled for sm_90 as a Hopper launch sets it (PDL, the
    split attention's L2 prefetch, register caps): the interpreter checks no types, so a kernel can pass every
    interpreter check and still not build on a GPU, where the step then falls back to a path many times slower."""
    pytest.importorskip("triton")
    from bench import kernel_sass
    from runtime.gpu import attention_kernels as ak

    monkeypatch.setenv("OUT", str(tmp_path))
    res = kernel_sass.main(["--formats", "bf16,q4_0,q8_0", "--kv", "q8_0", "--small"])
    errors = [k for k in res["kernels"] if "error" in k]
    assert errors == [], errors
    names = {(k["format"], k["kernel"]) for k in res["kernels"]}
    for kernel in ("_qkv_post_kernel", "_attn_split_kernel", "_attn_reduce_kernel", "_route_kernel",
                   "_down_sum_kernel", "_rmsnorm_kernel"):
        assert ("bf16", kernel) in names, (kernel, names)
    assert {"q4_0", "q8_0"} <= {f for f, k in names if k == "_gemv_kernel"}
    # each as the runtime launches it: Triton's FMA contraction named, not its default (runtime/gpu/kernels.py FMA)
    assert [k["kernel"] for k in res["kernels"] if k["enable_fp_fusion"] is not True] == []
    split = next(k for k in res["kernels"] if k["kernel"] == "_attn_split_kernel")
    assert split["tile"].get("PF") == ak.SPLIT_KV_PREFETCH and split["registers"] <= ak.SPLIT_ONE_Q8_REGS
