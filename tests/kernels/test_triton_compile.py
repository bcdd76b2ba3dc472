"""Every Triton kernel compiles for sm_90 (H200) on a machine without a GPU, with exact fp32 semantics.

Triton's bundled ptxas builds each kernel ahead of time for
``GPUTarget("cuda", 90, 32)`` (no device needed), in a subprocess because the
other kernel tests run the interpreter (TRITON_INTERPRET=1 decorates kernels
as interpreted functions). The PTX must hold no FMA contraction (``fma.``),
no approximate division (``div.full`` / ``div.approx``) and no flush-to-zero
(``.ftz``): each would break bitwise equality with the reference (an entry may
allow one: the FP32 attention's `tl.dot`, which is FMAs like any FP32 GEMM). Run by hand:
``python tests/kernels/test_triton_compile.py``; with ``--count`` it also prints
SASS instructions per element (cuobjdump; out-of-line subroutines such as
div_rn's slow path left out), registers and top opcodes (figures: docs/performance.md).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

pytest.importorskip("triton", reason="triton is not installed (pip install 'rl4bit[triton]')")


def _kernels():
    import torch
    import triton.language as tl

    from rl4bit.kernels import mxfp8_triton as mx
    from rl4bit.kernels import nvfp4_triton as nv
    from rl4bit.kernels import s2f6_triton as s2

    seeds = dict(seed_lo="i64", seed_hi="i64")
    nv_sig = dict(x_ptr="*bf16", src_ptr="*i64", amax_ptr="*fp32", data_ptr="*u8", scale_ptr="*u8", outer_ptr="*fp32",
                  flag_ptr="*i32", xh_ptr="*fp16", R="i32", K="i32", rows_per_amax="i32", **seeds)
    for four_six, sr in ((True, False), (False, False), (False, True)):  # the launches for K = 2048
        yield (f"nvfp4 4/6={four_six} sr={sr}", nv._nvfp4_kernel, nv_sig,
               dict(BLOCK_R=1 if four_six or sr else 2, BLOCK_K=2048, ROW_AMAX=True, FOUR_SIX=four_six,
                    STOCHASTIC=sr, EVEN=True, DECODED=0, SWIGLU=False, GATHER=False, CAST=tl.bfloat16), 4)
    for decoded in (1, 2, 3):  # serving: the GEMM's pre-decoded operand too (asm, bits, f32 decodes), K = 768
        yield (f"nvfp4 4/6 + decoded operand ({decoded})", nv._nvfp4_kernel, nv_sig,
               dict(BLOCK_R=2, BLOCK_K=1024, ROW_AMAX=True, FOUR_SIX=True, STOCHASTIC=False, EVEN=False,
                    DECODED=decoded, SWIGLU=decoded == 1, GATHER=False, CAST=tl.bfloat16), 4)  # asm: + SwiGLU
    yield ("nvfp4 4/6 + decoded operand, FP32 rows gathered and rounded to BF16", nv._nvfp4_kernel,
           dict(nv_sig, x_ptr="*fp32"), dict(BLOCK_R=1, BLOCK_K=2048, ROW_AMAX=True, FOUR_SIX=True, STOCHASTIC=False,
                                             EVEN=True, DECODED=1, SWIGLU=False, GATHER=True, CAST=tl.bfloat16), 4)
    from rl4bit.kernels import swiglu_triton as sw

    yield ("swiglu bf16", sw._swiglu_kernel, dict(h_ptr="*bf16", y_ptr="*bf16", R="i32", I="i32", s_h="i32"),
           dict(BLOCK_R=2, BLOCK_I=1024), 4)
    from rl4bit.kernels import qgemm_triton as qg
    from rl4bit.kernels import tile_map_triton as tm

    gemm_sig = dict(xd_ptr="*i32", xs_ptr="*u8", xh_ptr="*fp16", xo_ptr="*fp32", wd_ptr="*i32", ws_ptr="*u8",
                    wo_ptr="*fp32", y_ptr="*bf16", map_ptr="*i32", n_tiles="i32", N="i32", K="i32", KW="i32", KS="i32")
    for name, c in (("DECODE", qg.DECODE), ("TRAIN", qg.TRAIN),
                    ("w_first 16x64 2 warps", qg.Config(16, 64, 2, 3, True, block_k=256, w_first=True))):
        yield (f"nvfp4 grouped GEMM {name}", qg._nvfp4_grouped_kernel, gemm_sig,
               dict(BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k, DECODE=0, X_F16=c.predecode_x,
                    EVEN_N=True, EVEN_K=True, W_FIRST=c.w_first), c.num_warps)
    rows_sig = dict(x_ptr="*bf16", data_ptr="*u8", scale_ptr="*u8", flag_ptr="*i32", M="i32", K="i32", **seeds)
    for sr in (False, True):
        yield f"mxfp8 rows sr={sr}", mx._mxfp8_rows_kernel, rows_sig, dict(BLOCK_M=16, BLOCK_K=256, STOCHASTIC=sr), 4
    cols_sig = dict(src_ptr="*u8", src_scale_ptr="*u8", src_outer_ptr="*fp32", data_ptr="*u8", scale_ptr="*u8",
                    flag_ptr="*i32", M="i32", K="i32", **seeds)
    for sr in (False, True):
        yield (f"requantize sr={sr}", mx._mxfp8_cols_kernel, cols_sig,
               dict(BLOCK_M=32, BLOCK_K=256, SRC_NVFP4=True, STOCHASTIC=sr, EVEN=True), 4)
    float_cols = dict(cols_sig, src_ptr="*bf16", src_scale_ptr="*bf16", src_outer_ptr="*bf16")
    for sr in (False, True):
        yield (f"mxfp8 columnwise sr={sr}", mx._mxfp8_cols_kernel, float_cols,
               dict(BLOCK_M=32, BLOCK_K=256, SRC_NVFP4=False, STOCHASTIC=sr, EVEN=False), 4)
    enc_sig = dict(x_ptr="*bf16", data_ptr="*i8", scale_ptr="*u8", flag_ptr="*i32", R="i32", K="i32", **seeds)
    yield "rht + s2f6 encode", s2._s2f6_quant_kernel, enc_sig, dict(BLOCK_R=4, BLOCK_K=1024, HAS_RHT=True), 4
    from rl4bit.kernels import invariant_triton as inv

    mm_sig = dict(a_ptr="*bf16", b_ptr="*bf16", c_ptr="*bf16", bias_ptr="*bf16", M="i32", N="i32", K="i32",
                  **{s: "i32" for s in ("s_ab", "s_am", "s_ak", "s_bb", "s_bk", "s_bn", "s_cb", "s_cm", "s_cn",
                                        "s_bias_m", "s_bias_n")}, alpha="fp32", beta="fp32")
    bf16_tiles = inv.tiles(2048, 2048, torch.bfloat16)
    blocks = dict(BLOCK_M=bf16_tiles.block_m, BLOCK_N=bf16_tiles.block_n, BLOCK_K=bf16_tiles.block_k)
    # the mode's layouts as a launch specializes them (an integer argument equal to 1 becomes that constant; one
    # divisible by 16 is marked so, as `attrs` below does): F.linear's x [M, K] @ w.t() [K, N] (unit K strides),
    # alone and batched, and the weight gradient's g.t() [N_out, T] @ x [T, K] (a unit M stride, b unit N)
    fwd = dict(HAS_BIAS=False, SCALED=False, IEEE=False, UPCAST=False, s_ak=1, s_bk=1, s_cn=1, **blocks)
    yield "invariant bmm bf16, F.linear", inv._bmm_kernel, mm_sig, dict(fwd, BATCHED=False), bf16_tiles.warps
    yield "invariant bmm bf16, F.linear batched", inv._bmm_kernel, mm_sig, dict(fwd, BATCHED=True), bf16_tiles.warps
    yield ("invariant bmm bf16, weight gradient", inv._bmm_kernel, mm_sig,
           dict(HAS_BIAS=False, SCALED=False, IEEE=False, UPCAST=False, BATCHED=False, s_am=1, s_bn=1, s_cn=1,
                **blocks), bf16_tiles.warps)
    yield ("invariant bmm bf16, any strides, bias", inv._bmm_kernel, mm_sig,
           dict(HAS_BIAS=True, SCALED=True, IEEE=False, UPCAST=False, BATCHED=True, **blocks), bf16_tiles.warps)
    grouped_sig = dict(x_ptr="*bf16", w_ptr="*bf16", y_ptr="*bf16", map_ptr="*i32", n_tiles="i32", N="i32", K="i32",
                       s_xm="i32", s_we="i32", s_wn="i32", s_ym="i32")
    yield ("invariant grouped bf16", inv._grouped_kernel, grouped_sig,
           dict(IEEE=False, UPCAST=False, **blocks), bf16_tiles.warps)
    yield ("invariant row mean", inv._row_mean_kernel, dict(x_ptr="*fp32", out_ptr="*fp32", C="i32", s_r="i32"),
           dict(BLOCK=1024), 4)
    from rl4bit.kernels import combine_triton as cb
    from rl4bit.kernels import qk_rope_triton as qr
    from rl4bit.kernels import rmsnorm_triton as rn
    from rl4bit.kernels import route_triton as rt

    # the norms of the residual stream (FP32 in the trainer) and of BF16 activations, and with the residual add
    # (HAS_R: a run-time argument) of a BF16 stream and of the trainer's FP32 stream taking BF16 sublayer outputs
    for x, r in (("bf16", "bf16"), ("fp32", "fp32"), ("bf16", "fp32")):
        yield (f"fused rmsnorm x {x}, residual/sum {r}", rn._rms_norm_kernel,
               dict(x_ptr=f"*{x}", r_ptr=f"*{r}", s_ptr=f"*{r}", w_ptr="*fp32", y_ptr="*fp32", C="i32", HAS_R="i32",
                    eps="fp32"), dict(ASM=True, BLOCK=1024), 4)

    rope_sig = dict(q_ptr="*bf16", k_ptr="*bf16", wq_ptr="*fp32", wk_ptr="*fp32", qo_ptr="*fp32", ko_ptr="*fp32",
                    cos_ptr="*fp32", sin_ptr="*fp32", rows_q="i32", rows_k="i32", hq="i32", hk="i32", s_qt="i32",
                    s_kt="i32", D="i32", eps_q="fp32", eps_k="fp32", v_ptr="*bf16", kc_ptr="*bf16", vc_ptr="*bf16",
                    slot_ptr="*i64", pos_ptr="*i64", s_vt="i32", s_cs="i32", s_ch="i32", s_cp="i32", n_cache="i32")
    yield ("fused qk-norm + rope", qr._qk_norm_rope_kernel, rope_sig,
           dict(HQ_DTYPE=tl.float32, HK_DTYPE=tl.float32, ASM=True, BLOCK=128), 4)
    for out in ("fp32", "bf16"):  # the trainer's FP32 stream, the bench's BF16 one (HAS_R: the residual add)
        comb_sig = dict(o_ptr="*bf16", w_ptr="*fp32", idx_ptr="*i64", inv_ptr="*i64", r_ptr=f"*{out}",
                        out_ptr=f"*{out}", H="i32", E="i32", HAS_R="i32")
        yield f"fused moe combine, {out} output", cb._combine_kernel, comb_sig, dict(K=4, K_PAD=4, BLOCK_H=1024), 4
    route_sig = dict(idx_ptr="*i64", order_ptr="*i64", tok_ptr="*i64", inv_ptr="*i64", counts_ptr="*i32",
                     offs_ptr="*i32", map_ptr="*i32", N="i32", E="i32", T="i32")
    yield "fused moe grouping", rt._route_kernel, route_sig, dict(K=4, BLOCK=1024, E_PAD=64, MAP_BLOCK_M=0,
                                                                   T_BLOCK=2), rt.route_warps(1024, 64)
    yield ("fused moe grouping + tile map", rt._route_kernel, route_sig,
           dict(K=4, BLOCK=4, E_PAD=64, MAP_BLOCK_M=16, T_BLOCK=8), rt.route_warps(4, 64))  # batch 1: 5 tiles
    yield ("fused moe grouping + tile map, 128 experts", rt._route_kernel, route_sig,
           dict(K=8, BLOCK=2048, E_PAD=256, MAP_BLOCK_M=16, T_BLOCK=64), rt.route_warps(2048, 256))  # 256 x top-8
    yield ("grouped GEMMs' tile map", tm._tile_map_kernel, dict(counts_ptr="*i32", map_ptr="*i32", E="i32", T="i32"),
           dict(BLOCK_M=128, E_PAD=128, T_BLOCK=64), 4)
    from rl4bit.kernels import attention_triton as at

    strides = ("s_qt", "s_qh", "s_kh", "s_kp", "s_vh", "s_vp", "s_ot", "s_oh")
    att_sig = dict(q_ptr="*fp32", k_ptr="*bf16", v_ptr="*bf16", o_ptr="*fp32", st_m_ptr="*fp32", st_l_ptr="*fp32",
                   st_a_ptr="*fp32", cnt_ptr="*i32", seq_ptr="*i64", tile_ptr="*i64", n_seqs="i32", n_tiles="i32",
                   split="i32", n_chunks="i32", **{s: "i32" for s in strides}, D="i32", scaling="fp32")
    yield ("fused attention (bf16 cache, fp32 q)", at._attention_kernel, att_sig,
           dict(G=4, C=tl.bfloat16, KV_IS_C=True, IEEE=False, UPCAST=False, BLOCK_M=16, BLOCK_N=64, BLOCK_D=128,
                CHUNK=at.KEY_CHUNK), 4)
    yield ("fused attention (fp32)", at._attention_kernel, dict(att_sig, k_ptr="*fp32", v_ptr="*fp32"),
           dict(G=2, C=tl.float32, KV_IS_C=True, IEEE=True, UPCAST=False, BLOCK_M=16, BLOCK_N=64, BLOCK_D=64,
                CHUNK=at.KEY_CHUNK), 4,
           {r"\bfma\."})  # an FP32 `tl.dot` is FMAs (as an FP32 GEMM is): no reference to match, only itself
    from rl4bit.kernels import router_triton as rr

    part_sig = dict(x_ptr="*bf16", w_ptr="*fp32", part_ptr="*fp32", T="i32", H="i32", E="i32", s_xt="i32",
                    s_we="i32")
    yield ("fused router partial sums (fp32, bf16 input)", rr._partial_kernel, part_sig,
           dict(C=tl.float32, X_IS_C=False, W_IS_C=True, BLOCK_T=1, BLOCK_E=32, BLOCK_K=128, CHUNK=128), 1)
    topk_sig = dict(part_ptr="*fp32", live_ptr="*i32", logit_ptr="*fp32", weight_ptr="*fp32", index_ptr="*i64",
                    T="i32", E="i32", n_chunks="i32")
    # the trainer's call (no mask: the partials' pointer stands in), the engine's op-by-op and graphed forwards
    for live, mask in ((False, "*fp32"), (True, "*i32"), (True, "*i64")):
        yield (f"fused router top-k (live mask {mask if live else None})", rr._topk_kernel,
               dict(topk_sig, live_ptr=mask), dict(TOP_K=4, NORMALIZE=True, C=tl.float32, ROWS=16, BLOCK_E=32,
                                                   K_PAD=4, LIVE=live), 4)
    from rl4bit.kernels import mxfp8_gemm_triton as mg

    mx_sig = dict(a_ptr="*u8", sa_ptr="*u8", b_ptr="*u8", sb_ptr="*u8", out_ptr="*fp32", map_ptr="*i32",
                  n_tiles="i32", NC="i32", KR="i32", KS="i32")
    yield ("mxfp8 grouped GEMM (dgrad), BF16 path", mg._mx_rows_kernel, mx_sig,
           dict(BLOCK_M=128, BLOCK_N=128, FP8=False, BK=64, INTERPRET=False, EVEN_N=True, EVEN_K=True), 4)
    yield ("mxfp8 grouped GEMM (dgrad), FP8 cores", mg._mx_rows_kernel, mx_sig,
           dict(BLOCK_M=128, BLOCK_N=64, FP8=True, BK=32, INTERPRET=False, EVEN_N=True, EVEN_K=True), 4)
    wg_sig = dict(a_ptr="*u8", sa_ptr="*u8", b_ptr="*u8", sb_ptr="*u8", out_ptr="*fp32", seg_ptr="*i32", P="i32",
                  Q="i32", RP="i32", RS="i32")
    wg = mg.WGRAD[False]  # the tile the trainer launches
    yield ("mxfp8 wgrad GEMM, BF16 path", mg._mx_wgrad_kernel, wg_sig,
           dict(BLOCK_M=wg.block_m, BLOCK_N=wg.block_n, FP8=False, BK=mg.BF16_BLOCK_K, INTERPRET=False), wg.num_warps)
    dec_sig = dict(data_ptr="*i8", scale_ptr="*u8", out_ptr="*fp32", R="i32", K="i32", **seeds)
    yield "s2f6 decode + inverse rht", s2._s2f6_dequant_kernel, dec_sig, dict(BLOCK_R=4, BLOCK_K=1024, HAS_RHT=True), 4


def split_handoff_problems(ptx: str) -> list[str]:
    """The split attention's chunk hand-off as CUTLASS's semaphore: the states' stores, a CTA barrier, one acq_rel
    atomic at GPU scope, a barrier (the result's broadcast) before any global load, and the merge's loads from
    L2. Problems found (empty: all there)."""
    at = ptx.find("atom.global.gpu.acq_rel.add")
    if at < 0:
        return ["no acq_rel GPU-scope atomic add (the chunk counter)"]
    before, after = ptx[:at], ptx[at:]
    problems = []
    if not re.search(r"@%?\w+\s*$", before):  # one thread counts for the program, not each of them
        problems.append("the counter's atomic is not predicated to one thread")
    if before.rfind("bar.sync") < before.rfind("st.global"):
        problems.append("no barrier between the states' stores and the counter's atomic")
    if not 0 <= after.find("bar.sync") < after.find("ld.global"):
        problems.append("a global load before the barrier that follows the counter's atomic")
    if len(re.findall(r"ld\.global\.cg\.", after)) < 3:
        problems.append("the merge's state loads are not .cg (L2)")
    return problems


def vector_load_problems(ptx: str) -> list[str]:
    """A GEMM's operands loaded as 16-byte `cp.async` copies into shared memory, none element by element (a
    2-byte `ld.global`: what an operand pointer of unknown alignment compiles to). Problems found (empty: none)."""
    problems = []
    if re.search(r"ld\.global[^;\s]*\.b16", ptx):
        problems.append("2-byte global loads (an operand's alignment unknown to the compiler)")
    if not re.search(r"cp\.async\.cg\.shared\.global[^;]*, (16|0x10),", ptx):
        problems.append("no 16-byte cp.async copies")
    return problems


PTX_CHECKS = {"_attention_kernel": split_handoff_problems, "invariant grouped bf16": vector_load_problems,
              **{f"invariant bmm bf16, {layout}": vector_load_problems
                 for layout in ("F.linear", "F.linear batched", "weight gradient")}}
"""Kernel or entry name -> a check of its PTX beyond the exact-FP32 patterns."""


def sass_stats(cubin: bytes, elems_per_thread: float) -> str:
    """'instr/elt=.. regs=.. top=[..]' for a cubin: static SASS count (no NOPs, no subroutines) / elements a thread."""
    import collections
    import tempfile

    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True).stdout
        res = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout
    lines = re.findall(r"^\s+/\*([0-9a-f]{4,6})\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)", sass, re.M)
    calls = [int(a, 16) for a in re.findall(r"CALL\.REL\.NOINC\s+(?:`\(\S+\)|0x)([0-9a-f]+)", sass)]
    ops = [op for addr, op in lines if op != "NOP" and (not calls or int(addr, 16) < min(calls))]
    top = collections.Counter(op.split(".")[0] for op in ops).most_common(5)
    regs = re.search(r"REG:(\d+)", res)
    return f"instr/elt={len(ops) / elems_per_thread:.1f} regs={regs.group(1) if regs else '?'} top={top}"


def compile_all(count: bool = False) -> list[str]:
    """Compile every kernel for sm_90; return one problem line per bad kernel (empty = all good)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    problems = []
    for name, fn, sig, consts, warps, *allowed in _kernels():  # allowed: PTX patterns a kernel may hold
        full = dict(sig, **{k: "constexpr" for k in consts})
        # real launches specialize pointers, K/M and strides (multiples of 16) as 16-divisible
        attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(fn.arg_names)
                 if (a.endswith("_ptr") or a in ("K", "M", "N", "KW", "KS", "KR", "NC", "RP", "RS")
                     or a.startswith("s_"))
                 and a not in consts
                 and a not in (fn.do_not_specialize or ())}
        src = ASTSource(fn=fn, signature=full, constexprs=consts, attrs=attrs)
        k = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                           options={"num_warps": warps, "enable_fp_fusion": False})
        ptx = k.asm["ptx"]
        bad = [p for p in (r"\bfma\.", r"div\.(full|approx)", r"\.ftz") if re.search(p, ptx)
               and p not in (allowed[0] if allowed else ())]
        bad += PTX_CHECKS.get(name, PTX_CHECKS.get(fn.__name__, lambda _: []))(ptx)
        print(f"{name}: {len(ptx.splitlines())} PTX lines" + (f", found {bad}" if bad else ""))
        if count:
            rows = consts.get("BLOCK_R", consts.get("BLOCK_M", 1))
            tile_k = ("BLOCK_K", "BK", "BLOCK_I", "BLOCK", "BLOCK_D", "BLOCK_H", "BLOCK_E")
            cols = next((consts[c] for c in tile_k if c in consts), 1)
            print(f"    {sass_stats(k.asm['cubin'], rows * cols / (32 * warps))}")
        if bad:
            problems.append(f"{name}: PTX contains {bad}")
    return problems


