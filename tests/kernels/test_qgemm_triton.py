"""Triton quantized GEMMs (kernels/qgemm_triton.py, kernels/mxfp8_gemm_triton.py) against the exact product.

What is checked:
- NVFP4 grouped forward and MXFP8 dgrad/wgrad (both paths: FP8 cores, BF16
  dequantize) equal the float64 product of the dequantized operands within
  the FP32 summation bound |y - exact| <= TOL * K * 2**-24 * (|A| @ |B|ᵀ)
  (FP8 cores: 2**-10 * (|A| @ |B|ᵀ); a wrong scale, nibble or row misses either by far);
  also against trainer.qgemm's own CPU reference.
- Batch invariance, bitwise: row i is identical whether the call has 1, 3,
  17 or 64 rows (and more on the GPU, crossing the DECODE/TRAIN configs),
  and whatever rows the other experts hold (empty experts included).
- The tile map covers each row exactly once; counts as a tensor = as a list.
- deferred_checks(): no flag read inside the block, one ValueError at exit.
On CPU everything runs under TRITON_INTERPRET=1 on tiny shapes; the ``gpu``
tests use real shapes (K=4096/N=14336 decode, Qwen3-30B-A3B experts),
compare the configs and both decode paths bitwise, run the trainer's
autograd against RL4BIT_KERNELS=reference, and capture a CUDA graph.
"""

from __future__ import annotations

from triton_setup import DEVICE, HAS_CUDA  # first: sets TRITON_INTERPRET on CPU

# isort: split

import pytest
import torch
import triton
import triton.language as tl
from bitwise import assert_bitwise_equal

from rl4bit.kernels import QTensor, dequantize, quantize
from rl4bit.kernels import mxfp8_gemm_triton as mg
from rl4bit.kernels import qgemm_triton as qg
from rl4bit.kernels import tile_map_triton as tm
from rl4bit.kernels import triton_dispatch as td
from rl4bit.trainer import qgemm

TOL = {"nvfp4": 2.0, "mxfp8_bf16": 2.0, "mxfp8_fp8": 2.0**-10}
"""Allowed |y - exact| / (|A| @ |B|ᵀ): TOL * K * 2**-24 for FP32 sums of exact products (nvfp4, mxfp8 via
BF16); a flat 2**-10 for the FP8 cores, which add each 32-block's products in a narrower accumulator
(about 13 bits kept on Hopper) before the FP32 sum."""

gpu = pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")


def _unscaled(q):
    return dequantize(qgemm.dataclasses.replace(q, outer=torch.ones_like(q.outer)), torch.float64)


def _exact_grouped(a, b, counts, row_scale=None, group_scale=None):
    """float64 product and |A| @ |B|ᵀ of dequantized operands a [R, K], b [E, N, K], grouped by counts."""
    y = a.new_zeros(a.shape[0], b.shape[1])
    mag = torch.zeros_like(y)
    start = 0
    for e, m in enumerate(counts):
        seg = slice(start, start + m)
        y[seg] = a[seg] @ b[e].t()
        mag[seg] = a[seg].abs() @ b[e].abs().t()
        if group_scale is not None:
            y[seg], mag[seg] = y[seg] * group_scale[e], mag[seg] * abs(group_scale[e])
        start += m
    if row_scale is not None:
        y, mag = y * row_scale, mag * row_scale.abs()
    return y, mag


def _assert_close(got, exact, mag, k, tol, what):
    err = (got.double() - exact).abs()
    bound = (tol if tol < 1 else tol * k * 2.0**-24) * mag + 1e-300
    bad = err > bound
    assert not bool(bad.any()), (f"{what}: {int(bad.sum())} of {bad.numel()} outputs beyond the bound, worst "
                                 f"err/bound {float((err / bound).max()):.3g} "
                                 f"at {tuple(torch.nonzero(bad)[0].tolist())}")


def _nvfp4_operands(rows, k, n, experts, seed):
    g = torch.Generator().manual_seed(seed)
    row_scale = torch.exp2(torch.randint(-6, 7, (rows, 1), generator=g).float())
    x = (torch.randn(rows, k, generator=g) * row_scale).to(DEVICE)
    w = (torch.randn(experts, n, k, generator=g) * 0.05).to(DEVICE)
    w[0, :, :16] = 0.0  # all-zero blocks: scale code 0
    return quantize(x, "nvfp4", outer="row", four_over_six=True), quantize(w, "nvfp4", outer="group")


def _check_nvfp4(qx, qw, counts, y, what):
    exact, mag = _exact_grouped(_unscaled(qx), _unscaled(qw), counts,
                                qx.outer.reshape(-1, 1).double(), qw.outer.reshape(-1).double())
    _assert_close(y, exact, mag, qx.shape[1], TOL["nvfp4"], what)


# ---------------------------------------------------------------- NVFP4 forward, CPU interpreter


@pytest.mark.parametrize("f32_decode", [False, True])
def test_nvfp4_grouped_matches_exact_product(f32_decode):
    """Bit-trick and FP32 decodes, x pre-decoded (DECODE) or decoded in the GEMM, partial K and N tiles."""
    counts = [9, 0, 21, 7]  # an empty expert; K = 80 leaves a partial K tile, N = 40 a partial N tile
    qx, qw = _nvfp4_operands(sum(counts), 80, 40, len(counts), seed=1)
    for cfg in (qg.DECODE, qg.Config(block_m=16, block_n=32, num_warps=1, num_stages=1),
                qg.Config(block_m=32, block_n=16, num_warps=4, num_stages=1),
                qg.Config(16, 32, 2, 3, True, block_k=64, w_first=True)):
        y = qg.grouped_nvfp4(qx, qw, counts, torch.float32, config=cfg, decode="f32" if f32_decode else "bits")
        _check_nvfp4(qx, qw, counts, y, f"nvfp4 {cfg} f32_decode={f32_decode}")


