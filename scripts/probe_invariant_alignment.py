"""Why the invariant mode's dense product took 4-6x cuBLAS's time: `invariant_triton._bmm_kernel` beside a kernel
of the form of Triton's matmul tutorial (int32 offsets, pointer increments), same tiles, on a GPU.

    source scripts/device_env.sh && python3 -P scripts/probe_invariant_alignment.py [--configs]

Per shape (the GPU job's router, o projection forward, input gradient and weight gradient, Qwen3's LM head at
16 and 8,192 rows) and tile (`invariant_triton.tiles`' choice; with `--configs`, four): µs a call of cuBLAS, of
`_bmm_kernel` launched on one matrix, and of the tutorial-form kernel with M specialized and not, each with FP
fusion on and off, and the elements where each output differs from `invariant_triton.bmm`'s.

Twenty-sixth session, H100, with the previous `_bmm_kernel` (commit e21b409, which added the unspecialized batch
stride to every pointer), measured with earlier forms of this script (the committed one, with `--configs`, the
input gradient and the 8,192-row LM head, has not run yet): the tutorial form ran 1.8-4.6x faster with the same bits,
fusion changed nothing, and an unspecialized M cost the weight gradient (its operand contiguous along M) 2.6x.
The cause, read in the sm_90 PTX (`tests/kernels/test_triton_compile.py`): with the batch stride added, no operand
pointer's alignment was known, so one operand was loaded element by element. The previous kernel beside this one:
`scripts/sweep_invariant_gemm.py --against` a copy of it.

Leaves out: other dtypes, biases, batched calls (`BATCHED` keeps reading the batch strides there).
"""
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

from rl4bit.kernels import invariant_triton as it

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sweep_invariant_gemm import operands, time_us  # noqa: E402


def tut_body(a_ptr, b_ptr, c_ptr, M, N, K, s_am, s_ak, s_bk, s_bn, s_cm,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """c = a @ b in the tutorial's form: int32 offsets, masked rows/columns and K tail, pointers advanced a step."""
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rm[:, None] * s_am + rk[None, :] * s_ak
    b_ptrs = b_ptr + rk[:, None] * s_bk + rn[None, :] * s_bn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        a = tl.load(a_ptrs, mask=(rm < M)[:, None] & (rk[None, :] < K - k * BLOCK_K), other=0.0)
        b = tl.load(b_ptrs, mask=(rk[:, None] < K - k * BLOCK_K) & (rn < N)[None, :], other=0.0)
        acc = tl.dot(a, b, acc)
        a_ptrs += BLOCK_K * s_ak
        b_ptrs += BLOCK_K * s_bk
    c = c_ptr + rm[:, None] * s_cm + rn[None, :]
    tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=(rm < M)[:, None] & (rn < N)[None, :])


tut = triton.jit(tut_body)
tut_nospec = triton.jit(tut_body, do_not_specialize=["M"])


def run(kern, a, b, cfg, fusion):
    m, k = a.shape
    n = b.shape[1]
    c = torch.empty(m, n, device=a.device, dtype=a.dtype)
    kern[(triton.cdiv(m, cfg.block_m), triton.cdiv(n, cfg.block_n))](
        a, b, c, m, n, k, a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0),
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        num_warps=cfg.warps, num_stages=cfg.stages, enable_fp_fusion=fusion)
    return c


def ours(a, b, cfg, fusion):
    m, k = a.shape
    n = b.shape[1]
    a3, b3 = a[None], b[None]
    out = torch.empty((1, m, n), dtype=a.dtype, device=a.device)
    it._bmm_kernel[(triton.cdiv(m, cfg.block_m), triton.cdiv(n, cfg.block_n), 1)](
        a3, b3, out, out, m, n, k, *a3.stride(), *b3.stride(), *out.stride(), 0, 0, 1.0, 1.0, HAS_BIAS=False,
        SCALED=False, IEEE=False, UPCAST=False, BATCHED=False, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k, num_warps=cfg.warps, num_stages=cfg.stages, enable_fp_fusion=fusion)
    return out[0]


print(torch.__version__, torch.cuda.get_device_name())
gen = torch.Generator(device="cuda").manual_seed(0)
configs = [it.tiles(2048, 2048, torch.bfloat16)]
if "--configs" in sys.argv:  # the four tiles the 16-bit choice of `invariant_triton.tiles` was made from
    configs = [it.Tiles(64, 128, 64, 4, 3), it.Tiles(128, 128, 64, 8, 3), it.Tiles(128, 256, 64, 8, 3),
               it.Tiles(128, 128, 64, 4, 4)]
for label, m, n, k, layout in [("router", 16, 16, 2048, "fwd"), ("o fwd", 8192, 2048, 2048, "fwd"),
                               ("o dgrad", 8192, 2048, 2048, "dgrad"), ("o wgrad", 2048, 2048, 8192, "wgrad"),
                               ("lm head", 16, 151936, 2048, "fwd"),
                               ("lm head", 8192, 151936, 2048, "fwd")]:
    a, b = operands(m, n, k, layout, gen)
    print(f"{label} M={m} N={n} K={k}: cuBLAS {time_us(lambda: a @ b):.1f} µs")
    for cfg in configs:
        ref = it.bmm(a[None], b[None], config=cfg)[0]
        cells = []
        for name, fn in (("ours", ours), ("tutorial", lambda a, b, c, f: run(tut, a, b, c, f)),
                         ("tutorial, M unspecialized", lambda a, b, c, f: run(tut_nospec, a, b, c, f))):
            for fusion in (True, False):
                out = fn(a, b, cfg, fusion)
                t = time_us(lambda: fn(a, b, cfg, fusion))
                cells.append(f"{name} fusion={fusion} {t:.1f} (differ {int((out != ref).sum())})")
        print(f"  {tuple(cfg)}:\n    " + "\n    ".join(cells))