def test_split_handoff_check_finds_each_missing_piece():
    """`split_handoff_problems` on hand-written PTX: the CUTLASS order passes; each piece taken out is named."""
    good = ("st.global.v4.b32 [a], {r};\nbar.sync 0;\n@%p1 atom.global.gpu.acq_rel.add.u32 r, [c], 1;\n"
            "st.shared.b32 [s], r;\nbar.sync 0;\n" + "ld.global.cg.b32 {x}, [m];\n" * 3)
    assert split_handoff_problems(good) == []
    assert split_handoff_problems(good.replace("acq_rel", "relaxed")) == [
        "no acq_rel GPU-scope atomic add (the chunk counter)"]
    assert split_handoff_problems(good.replace("bar.sync 0;\n@%p1", "@%p1")) == [
        "no barrier between the states' stores and the counter's atomic"]
    assert split_handoff_problems(good.replace("st.shared.b32 [s], r;\nbar.sync 0;\n", "")) == [
        "a global load before the barrier that follows the counter's atomic"]
    assert split_handoff_problems(good.replace(".cg", "")) == ["the merge's state loads are not .cg (L2)"]
    assert split_handoff_problems(good.replace("@%p1 atom", "atom")) == [
        "the counter's atomic is not predicated to one thread"]


def test_vector_load_check_finds_element_loads_and_missing_copies():
    """`vector_load_problems` on hand-written PTX: 16-byte copies pass; a 2-byte global load (also with cache
    qualifiers) or no 16-byte copy is named."""
    good = "cp.async.cg.shared.global [ %r1 + 0 ], [ %rd1 + 0 ], 0x10, %r2;\nwgmma.mma_async.sync.aligned;\n"
    assert vector_load_problems(good) == []
    assert vector_load_problems(good.replace("0x10", "0x4")) == ["no 16-byte cp.async copies"]
    for load in ("ld.global.b16 %rs1, [%rd2];", "ld.global.L1::evict_last.b16 %rs1, [%rd2];"):
        assert vector_load_problems(good + load) == [
            "2-byte global loads (an operand's alignment unknown to the compiler)"], load


@pytest.mark.slow
def test_kernels_compile_for_sm90_with_exact_fp32():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, f"sm_90 compile failed:\n{r.stdout[-3000:]}\n{r.stderr[-6000:]}"


if __name__ == "__main__":
    found = compile_all(count="--count" in sys.argv)
    print("\n".join(found) or "all kernels compile for sm_90 with exact fp32 ops")
    sys.exit(1 if found else 0)