def test_w_first_product_equals_x_first_bitwise():
    """The W-first product (decoded weights as the MMA's A operand, the accumulator transposed in the epilogue)
    gives the x-first one's bits: with a 16-wide K step each dot is one 16-block (exact products, exact sum) added
    to the accumulator once, under the interpreter too; partial K and N tiles, an empty expert, x pre-decoded or
    not. On the GPU `test_gpu_configs_and_decodes_bitwise_equal` checks the 64- and 256-wide steps; compiled kernels
    refuse 16 (the two forms disagreed there on an H100: `qgemm_triton.MIN_COMPILED_BLOCK_K`)."""
    counts = [9, 0, 21, 7]
    qx, qw = _nvfp4_operands(sum(counts), 80, 40, len(counts), seed=3)
    if not qg.interpret():
        with pytest.raises(ValueError, match="block_k=16"):
            qg.grouped_nvfp4(qx, qw, counts, torch.float32, config=qg.Config(16, 32, 2, 1, True, block_k=16))
        return
    for pre in (True, False):
        want = qg.grouped_nvfp4(qx, qw, counts, torch.float32, config=qg.Config(16, 32, 2, 1, pre, block_k=16),
                                decode="bits")
        got = qg.grouped_nvfp4(qx, qw, counts, torch.float32,
                               config=qg.Config(16, 32, 2, 1, pre, block_k=16, w_first=True), decode="bits")
        assert_bitwise_equal(got, want, f"w_first predecode_x={pre}")


def test_k_step_not_a_multiple_of_16_is_refused():
    qx, qw = _nvfp4_operands(8, 64, 32, 2, seed=4)
    with pytest.raises(ValueError, match="block_k=24"):
        qg.grouped_nvfp4(qx, qw, [5, 3], torch.float32, config=qg.Config(16, 32, 1, 1, block_k=24))


def _huge(fmt, shape, data_dtype, scale_dtype, per_byte, block):
    """A QTensor of logical `shape` whose fields are zero-stride views (nothing of its size allocated): enough for
    a launcher's shape checks, which run before anything reads the data."""
    lead, k = shape[:-1], shape[-1]
    data = torch.zeros((*lead, 1), dtype=torch.uint8).view(data_dtype).expand(*lead, k // per_byte)
    scale = torch.zeros((*lead, 1), dtype=torch.uint8).view(scale_dtype).expand(*lead, k // block)
    return QTensor(data, scale, torch.ones([1] * len(shape)), fmt, torch.Size(shape))


def test_int32_tile_offsets_are_guarded_in_every_launcher():
    """The grouped kernels address a tile as a 64-bit pointer at its first row plus int32 offsets within the tile
    (`tm.check_tile_offsets`): the bound is exact, and each launcher refuses rows too long for it with a
    ValueError naming the dimension, before any launch."""
    tm.check_tile_offsets("ok", 128, 2**24 - 129, 128)  # 128 * (2**24 - 1) < 2**31
    with pytest.raises(ValueError, match="int32 offsets"):
        tm.check_tile_offsets("too long", 128, 2**24 - 128, 128)
    k = 2**24  # TRAIN's 128-row tiles: 128 * (2**24 + 128) >= 2**31
    qx = _huge("nvfp4", (1, k), torch.uint8, torch.float8_e4m3fn, 2, 16)
    qw = _huge("nvfp4", (1, 16, k), torch.uint8, torch.float8_e4m3fn, 2, 16)
    with pytest.raises(ValueError, match="grouped_nvfp4: K"):
        qg.grouped_nvfp4(qx, qw, [1], torch.float32, config=qg.TRAIN)
    qa = _huge("mxfp8", (1, k), torch.float8_e4m3fn, torch.float8_e8m0fnu, 1, 32)
    qb = _huge("mxfp8", (1, 16, k), torch.float8_e4m3fn, torch.float8_e8m0fnu, 1, 32)
    with pytest.raises(ValueError, match="grouped_mxfp8: the reduction dimension"):
        mg.grouped_mxfp8(qa, qb, [1], config=mg.MX_TRAIN[False])
    qa, qb = _huge("mxfp8", (16, k), torch.float8_e4m3fn, torch.float8_e8m0fnu, 1, 32), qa
    with pytest.raises(ValueError, match="wgrad_mxfp8: the padded rows"):
        mg.wgrad_mxfp8(qa, qb, [k])


def test_nvfp4_matches_trainer_reference_and_dtype(monkeypatch):
    counts = [5, 12, 0]
    qx, qw = _nvfp4_operands(sum(counts), 64, 48, 3, seed=2)
    monkeypatch.setenv("RL4BIT_KERNELS", "reference")  # grouped_forward = the plain-PyTorch reference
    ref = qgemm.grouped_forward(qx, qw, counts, torch.float32).double()
    monkeypatch.delenv("RL4BIT_KERNELS")
    y32 = qg.grouped_nvfp4(qx, qw, counts, torch.float32)
    _, mag = _exact_grouped(_unscaled(qx), _unscaled(qw), counts,
                            qx.outer.reshape(-1, 1).double(), qw.outer.reshape(-1).double())
    _assert_close(y32, ref, 2 * mag, 64, TOL["nvfp4"], "vs trainer.qgemm reference")
    y16 = qg.grouped_nvfp4(qx, qw, counts, torch.bfloat16)
    assert y16.dtype == torch.bfloat16
    assert_bitwise_equal(y16, y32.to(torch.bfloat16), "bf16 output = fp32 accumulator rounded once")


def test_counts_tensor_equals_list():
    counts = [3, 0, 6]
    qx, qw = _nvfp4_operands(9, 32, 16, 3, seed=3)
    a = qg.grouped_nvfp4(qx, qw, counts, torch.float32)
    b = qg.grouped_nvfp4(qx, qw, torch.tensor(counts, device=DEVICE), torch.float32)
    assert_bitwise_equal(a, b, "counts as tensor")


def _activations(rows, k, seed):
    """x with row scales spread over 2**-6..2**6, zero and tiny blocks (negative-zero codes, scale code 0)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=g) * torch.exp2(torch.randint(-6, 7, (rows, 1), generator=g).float())
    x[0, :16] = 0.0
    x[1 % rows, 16:32] = -1e-30
    return x.to(DEVICE)


@pytest.mark.parametrize("k", [48, 96])  # 96: the quantize tile (128) ends on a partial block of columns
@pytest.mark.parametrize("four_over_six", [True, False])
def test_quantize_with_decoded_operand_equals_quantize_then_predecode(k, four_over_six):
    """`quantize_and_multiply`: the quantize kernel's decoded x = the pre-decode kernel's, bitwise (both decodes);
    its QTensor = `quantize`'s; y = quantize + `grouped_nvfp4`'s, with one tile map for two GEMMs."""
    from rl4bit.kernels import nvfp4_triton

    counts = [3, 0, 6, 2]
    x = _activations(sum(counts), k, seed=40)
    _, qw = _nvfp4_operands(4, k, 24, len(counts), seed=41)
    q = quantize(x, "nvfp4", outer="row", four_over_six=four_over_six)
    for decode in ("bits", "f32"):
        xh = torch.empty(x.shape, dtype=torch.float16, device=DEVICE)
        data, scale, outer, _ = nvfp4_triton.quantize_nvfp4(x, outer="row", four_over_six=four_over_six, decoded=xh,
                                                            decode=decode)
        assert_bitwise_equal(data, q.data, "codes")
        assert_bitwise_equal(scale, q.scale.view(torch.uint8), "scales")
        want = torch.empty_like(xh)
        qg._predecode_kernel[(triton_cdiv(x.shape[0], 16), triton_cdiv(k, qg.BLOCK_K))](
            qg._words(q.data), q.scale.view(torch.uint8), want, x.shape[0], k, BLOCK_R=16, BLOCK_K=qg.BLOCK_K,
            DECODE=qg.DECODES[decode], num_warps=1)
        assert_bitwise_equal(xh, want, f"decoded operand, decode={decode}")
        maps, routing = {}, torch.tensor(counts, device=DEVICE)
        for n_call in range(2):  # the second call reuses the first one's tile map
            qx, y = qg.quantize_and_multiply(x, qw, routing, torch.float32,
                                             four_over_six=four_over_six, config=qg.DECODE, decode=decode, maps=maps)
            assert len(maps) == 2  # the counts and one map
            assert_bitwise_equal(qx.data, q.data, "quantize_and_multiply's codes")
            ref = qg.grouped_nvfp4(q, qw, counts, torch.float32, config=qg.DECODE, decode=decode)
            assert_bitwise_equal(y, ref, f"quantize_and_multiply, decode={decode}, call {n_call}")


@pytest.mark.parametrize("cast", [torch.bfloat16, None])
@pytest.mark.parametrize("k", [48, 96])
def test_quantize_and_multiply_gathers_and_casts_rows_in_place(cast, k):
    """rows=, cast=: the product of x[rows].to(cast) with the rows read in place by the quantize kernel equals
    the gather, the cast, then `quantize_and_multiply`, bitwise: codes, scales, outer, decoded operand, y (FP32
    x with values between BF16 neighbours, exact ties among them; rows unsorted and repeated, as top-k picks)."""
    counts = [3, 0, 6, 2]
    src = _activations(7, k, seed=45)
    ulp = torch.tensor(2.0**-8, device=DEVICE)  # BF16 keeps 8 significant bits: add half and quarter ulps
    src[2] = torch.round(src[2] * 256) / 256 * (1 + ulp / 2)  # ties: round to even
    src[3] = src[3] * (1 + ulp / 4)
    rows = torch.tensor([4, 0, 6, 2, 2, 5, 1, 3, 0, 6, 3], device=DEVICE)
    _, qw = _nvfp4_operands(4, k, 24, len(counts), seed=46)
    xr = src[rows].to(cast or src.dtype)
    if cast is not None:
        assert not torch.equal(xr.float(), src[rows]), "the cast must round some values for the test to bite"
    want_q, want_y = qg.quantize_and_multiply(xr, qw, counts, torch.float32, config=qg.DECODE)
    got_q, got_y = qg.quantize_and_multiply(src, qw, counts, torch.float32, config=qg.DECODE, rows=rows, cast=cast)
    for name in ("data", "scale", "outer"):
        assert_bitwise_equal(getattr(got_q, name), getattr(want_q, name), f"qx.{name}")
    assert got_q.shape == want_q.shape
    assert_bitwise_equal(got_y, want_y, "y of the rows read in place")
    served = qgemm.served_product(src, qw, counts, qgemm.GemmSpec(fmt="nvfp4", four_over_six=True), torch.float32,
                                  rows=rows, cast=cast)  # CPU: the reference path's own gather and cast
    assert_bitwise_equal(served, qgemm.grouped_forward(quantize(xr, "nvfp4", outer="row", four_over_six=True), qw,
                                                       counts, torch.float32), "served_product, reference path")


def test_quantize_rows_rejects_bad_index_and_names_overflow():
    """rows= needs a 1-D int index and outer='row'; a finite FP32 row that overflows BF16 in the cast is named
    as such (the unfused path would see the Inf the cast makes)."""
    from rl4bit.kernels import nvfp4_triton
    from rl4bit.kernels.checks import NonFiniteInputError

    x = _activations(4, 32, seed=47)
    with pytest.raises(ValueError, match="rows="):
        nvfp4_triton.quantize_nvfp4(x, outer="row", rows=torch.tensor([[0]], device=DEVICE))
    with pytest.raises(ValueError, match="outer='row'"):
        nvfp4_triton.quantize_nvfp4(x, outer="tensor", rows=torch.tensor([0], device=DEVICE))
    x[3, 5] = 3.4e38  # finite in FP32, Inf in BF16 (past its largest value 3.39e38 by more than half an ulp)
    got = td.quantize_nvfp4_rows(x, four_over_six=True, rows=torch.tensor([0, 1], device=DEVICE),
                                 cast=torch.bfloat16)
    assert got is not None  # row 3 is not read
    with pytest.raises(NonFiniteInputError, match=r"1 value\(s\) of the rows \(2, 32\) overflow torch.bfloat16 .* "
                                                  r"first at index \(1, 5\)"):
        td.quantize_nvfp4_rows(x, four_over_six=True, rows=torch.tensor([0, 3], device=DEVICE), cast=torch.bfloat16)
    x[2, 0] = float("nan")
    with pytest.raises(NonFiniteInputError, match="NaN"):
        td.quantize_nvfp4_rows(x, four_over_six=True, rows=torch.tensor([2], device=DEVICE))


def _simulate_decode_ptx(word: int, scale_bits: int) -> list[int]:
    """The FP16 bit patterns $0..$7 of `qgemm_triton._DECODE_ASM` for one word and one FP16 scale: the inline PTX
    run by a small interpreter of the instructions it uses (shl/shr/and/or .b32, mul.rn.f16x2, mov.b32 packs)."""
    import re

    import numpy as np

    regs = {"$8": word & 0xFFFFFFFF, "$9": scale_bits}
    out = {}

    def val(tok):
        return int(tok, 16) if tok.startswith("0x") else (int(tok) if tok.isdigit() else regs[tok])

    for ins in qg._DECODE_ASM.value.replace("{\n", "").split(";"):
        ins = ins.strip().strip("{}").strip()
        if not ins or ins.startswith(".reg"):
            continue
        op, args = ins.split(None, 1)
        if op == "mov.b32" and args.startswith("s2"):  # s2 = {$9, $9}
            h = regs["$9"]
            regs["s2"] = h | (h << 16)
            continue
        if op == "mov.b32":  # {$lo, $hi}, x
            lo, hi, src = re.match(r"\{(\$\d+), (\$\d+)\}, (\w+)", args).groups()
            out[lo], out[hi] = regs[src] & 0xFFFF, regs[src] >> 16
            continue
        d, a, b = [t.strip() for t in args.split(",")]
        x, y = val(a), val(b)
        if op == "shl.b32":
            regs[d] = (x << y) & 0xFFFFFFFF
        elif op == "shr.u32":
            regs[d] = x >> y
        elif op == "and.b32":
            regs[d] = x & y
        elif op == "or.b32":
            regs[d] = x | y
        elif op == "mul.rn.f16x2":  # two FP16 products, each rounded to nearest (exact in FP32 first)
            halves = []
            for sh in (0, 16):
                p = np.array([(x >> sh) & 0xFFFF, (y >> sh) & 0xFFFF], dtype=np.uint16).view(np.float16)
                halves.append(int(np.float16(np.float32(p[0]) * np.float32(p[1])).view(np.uint16)))
            regs[d] = halves[0] | (halves[1] << 16)
        else:
            raise AssertionError(f"the simulator does not know {op!r}: extend it")
    return [out[f"${i}"] for i in range(8)]


def test_decode_ptx_simulated_gives_each_code_where_decode_tile_names_it():
    """CPU check of the GPU-only "asm" decode: simulated, output $j is code c(j) x scale x 2**-14 (FP16) for the
    c(j) that `_decode_tile`'s unpacking names it (e0, e4, e1, ...), and those values are the "bits" decode's."""
    import inspect
    import re

    import numpy as np

    source = inspect.getsource(qg)  # the module's text (under the interpreter the jit functions are wrapped)
    names = re.search(r"((?:e\d, ){7}e\d) = tl\.inline_asm_elementwise", source).group(1)
    code_of_output = [int(n.strip()[1:]) for n in names.split(",")]
    assert sorted(code_of_output) == list(range(8))
    g = torch.Generator().manual_seed(47)
    words = torch.randint(0, 2**32, (64,), generator=g, dtype=torch.int64).tolist() + [0x88888888, 0x77777777]
    e2m1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    for i, word in enumerate(words):
        s_code = [0, 1, 7, 8, 56, 126][i % 6]  # E4M3 codes: zero, subnormals, normals, the largest
        sv = np.float16(np.array([s_code << 7], dtype=np.int16).view(np.float16)[0] * np.float16(256.0))
        got = _simulate_decode_ptx(word, int(np.array([sv], dtype=np.float16).view(np.uint16)[0]))
        for j, bits in enumerate(got):
            c = (word >> (4 * code_of_output[j])) & 15
            want = np.float16((-1.0 if c & 8 else 1.0) * e2m1[c & 7] * float(sv) * 2.0**-14)
            if c == 8 or (c & 7 == 0 and c & 8):  # -0 x scale: the bit trick keeps the sign
                want = np.float16(-0.0) if float(sv) > 0 else want
            assert bits == int(np.array([want], dtype=np.float16).view(np.uint16)[0]), (hex(word), s_code, j)


def test_maps_belong_to_one_routing():
    """A `maps` dict shares tile maps between GEMMs of the same counts and refuses other counts."""
    counts = torch.tensor([8, 0], device=DEVICE)
    qx, qw = _nvfp4_operands(8, 32, 16, 2, seed=46)
    maps = {}
    a = qg.grouped_nvfp4(qx, qw, counts, torch.float32, maps=maps)
    assert_bitwise_equal(qg.grouped_nvfp4(qx, qw, counts, torch.float32, maps=maps), a, "shared map")
    with pytest.raises(ValueError, match="one dict per routing"):
        qg.grouped_nvfp4(qx, qw, torch.tensor([0, 8], device=DEVICE), torch.float32, maps=maps)
    lists = {}
    qg.grouped_nvfp4(qx, qw, [8, 0], torch.float32, maps=lists)
    qg.grouped_nvfp4(qx, qw, [8, 0], torch.float32, maps=lists)  # an equal list is the same routing
    with pytest.raises(ValueError, match="one dict per routing"):
        qg.grouped_nvfp4(qx, qw, [0, 8], torch.float32, maps=lists)


def test_decodes_share_one_k_order():
    """The bit-trick decode (Triton ops) and the plain FP32 decode lay codes out in the same K order
    (0, 4, 1, 5, 2, 6, 3, 7 within each word) and differ by exactly 2**-14 (the PTX decode is built the same way:
    `_pairs_in_k_order`; GPU-checked by the configs test)."""
    q = quantize(_activations(5, 64, seed=45), "nvfp4", outer="row", four_over_six=True)
    out = {}
    for decode in ("bits", "f32"):
        out[decode] = torch.empty((5, 64), dtype=torch.float16, device=DEVICE)
        qg._predecode_kernel[(1, 1)](qg._words(q.data), q.scale.view(torch.uint8), out[decode], 5, 64, BLOCK_R=16,
                                     BLOCK_K=qg.BLOCK_K, DECODE=qg.DECODES[decode], num_warps=1)
    assert_bitwise_equal(out["bits"].float() * 2.0**14, out["f32"].float(), "bits x 2**14 vs f32")
    codes = torch.stack([(q.data >> 0) & 15, (q.data >> 4) & 15], dim=-1).reshape(5, 64)  # code k at column k
    perm = torch.tensor([0, 4, 1, 5, 2, 6, 3, 7]).repeat(8) + torch.arange(64) // 8 * 8
    nonzero = codes[:, perm.to(codes.device)] % 8 != 0
    assert torch.equal(out["f32"] != 0, nonzero), "the decoded values sit where the K order puts their codes"


def triton_cdiv(a, b):
    return -(-a // b)


def test_pick_config_routes_by_rows_per_expert_and_grid():
    assert qg.pick_config(1) is qg.DECODE and qg.pick_config(64) is qg.DECODE  # without n: DECODE
    assert qg.pick_config(65) is qg.TRAIN
    assert qg.pick_config(1024, 16, 1536) is qg.MID  # batched MoE decode: 256 tokens x top-4 over 16 experts
    assert qg.pick_config(1025, 16, 1536) is qg.TRAIN and qg.pick_config(1024, 1, 1536) is qg.TRAIN
    assert qg.pick_config(32768, 128, 1536) is qg.TRAIN  # a training micro-batch
    # DECODE while the call has at most SMALL_GRID programs (a batch-1 MoE step: four experts x 32 column tiles),
    # DECODE_WIDE past it, whatever K
    assert qg.decode_programs(4, 32, 2048) == 128 and qg.decode_programs(64, 32, 2048) == 1024
    assert qg.pick_config(4, 32, 2048) is qg.DECODE
    assert qg.pick_config(64, 32, 2048) is qg.DECODE  # batch 16 (1024 programs)
    assert qg.pick_config(65, 33, 2048) is qg.DECODE_WIDE  # 33 x 32 programs
    assert qg.pick_config(128, 128, 2048) is qg.DECODE_WIDE  # Qwen3-30B-A3B down, 16 tokens (87 experts hold rows)
    assert qg.pick_config(128, 128, 1536) is qg.DECODE_WIDE  # its gate_up
    assert qg.pick_config(16, 1, 14336) is qg.DECODE  # the dense decode shape: 224 programs
    assert qg.pick_config(1, 1, 64 * (qg.SMALL_GRID + 1)) is qg.DECODE_WIDE
    assert qg.pick_config(1, 1, 64 * qg.SMALL_GRID) is qg.DECODE


@pytest.mark.parametrize("block_m", [16, 128])
@pytest.mark.parametrize("counts", [[0, 5, 16, 0, 33, 1, 0, 200],
                                    [1] * 8 + [0] * 24,  # few rows over many experts: min(E, R) row tiles, not E
                                    [17] * 8,  # every expert one row past a whole tile: two tiles each
                                    [129] * 3,  # one row past whole tiles at block_m 128 too
                                    [5],  # a dense call: one row tile, none dead
                                    [40],
                                    [0, 0, 1, 0],
                                    [1000, 0, 3, 500, 7],  # over 64 tiles: the device map in several programs
                                    [2000] + [0] * 6])  # every row one expert's: its tiles split over programs
def test_tile_map_covers_each_row_once(block_m, counts):
    rows = sum(counts)
    cmap = tm.tile_map(counts, rows, block_m, DEVICE)
    assert cmap.shape == (3, -(-rows // block_m) + min(len(counts), rows) - 1)
    live = sum(-(-c // block_m) for c in counts)
    assert live <= cmap.shape[1]
    if len(counts) == 1 or (len(counts) <= block_m and all(c % block_m == 1 for c in counts)):  # tight: a dense
        # call, or at most block_m experts each one row past whole tiles
        assert live == cmap.shape[1], (live, cmap.shape)
    on_device = tm.tile_map(torch.tensor(counts, dtype=torch.int32, device=DEVICE), rows, block_m)
    assert_bitwise_equal(on_device, cmap, "tile map: device kernel vs host")
    seen = torch.zeros(rows, dtype=torch.int64)
    start = [sum(counts[:e]) for e in range(len(counts))]
    for e, r0, r1 in cmap.t().tolist():
        if e < 0:
            continue
        assert start[e] <= r0 < r1 == start[e] + counts[e], (e, r0, r1)
        seen[r0:min(r0 + block_m, r1)] += 1
    assert bool((seen == 1).all()), seen


@triton.jit
def _launch_order_kernel(map_ptr, out_ptr, n_tiles, N, BLOCK_N: tl.constexpr):
    t, c = tm.tile_first(N, BLOCK_N)
    e, _, _ = tm.map_entry(map_ptr, n_tiles, t)
    p = out_ptr + tl.program_id(0) * 3
    tl.store(p, t)
    tl.store(p + 1, c)
    tl.store(p + 2, e)


def test_grouped_grid_starts_every_live_tile_before_any_dead_one():
    """The grouped GEMMs' one-dimensional grid (`tile_first`): each (row tile, column tile) pair once, and every
    program of a live tile (an expert's) ahead of every dead one, the order the GPU starts them in (a decode
    step's grid is mostly dead tiles: twentieth session)."""
    counts, block_n, n = [3, 0, 17, 1, 0], 16, 40  # n not a multiple of block_n: 3 column tiles
    cmap = tm.tile_map(counts, 64, 16, DEVICE)  # a grid bound for 64 rows: 4 + 5 - 1 row tiles, 4 live
    n_tiles, n_cols = cmap.shape[1], -(-n // block_n)
    out = torch.full((n_tiles * n_cols, 3), -2, dtype=torch.int32, device=DEVICE)
    _launch_order_kernel[(n_tiles * n_cols,)](cmap, out, n_tiles, n, BLOCK_N=block_n)
    got = [tuple(r) for r in out.tolist()]
    assert sorted((t, c) for t, c, _ in got) == [(t, c) for t in range(n_tiles) for c in range(n_cols)]
    live = [e >= 0 for _, _, e in got]
    assert sum(live) == 4 * n_cols and live == sorted(live, reverse=True), live


def test_nvfp4_batch_invariance():
    """Row i of a 1-, 3-, 17- or 64-row call is bitwise row i of the 64-row call, one expert and grouped."""
    qx, qw = _nvfp4_operands(64, 48, 24, 2, seed=4)
    full = qg.grouped_nvfp4(qx, qw, [64, 0], torch.bfloat16)
    for m in (1, 3, 17):
        part = qg.grouped_nvfp4(_rows(qx, 0, m), qw, [m, 0], torch.bfloat16)
        assert_bitwise_equal(part, full[:m], f"M={m} vs M=64")
    # grouped: expert 1's rows give the same bits whatever expert 0 (and the empty expert) holds
    ref = qg.grouped_nvfp4(_rows(qx, 40, 64), qw, [0, 24], torch.bfloat16)
    for lead in (1, 17, 40):
        got = qg.grouped_nvfp4(_cat(_rows(qx, 40 - lead, 40), _rows(qx, 40, 64)), qw, [lead, 24], torch.bfloat16)
        assert_bitwise_equal(got[lead:], ref, f"expert 1 rows after {lead} rows of expert 0")
    # a different config (TRAIN shape) under the interpreter gives the same bits too
    assert_bitwise_equal(qg.grouped_nvfp4(qx, qw, [64, 0], torch.bfloat16, config=qg.TRAIN), full, "TRAIN vs DECODE")


def _rows(q, lo, hi):
    """Rows lo..hi of an [R, K] QTensor (NVFP4 or MXFP8)."""
    outer = q.outer[lo:hi] if q.outer.shape[0] == q.shape[0] else q.outer
    return qgemm.dataclasses.replace(q, data=q.data[lo:hi], scale=q.scale[lo:hi], outer=outer,
                                     shape=torch.Size([hi - lo, q.shape[1]]))


def _cat(a, b):
    return qgemm.dataclasses.replace(a, data=torch.cat([a.data, b.data]), scale=torch.cat([a.scale, b.scale]),
                                     outer=torch.cat([a.outer, b.outer]),
                                     shape=torch.Size([a.shape[0] + b.shape[0], a.shape[1]]))


# ---------------------------------------------------------------- MXFP8 backward GEMMs, CPU interpreter


def _mx(shape, seed, spread=4):
    g = torch.Generator().manual_seed(seed)
    row_scale = torch.exp2(torch.randint(-spread, spread + 1, (*shape[:-1], 1), generator=g).float())
    x = torch.randn(shape, generator=g) * row_scale
    return quantize(x.to(DEVICE), "mxfp8")


@pytest.mark.parametrize("fp8", [False, True])
def test_mxfp8_dgrad_matches_exact_product(fp8):
    counts = [7, 0, 19, 4]
    qa, qb = _mx((30, 96), 5), _mx((4, 40, 96), 6)
    got = mg.grouped_mxfp8(qa, qb, counts, fp8=fp8)
    exact, mag = _exact_grouped(dequantize(qa, torch.float64), dequantize(qb, torch.float64), counts)
    _assert_close(got, exact, mag, 96, TOL["mxfp8_fp8" if fp8 else "mxfp8_bf16"], f"dgrad fp8={fp8}")


@pytest.mark.parametrize("fp8", [False, True])
def test_mxfp8_wgrad_matches_exact_product(fp8):
    padded = [32, 0, 64, 32]  # an empty expert: zeros
    qa, qb = _mx((24, 128), 7), _mx((40, 128), 8)
    got = mg.wgrad_mxfp8(qa, qb, padded, fp8=fp8)
    _check_wgrad(got, qa, qb, padded, fp8)
    assert not bool(got[1].any()), "an expert with no tokens must get a zero weight gradient"


def _check_wgrad(got, qa, qb, padded, fp8):
    """got[e] against the exact A[:, seg e] @ B[:, seg e]ᵀ of each expert's column segment."""
    a, b = dequantize(qa, torch.float64), dequantize(qb, torch.float64)
    start = 0
    for e, m in enumerate(padded):
        seg = slice(start, start + m)
        _assert_close(got[e], a[:, seg] @ b[:, seg].t(), a[:, seg].abs() @ b[:, seg].abs().t(), max(m, 1),
                      TOL["mxfp8_fp8" if fp8 else "mxfp8_bf16"], f"wgrad expert {e} fp8={fp8}")
        start += m


def test_mxfp8_forward_batch_invariance():
    qa, qb = _mx((64, 64), 9), _mx((2, 32, 64), 10)
    full = mg.grouped_mxfp8(qa, qb, [64, 0], torch.bfloat16)
    for m in (1, 3, 17):
        part = mg.grouped_mxfp8(_rows(qa, 0, m), qb, [m, 0], torch.bfloat16)
        assert_bitwise_equal(part, full[:m], f"mxfp8 M={m} vs M=64")


@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp8"])
def test_trainer_dispatch_forward_backward(fmt, monkeypatch):
    """trainer.qgemm routed through these kernels (forced on CPU) vs its own reference: y, dx, dw close."""
    g = torch.Generator().manual_seed(26)
    counts = [5, 0, 40]
    x0 = torch.randn(45, 64, generator=g).to(DEVICE)
    w0 = (torch.randn(3, 32, 64, generator=g) * 0.1).to(DEVICE)
    outs = {}
    for mode in ("kernels", "reference"):
        if mode == "kernels":
            monkeypatch.setattr(qgemm, "gemm_kernels", lambda t: (qg, mg))
        else:
            monkeypatch.undo()
            monkeypatch.setenv("RL4BIT_KERNELS", "reference")
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        y = qgemm.grouped_gemm(x, w, counts, qgemm.GemmSpec(fmt), keys=(1, 2, 3, 0))
        y.square().sum().backward()
        outs[mode] = (y, x.grad, w.grad)
    for name, a, b in zip(("y", "dx", "dw"), outs["kernels"], outs["reference"]):
        rel = float((a - b).norm() / b.norm())
        assert rel < 1e-5, f"{fmt} {name}: relative difference {rel:.2e} between kernels and reference"


# ---------------------------------------------------------------- deferred non-finite checks


def test_deferred_checks_raise_once_at_exit():
    bad = torch.ones(4, 32, device=DEVICE)
    bad[2, 5] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        td.quantize(bad, "nvfp4")  # the immediate check, unchanged
    with pytest.raises(ValueError, match="deferred_checks"):
        with td.deferred_checks():
            q = td.quantize(bad, "nvfp4")  # no host read: returns codes
            assert q is not None
            td.quantize(torch.ones(4, 32, device=DEVICE), "nvfp4")
    with td.deferred_checks():  # the flag was reset: a clean block passes
        td.quantize(torch.ones(4, 32, device=DEVICE), "nvfp4")
    with pytest.raises(RuntimeError, match="another error"):  # a block that raises something else (an expert-
        with td.deferred_checks():                           # parallel stop) leaves no flag to blame on later
            td.quantize(bad, "nvfp4")
            raise RuntimeError("another error")
    with td.deferred_checks():
        td.quantize(torch.ones(4, 32, device=DEVICE), "nvfp4")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf"), None])
def test_flag_nonfinite_sets_the_flag_exactly_for_nan_and_inf(dtype, value):
    """`formats_triton.flag_nonfinite`, `defer_nonfinite`'s one-pass kernel: the flag is set iff the tensor holds
    NaN/Inf, wherever it sits (the last, partial block included); finite extremes do not set it."""
    from rl4bit.kernels.formats_triton import flag_nonfinite

    x = torch.full((3, 4100), torch.finfo(dtype).max, dtype=dtype, device=DEVICE)
    x[1, ::2] = torch.finfo(dtype).min
    if value is not None:
        x[2, 4099] = value
    flag = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    assert flag_nonfinite(x, flag)
    assert int(flag.item()) == (value is not None)
    assert not flag_nonfinite(x.t(), flag)  # not contiguous: the caller's fallback
    assert not flag_nonfinite(x.double(), flag)  # float64 would overflow the kernel's FP32: the fallback


def test_bench_gemm_smoke(tmp_path):
    """rl4bit bench gemm --quick on CPU (reference path) writes its table; the MXFP8 cases run under the interpreter."""
    import json

    from rl4bit.bench import gemm as bench_gemm

    if not HAS_CUDA:
        rows = bench_gemm.run("cpu", quick=True, out=str(tmp_path))
        saved = json.loads((tmp_path / "bench_gemm.json").read_text())
        assert len(saved["rows"]) == len(rows) == 5 and all(r["us"] > 0 for r in rows)
    rows = bench_gemm.train_cases(DEVICE, 64, 2, [("tiny", 64, 32)], reps=1, mxfp8=True)
    assert [r["case"] for r in rows][1:] == ["mxfp8 dgrad (BF16 dequant)", "mxfp8 wgrad (BF16 dequant)",
                                             "mxfp8 dgrad (FP8 cores)", "mxfp8 wgrad (FP8 cores)"]


# ---------------------------------------------------------------- GPU: real shapes, configs, autograd, graphs


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("shape", [(16, 4096, 14336, 1), (256, 2048, 1536, 128), (256, 768, 2048, 128)])
def test_gpu_nvfp4_real_shapes(shape):
    rows, k, n, experts = shape
    qx, qw = _nvfp4_operands(rows, k, n, experts, seed=11)
    counts = _routing(rows, experts, seed=12)
    for cfg in (qg.DECODE, qg.MID, qg.TRAIN):
        _check_nvfp4(qx, qw, counts, qg.grouped_nvfp4(qx, qw, counts, torch.float32, config=cfg), f"{shape} {cfg}")


def _routing(rows, experts, seed):
    g = torch.Generator().manual_seed(seed)
    c = torch.bincount(torch.randint(0, max(1, experts // 2), (rows,), generator=g), minlength=experts)
    return c.tolist()  # about half the experts empty


@pytest.mark.gpu
@gpu
def test_gpu_configs_and_decodes_bitwise_equal():
    """DECODE vs MID vs TRAIN tiles (x pre-decoded or not), PTX / Triton-ops / FP32 decodes: the same bits (TWO_CONFIGS
    relies on it)."""
    for k in (2048, 2112):  # 2112: DECODE's 256-wide K step ends on a partial tile
        _configs_bitwise_equal(*_nvfp4_operands(200, k, 1536, 8, seed=13), _routing(200, 8, seed=14))


def _configs_bitwise_equal(qx, qw, counts):
    ref = qg.grouped_nvfp4(qx, qw, counts, torch.float32, config=qg.TRAIN)
    for cfg in (qg.DECODE, qg.DECODE_WIDE, qg.MID, qg.Config(16, 32, 4, 4), qg.Config(64, 64, 4, 3), qg.TRAIN,
                qg.Config(16, 16, 1, 8, True, block_k=256), qg.Config(16, 64, 2, 4, True, block_k=128),
                qg.Config(128, 128, 8, 3, block_k=128), qg.Config(16, 64, 2, 3, True, block_k=256, w_first=True),
                qg.Config(16, 32, 2, 3, True, block_k=256, w_first=True), qg.Config(16, 32, 1, 3, False, w_first=True),
                qg.Config(16, 64, 8, 3, True, block_k=256), qg.Config(16, 128, 8, 5, True, block_k=128),
                qg.Config(16, 64, 2, 3, True, block_k=128)):
        for decode in qg.DECODES:
            got = qg.grouped_nvfp4(qx, qw, counts, torch.float32, config=cfg, decode=decode)
            assert_bitwise_equal(got, ref, f"{cfg} decode={decode} vs TRAIN asm")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("rows,k", [(1, 2048), (4, 768), (64, 2048), (200, 2112)])
def test_gpu_quantize_and_multiply_equals_quantize_then_grouped(rows, k):
    """The serving path (x decoded by the quantize kernel, tile maps shared) = the trainer's (quantize, then the
    GEMM with its own pre-decode), bitwise, for every decode, at decode and MID/TRAIN sizes."""
    from rl4bit.kernels import nvfp4_triton

    experts = 8
    x = _activations(rows, k, seed=42)
    _, qw = _nvfp4_operands(4, k, 1536, experts, seed=43)
    counts = torch.tensor(_routing(rows, experts, seed=44), device=DEVICE)
    q = quantize(x, "nvfp4", outer="row", four_over_six=True)
    for decode in qg.DECODES:
        xh = torch.empty(x.shape, dtype=torch.float16, device=DEVICE)
        nvfp4_triton.quantize_nvfp4(x, outer="row", four_over_six=True, decoded=xh, decode=decode)
        want = torch.empty_like(xh)
        qg._predecode_kernel[(triton_cdiv(rows, 16), triton_cdiv(k, qg.BLOCK_K))](
            qg._words(q.data), q.scale.view(torch.uint8), want, rows, k, BLOCK_R=16, BLOCK_K=qg.BLOCK_K,
            DECODE=qg.DECODES[decode], num_warps=1)
        assert_bitwise_equal(xh, want, f"decoded operand, decode={decode}")
        maps = {}
        for _ in range(2):
            _, y = qg.quantize_and_multiply(x, qw, counts, torch.bfloat16, decode=decode, maps=maps)
            assert_bitwise_equal(y, qg.grouped_nvfp4(q, qw, counts, torch.bfloat16, decode=decode), f"y {decode}")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("rows,k", [(4, 2048), (256, 2048), (64, 768)])
def test_gpu_rows_read_in_place_equal_gather_then_cast(rows, k):
    """rows=, cast= on the GPU (the MoE layer's FP32 hidden states, top-k rows in expert order, BF16 compute):
    the same bits as gathering and casting first, for every decode (the cast by integer ops in the kernel, the
    reference by `Tensor.to`)."""
    experts, top_k = 8, 4
    src = _activations(rows // top_k, k, seed=48)
    g = torch.Generator().manual_seed(49)
    tok = torch.randint(0, src.shape[0], (rows,), generator=g).to(DEVICE)
    _, qw = _nvfp4_operands(4, k, 1536, experts, seed=50)
    counts = torch.tensor(_routing(rows, experts, seed=51), device=DEVICE)
    xr = src[tok].to(torch.bfloat16)
    for decode in qg.DECODES:
        want_q, want_y = qg.quantize_and_multiply(xr, qw, counts, torch.bfloat16, decode=decode)
        got_q, got_y = qg.quantize_and_multiply(src, qw, counts, torch.bfloat16, decode=decode, rows=tok,
                                                cast=torch.bfloat16)
        assert_bitwise_equal(got_q.data, want_q.data, f"codes {decode}")
        assert_bitwise_equal(got_q.outer, want_q.outer, f"outer {decode}")
        assert_bitwise_equal(got_q.scale, want_q.scale, f"scales {decode}")
        assert_bitwise_equal(got_y, want_y, f"y {decode}")


@pytest.mark.gpu
@gpu
def test_gpu_batch_invariance_across_configs():
    """The public path picks DECODE for R <= 64 and TRAIN above: row i must not change with R."""
    qx, qw = _nvfp4_operands(1024, 2048, 1536, 1, seed=15)
    full = qgemm.grouped_forward(qx, qw, [1024], torch.bfloat16)
    for m in (1, 3, 16, 17, 64, 65, 300):
        assert_bitwise_equal(qgemm.grouped_forward(_rows(qx, 0, m), qw, [m], torch.bfloat16), full[:m], f"M={m}")
    qa, qb = _mx((1024, 2048), 16), _mx((1, 1536, 2048), 17)
    full = qgemm.grouped_forward(qa, qb, [1024], torch.bfloat16)
    for m in (1, 17, 64, 65):
        assert_bitwise_equal(qgemm.grouped_forward(_rows(qa, 0, m), qb, [m], torch.bfloat16), full[:m], f"mxfp8 M={m}")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("fp8", [False, True])
def test_gpu_mxfp8_backward_real_shapes(fp8):
    counts = _routing(512, 16, seed=18)
    qa, qb = _mx((512, 1536), 19), _mx((16, 2048, 1536), 20)
    exact, mag = _exact_grouped(dequantize(qa, torch.float64), dequantize(qb, torch.float64), counts)
    _assert_close(mg.grouped_mxfp8(qa, qb, counts, fp8=fp8), exact, mag, 1536,
                  TOL["mxfp8_fp8" if fp8 else "mxfp8_bf16"], f"dgrad fp8={fp8}")
    padded = [-(-c // 32) * 32 for c in counts]
    qa, qb = _mx((1536, sum(padded)), 21), _mx((2048, sum(padded)), 22)
    _check_wgrad(mg.wgrad_mxfp8(qa, qb, padded, fp8=fp8), qa, qb, padded, fp8)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp8"])
def test_gpu_autograd_matches_reference_path(fmt, monkeypatch):
    """trainer.qgemm on CUDA (Triton GEMMs) vs RL4BIT_KERNELS=reference on CUDA: same quantized operands."""
    g = torch.Generator().manual_seed(23)
    counts = _routing(300, 8, seed=24)
    x0 = torch.randn(300, 2048, generator=g).to("cuda", torch.bfloat16)
    w0 = (torch.randn(8, 1536, 2048, generator=g) * 0.02).to("cuda")
    spec = qgemm.GemmSpec(fmt)
    outs = {}
    for mode in ("triton", "reference"):
        if mode == "reference":
            monkeypatch.setenv("RL4BIT_KERNELS", "reference")
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        y = qgemm.grouped_gemm(x, w, counts, spec, keys=(1, 2, 3, 0))
        y.float().square().sum().backward()
        outs[mode] = (y.float(), x.grad.float(), w.grad.float())
    for name, a, b in zip(("y", "dx", "dw"), outs["triton"], outs["reference"]):
        rel = float((a - b).norm() / b.norm())
        assert rel < 2e-3, f"{fmt} {name}: relative error {rel:.2e} between the Triton and reference paths"


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("fmt", ["nvfp4", "mxfp8"])
@pytest.mark.parametrize("where", ["input", "gradient"])
def test_gpu_non_finite_values_in_a_deferred_training_step(fmt, where):
    """Inside deferred_checks() (the trainer's micro-batch) an Inf in a quantized GEMM's input or output gradient
    raises nothing mid-step and NonFiniteInputError at the block's exit; the flag is reset for the next step."""
    from rl4bit.kernels import NonFiniteInputError, deferred_checks

    g = torch.Generator().manual_seed(31)
    counts = _routing(64, 4, seed=32)
    x = torch.randn(64, 256, generator=g).to("cuda", torch.bfloat16)
    if where == "input":
        x[5, 7] = float("inf")  # mxfp8 encodes NaN (scale 0xFF), neither format encodes Inf
    x.requires_grad_()
    w = (torch.randn(4, 128, 256, generator=g) * 0.02).to("cuda").requires_grad_()
    with pytest.raises(NonFiniteInputError):
        with deferred_checks():
            y = qgemm.grouped_gemm(x, w, counts, qgemm.GemmSpec(fmt), keys=(1, 2, 3, 0))
            dy = torch.ones_like(y)
            if where == "gradient":
                dy[3, 4] = float("inf")
            y.backward(dy)
    with deferred_checks():  # a clean step afterwards passes: the flag was reset
        y = qgemm.grouped_gemm(x.detach().nan_to_num(0.0).requires_grad_(), w, counts, qgemm.GemmSpec(fmt))
        y.float().sum().backward()


@pytest.mark.gpu
@gpu
def test_gpu_decode_step_captures_in_cuda_graph():
    """quantize (deferred check) + grouped NVFP4 GEMM with device counts: captured once, replayed on new inputs."""
    _, qw = _nvfp4_operands(8, 2048, 1536, 16, seed=25)
    spec = qgemm.GemmSpec("nvfp4")
    x = torch.randn(8, 2048, device="cuda", dtype=torch.bfloat16)
    counts = torch.tensor([2, 0, 6] + [0] * 13, device="cuda")

    def step():
        return qgemm.grouped_forward(qgemm.quantize_activation(x, spec), qw, counts, torch.bfloat16)

    with td.deferred_checks():
        step()  # compile outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = step()
    x.copy_(torch.randn(8, 2048, device="cuda", dtype=torch.bfloat16))
    counts.copy_(torch.tensor([0, 5, 3] + [0] * 13, device="cuda"))
    graph.replay()
    td.check_deferred()
    assert_bitwise_equal(y, step(), "graph replay vs eager on new inputs and routing")
