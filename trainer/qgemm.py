"""Quantized grouped GEMM (a group of experts; a linear layer is a group of one) as an autograd Function.

y[rows of expert e] = x[rows of e] @ W[e]ᵀ, x [R, K] holding each expert's tokens contiguously (`counts[e]` rows)
and W [E, N, K]. Numerics per recipe (shared/docs/numerics.md):
- nvfp4 forward: x -> NVFP4 per-row outer scale (4/6 optional), W -> NVFP4 per-expert outer; operands
  dequantized without their outer scale (exact), FP32 accumulation, then (acc * outer_x[m]) * outer_w[e] in
  FP32. The forward's QTensors are what backward saves (4.5 bits/value).
- backward: MXFP8 GEMMs. nvfp4 `requantize`s the saved x and W (stochastic rounding: E[requant] is the forward's
  dequantized tensor); output gradients go to MXFP8 (RCEIL), rowwise for dgrad, columnwise from the
  high-precision dY for wgrad; random bits from derive_seed(seed, step, layer, tensor_id, call). mxfp8 quantizes
  every columnwise operand from high precision (TE mxfp8.rst). bf16: plain matmuls. Each expert's rows are
  zero-padded to a multiple of 32 inside the backward, so MXFP8 blocks never straddle two experts.
Batch invariance: the quantized forward is a torch.bmm over fixed [N, K] x [K, ROW_BLOCK] items, never one matmul
over all rows (plain torch.mm is not row-invariant on CPU: M=1 takes a gemv path). On CUDA the same products run
as the Triton kernels of kernels/qgemm_triton.py and kernels/mxfp8_gemm_triton.py, equal to this code up to the
order of the FP32 sum over K; `counts` may be a device tensor there (CUDA-graph capturable).

Leaves out: RHT on wgrad, activation recomputation. The code below is the exact reference the kernels are tested
against."""

from __future__ import annotations

import dataclasses
import itertools
import os
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from rl4bit.kernels import QTensor, checks, dequantize, fused, invariant, quantize, quantize_columnwise, requantize
from rl4bit.kernels.philox import derive_seed
from rl4bit.kernels.transfer import to_device

ROW_BLOCK = 32
"""Rows per forward GEMM block (batch invariance) and token padding of the MXFP8 backward blocks."""

TENSOR_IDS = {"x": 0, "w": 1, "dy": 2, "dy_t": 3}
"""tensor_id key of each stochastically rounded tensor in derive_seed."""


@dataclass(frozen=True)
class GemmSpec:
    """Numerics of one GEMM site (from RecipeConfig + the plan)."""

    fmt: str  # "nvfp4" | "mxfp8" | "bf16"
    four_over_six: bool = True
    tiles_16x16: bool = False
    stochastic_requant: bool = True
    grad_rounding: str = "nearest"


# ---------------------------------------------------------------- quantization of the operands


def quantize_weight(w: torch.Tensor, spec: GemmSpec) -> QTensor:
    """The forward's weight QTensor of W [E, N, K]: NVFP4 per-expert outer (no 4/6) or MXFP8."""
    w = w.detach()
    if spec.fmt == "nvfp4":
        return quantize(w, "nvfp4", outer="group", tiles_16x16=spec.tiles_16x16)
    return quantize(w, "mxfp8")


def quantize_activation(x: torch.Tensor, spec: GemmSpec) -> QTensor:
    """The forward's activation QTensor of x [R, K]: NVFP4 per-token outer (+4/6) or MXFP8."""
    if spec.fmt == "nvfp4":
        return quantize(x.detach(), "nvfp4", outer="row", four_over_six=spec.four_over_six)
    return quantize(x.detach(), "mxfp8")


def _unscaled(q: QTensor) -> torch.Tensor:
    """FP32 values of q without its outer scale (code x block scale: exact)."""
    return dequantize(dataclasses.replace(q, outer=torch.ones_like(q.outer)), torch.float32)


def _unscaled_group(q: QTensor, e: int) -> torch.Tensor:
    """FP32 values of group e of a grouped q [E, N, K] without its outer scale (the same bits as
    `_unscaled(q)[e]`: decoding is elementwise)."""
    ones = torch.ones([1] * (q.data.dim() - 1), dtype=torch.float32, device=q.data.device)
    return dequantize(QTensor(q.data[e], q.scale[e], ones, q.fmt, q.shape[1:]), torch.float32)


def rowblock_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [m, K] @ b [N, K].T (a's dtype) over fixed ROW_BLOCK-row blocks of a (row results independent of m).

    Each block is one bmm item b [N, K] (contiguous) x block.T [K, ROW_BLOCK], the same layout for every
    caller: BLAS reads both operands in place (given the weight as a transposed [K, N] operand, the CPU's BF16
    bmm copies it every call: ~8x slower on the 1B model's expert shapes).
    """
    m = a.shape[0]
    pad = (-m) % ROW_BLOCK
    if pad:
        a = torch.cat([a, a.new_zeros(pad, a.shape[1])])
    nb = a.shape[0] // ROW_BLOCK
    b = b.contiguous()
    out = torch.bmm(b.expand(nb, *b.shape), a.view(nb, ROW_BLOCK, a.shape[1]).transpose(1, 2))
    return out.transpose(1, 2).reshape(nb * ROW_BLOCK, b.shape[0])[:m]


def _row_outer(q: QTensor, rows: int) -> torch.Tensor:
    o = q.outer.reshape(-1, 1).float()
    return o if o.shape[0] == rows else o.reshape(1, 1).expand(rows, 1)


def _group_outer(q: QTensor, groups: int) -> torch.Tensor:
    o = q.outer.reshape(-1).float()
    return o if o.numel() == groups else o.reshape(1).expand(groups)


def gemm_kernels(t: torch.Tensor):
    """(qgemm_triton, mxfp8_gemm_triton) when t is on CUDA and the Triton GEMMs may run, else None."""
    if not t.is_cuda or os.environ.get("RL4BIT_KERNELS", "") == "reference":
        return None
    try:
        from rl4bit.kernels import mxfp8_gemm_triton, qgemm_triton
    except ImportError:  # triton not installed
        return None
    return qgemm_triton, mxfp8_gemm_triton


def grouped_forward(qx: QTensor, qw: QTensor, counts, out_dtype: torch.dtype) -> torch.Tensor:
    """The quantized forward product from QTensors: the training forward calls exactly this; serving calls
    `served_product`, which on the Triton path skips the x pre-decode launch and shares tile maps (same bits).

    counts: rows per expert, a list of ints or (CUDA kernels) an int tensor [E].
    """
    kernels = gemm_kernels(qx.data)
    if kernels is not None and qx.fmt == qw.fmt == "nvfp4":
        return kernels[0].grouped_nvfp4(qx, qw, counts, out_dtype)
    if kernels is not None and qx.fmt == qw.fmt == "mxfp8":
        return kernels[1].grouped_mxfp8(qx, qw, counts, out_dtype)
    if isinstance(counts, torch.Tensor):
        counts = counts.tolist()
    xd = _unscaled(qx)
    rows, groups = xd.shape[0], qw.shape[0]
    ox, ow = _row_outer(qx, rows), _group_outer(qw, groups)
    y = xd.new_zeros(rows, qw.shape[1])
    start = 0
    for e, m in enumerate(counts):
        if m:  # experts without rows are not decoded (decode's few routed experts)
            seg = slice(start, start + m)
            y[seg] = rowblock_mm(xd[seg], _unscaled_group(qw, e)) * ox[seg] * ow[e]
            start += m
    return y.to(out_dtype)


def served_product(x: torch.Tensor, qw: QTensor, counts, spec: GemmSpec, out_dtype: torch.dtype,
                   maps: dict | None = None, swiglu: bool = False, rows: torch.Tensor | None = None,
                   cast: torch.dtype | None = None) -> torch.Tensor:
    """The serving modules' product: `grouped_forward(quantize_activation(x, spec), qw, counts, out_dtype)`, bitwise.

    On the NVFP4 Triton path it is `qgemm_triton.quantize_and_multiply`: x quantized and decoded to the GEMM's
    FP16 operand in one launch when the GEMM's config reads it pre-decoded, and one tile map for the GEMMs
    that pass the same `maps` dict (a layer's gate_up and down share their routing `counts`).
    swiglu: x is h = [gate | up] and the product's input is `fused_swiglu.swiglu(h)` (SiLU), computed inside
    the quantize; only where `swiglu_served` says so.
    rows, cast: the product's input is x[rows].to(cast) (an MoE layer's tokens in expert order, in the compute
    dtype); the NVFP4 Triton path reads those rows in place, other paths gather and cast first.
    """
    kernels = gemm_kernels(x)
    if kernels is not None and spec.fmt == "nvfp4" and qw.fmt == "nvfp4" and x.dim() == 2:
        return kernels[0].quantize_and_multiply(x.detach(), qw, counts, out_dtype, four_over_six=spec.four_over_six,
                                                maps=maps, swiglu=swiglu, rows=rows, cast=cast)[1]
    if swiglu:
        raise ValueError("served_product(swiglu=True) needs the NVFP4 Triton path (swiglu_served); pass "
                         "fused_swiglu.swiglu(h, act_fn) with swiglu=False")
    if rows is not None or cast is not None:
        x = (x if rows is None else x[rows]).to(cast or x.dtype)
    return grouped_forward(quantize_activation(x, spec), qw, counts, out_dtype)


def swiglu_served(h: torch.Tensor, qw: QTensor, spec: GemmSpec, act_fn) -> bool:
    """Whether `served_product(h, qw, ..., swiglu=True)` computes `fused_swiglu.swiglu(h, act_fn)` inside the
    quantize: the kernel SwiGLU applies (fused kernels on, SiLU) and the product takes the NVFP4 Triton path
    with rows the row quantize kernel holds whole."""
    from rl4bit.trainer.fused_swiglu import applies

    if not applies(h, act_fn) or gemm_kernels(h) is None or spec.fmt != "nvfp4" or qw.fmt != "nvfp4":
        return False
    from rl4bit.kernels.nvfp4_triton import MAX_ROW_K

    k = h.shape[-1] // 2
    return k % 16 == 0 and k <= MAX_ROW_K


# ---------------------------------------------------------------- saved-bytes meter

_METERS: list[dict] = []


@contextmanager
def count_saved_bytes():
    """Within the block, sum the activation bytes the GEMMs save for backward: `with count_saved_bytes() as m: ...;
    m["bytes"]`."""
    meter = {"bytes": 0, "rows": 0}
    _METERS.append(meter)
    try:
        yield meter
    finally:
        _METERS.remove(meter)


def _count(nbytes: int, rows: int) -> None:
    for meter in _METERS:
        meter["bytes"] += int(nbytes)
        meter["rows"] += int(rows)


# ---------------------------------------------------------------- padding along the token dimension


@dataclass
class _Layout:
    """Each expert's rows zero-padded to a multiple of ROW_BLOCK (the MXFP8 blocks along tokens never straddle
    two experts)."""

    counts: list[int]
    padded: list[int]
    total: int  # R_pad
    device: torch.device
    _rows: torch.Tensor | None = None

    @property
    def rows(self) -> torch.Tensor:
        """int64 [R]: each row's position in the padded layout, built on the device at first use from the [2, E]
        table of shifts and counts (no padding: never used). Built on the host, R indices took ~1 ms a GEMM."""
        if self._rows is None:
            shift = list(itertools.accumulate((p - c for p, c in zip(self.padded, self.counts)), initial=0))[:-1]
            table = to_device(torch.tensor([shift, self.counts], dtype=torch.int64), self.device)
            r = sum(self.counts)
            self._rows = torch.arange(r, device=self.device) + torch.repeat_interleave(table[0], table[1],
                                                                                       output_size=r)
        return self._rows


def _layout(counts: list[int], device) -> _Layout:
    padded = [-(-m // ROW_BLOCK) * ROW_BLOCK for m in counts]
    return _Layout(counts, padded, sum(padded), torch.device(device))


def _pad_rows(x: torch.Tensor, lay: _Layout) -> torch.Tensor:
    """x [R, ...] -> [R_pad, ...] with zero rows in the padding (x itself when every count is a multiple of 32)."""
    if lay.total == x.shape[0]:
        return x
    out = x.new_zeros(lay.total, *x.shape[1:])
    out[lay.rows] = x
    return out


def _pad_qtensor_rows(q: QTensor, lay: _Layout) -> QTensor:
    """q [R, K] NVFP4 -> [R_pad, K] with zero rows (codes 0, block scales 0, outer 1) in the padding."""
    if lay.total == q.shape[0]:
        return q
    data = _pad_rows(q.data, lay)
    scale = _pad_rows(q.scale.view(torch.uint8), lay).view(q.scale.dtype)  # e4m3 0x00 == 0
    outer = q.outer
    if outer.numel() == q.data.shape[0] and outer.numel() > 1:
        outer = torch.ones(lay.total, *outer.shape[1:], dtype=outer.dtype, device=outer.device)
        outer[lay.rows] = q.outer
    return dataclasses.replace(q, data=data, scale=scale, outer=outer, shape=torch.Size([lay.total, q.shape[-1]]))


# ---------------------------------------------------------------- autograd


def _check_finite(t: torch.Tensor, what: str) -> None:
    """FloatingPointError if t holds NaN/Inf; inside `deferred_checks()` on CUDA, recorded in the device's
    non-finite flag instead (no host sync), and inside `deferred_checks(host=True)` otherwise, in the host's
    record (the block's exit raises NonFiniteInputError)."""
    if t.is_cuda:
        from rl4bit.kernels import triton_dispatch

        if triton_dispatch.deferring():
            triton_dispatch.defer_nonfinite(t)
            return
    if checks.host_deferring():  # the CPU, or CUDA without Triton's deferral (a host read here)
        checks.defer_host(not bool(torch.isfinite(t).all()))
        return
    if not bool(torch.isfinite(t).all()):
        raise FloatingPointError(f"non-finite values in {what}; MXFP8 cannot encode them "
                                 "(lower the learning rate or check the loss)")


def _mxfp8_backward(dy, xt: QTensor, wt: QTensor, lay: _Layout, spec: GemmSpec, seeds, dx_dtype: torch.dtype):
    """dx = Q(dy) @ Q(Wᵀ)ᵀ (FP32 accumulation, rounded once to dx_dtype) and dW = Q(dyᵀ) @ Q(xᵀ)ᵀ per expert (FP32)."""
    sr = spec.grad_rounding == "stochastic"
    dy = dy.contiguous()
    qdy = quantize(dy, "mxfp8", rounding=spec.grad_rounding, seed=seeds[2] if sr else None)  # [R, N]
    qdyt = quantize_columnwise(_pad_rows(dy, lay), rounding=spec.grad_rounding,
                               seed=seeds[3] if sr else None)  # [N, R_pad]
    kernels = gemm_kernels(dy)
    if kernels is not None:  # dx rounded from the FP32 accumulator in the kernel: the bits of .to(dx_dtype)
        dx = kernels[1].grouped_mxfp8(qdy, wt, lay.counts, dx_dtype)  # [R, N] x [E, K, N]ᵀ
        dw = kernels[1].wgrad_mxfp8(qdyt, xt, lay.padded, torch.float32)  # [N, R_pad] x [K, R_pad]ᵀ per expert
        return dx, dw
    dyd, dytd = dequantize(qdy), dequantize(qdyt)
    wtd, xtd = dequantize(wt), dequantize(xt)  # [E, K, N], [K, R_pad]
    dx = dyd.new_zeros(dy.shape[0], wtd.shape[1])
    dw = dyd.new_zeros(wtd.shape[0], wtd.shape[2], wtd.shape[1])
    start = pstart = 0
    for e, (m, mp) in enumerate(zip(lay.counts, lay.padded)):
        if m:
            dx[start : start + m] = dyd[start : start + m] @ wtd[e].t()
            dw[e] = dytd[:, pstart : pstart + mp] @ xtd[:, pstart : pstart + mp].t()
        start, pstart = start + m, pstart + mp
    return dx.to(dx_dtype), dw


def _qparts(q: QTensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return q.data, q.scale, q.outer


class GroupedQGemm(torch.autograd.Function):
    """y = grouped x @ Wᵀ under one GemmSpec; `keys` = (seed, step, layer, call) for the backward's random bits.

    `qx` (nvfp4 only): x's forward QTensor, already quantized (expert parallelism
    dispatches it); then x only carries the dtype, row count and gradient.
    """

    @staticmethod
    def forward(ctx, x, w, counts, spec, keys, qx=None):
        ctx.counts, ctx.spec, ctx.keys = counts, spec, keys
        ctx.x_dtype, ctx.w_dtype = x.dtype, w.dtype
        if spec.fmt == "bf16":
            ctx.save_for_backward(x, w)
            _count(x.nbytes, x.shape[0])
            return bf16_grouped(x, w.to(x.dtype), counts)
        if qx is None:
            qx = quantize_activation(x, spec)
        qw = quantize_weight(w, spec)
        y = grouped_forward(qx, qw, counts, x.dtype)
        if spec.fmt == "nvfp4":
            # as saved tensors (not ctx attributes): activation recomputation and saved-tensor hooks see them. The
            # weight's QTensor too (4.5 bits a value until the backward), not w: quantizing w again there cost a
            # reduction over W and a quantize launch a GEMM, for the same bits
            ctx.save_for_backward(*_qparts(qx), *_qparts(qw))
            ctx.q_meta = (qx.shape, qw.shape)
            _count(qx.nbytes, x.shape[0])
        else:
            lay = _layout(counts, x.device)
            qxt = quantize_columnwise(_pad_rows(x.detach(), lay))
            ctx.save_for_backward(w, *_qparts(qxt))
            ctx.q_meta = (qxt.shape,)
            _count(qxt.nbytes, x.shape[0])
        return y

    @staticmethod
    def backward(ctx, dy):
        spec, counts = ctx.spec, ctx.counts
        if spec.fmt == "bf16":
            x, w = ctx.saved_tensors
            dx, dw = bf16_grouped_backward(dy, x.to(dy.dtype), w.to(dy.dtype), counts)
            return dx.to(ctx.x_dtype), dw.to(ctx.w_dtype), None, None, None, None
        _check_finite(dy, "an output gradient of a quantized GEMM")
        seed, step, layer, call = ctx.keys
        seeds = [derive_seed(seed, step, layer, t, call) for t in range(4)]
        lay = _layout(counts, dy.device)
        if spec.fmt == "nvfp4":
            rounding = "stochastic" if spec.stochastic_requant else "nearest"
            parts = ctx.saved_tensors
            qx = QTensor(*parts[:3], "nvfp4", ctx.q_meta[0])
            qw = QTensor(*parts[3:], "nvfp4", ctx.q_meta[1])
            xt = requantize(_pad_qtensor_rows(qx, lay), seed=seeds[TENSOR_IDS["x"]], rounding=rounding)
            wt = requantize(qw, seed=seeds[TENSOR_IDS["w"]], rounding=rounding)
            del parts, qx, qw
        else:
            w, *parts = ctx.saved_tensors
            xt = QTensor(*parts, "mxfp8", ctx.q_meta[0])
            wt = quantize_columnwise(w.detach())  # [E, K, N], blocks along N: no transposed copy of W
        dx, dw = _mxfp8_backward(dy, xt, wt, lay, spec, seeds, ctx.x_dtype)
        return dx, dw.to(ctx.w_dtype), None, None, None, None  # dx: already in x's dtype


def bf16_grouped(x: torch.Tensor, wc: torch.Tensor, counts, offs: torch.Tensor | None = None) -> torch.Tensor:
    """The `bf16` recipe's grouped product x [R, K] @ wc[e]ᵀ per expert's rows -> [R, N], in x's dtype.

    BF16 on CUDA: one `torch._grouped_mm` with the group offsets on the device,
    a grouped kernel that (on sm90/sm100) never reads the counts on the host, so
    the engine's decode step can be captured in a CUDA graph. Elsewhere (the
    CPU, FP32, rows not 16-byte aligned): a loop over experts of `rowblock_mm`,
    whose row results do not depend on how many rows an expert got (a plain
    matmul's do on the CPU for small M), so sampling stays batch-invariant.
    Training, the trainer's no-grad passes and serving all take this function.
    On the CPU they therefore compute the same bits (tested). On CUDA,
    `_grouped_mm` may pick its kernel from the rows per expert, so a training
    micro-batch and a decode step can run different kernels; row results were
    checked to be independent of the row counts only at small sizes
    (tests/trainer/test_bf16_grouped.py); in the invariant mode (`model.invariant_kernels`) they are by
    construction (`invariant_triton.grouped_mm`). counts: a list of ints or an int tensor [E]; offs: their int32
    cumsum on x's device when the caller has it (the routing kernel's, `expert_grouping`), else computed here.
    """
    if x.is_cuda and invariant.enabled():  # fixed-order grouped kernel: rows independent of the counts
        from rl4bit.kernels.invariant_triton import grouped_mm

        return grouped_mm(x, wc, counts)
    if not (x.is_cuda and x.dtype == wc.dtype == torch.bfloat16 and _aligned(x, wc)):
        counts = counts.tolist() if isinstance(counts, torch.Tensor) else counts
        y = x.new_empty(x.shape[0], wc.shape[1])
        start = 0
        for e, m in enumerate(counts):
            if m:
                y[start : start + m] = rowblock_mm(x[start : start + m], wc[e])
            start += m
        return y
    return torch._grouped_mm(x, wc.transpose(1, 2), offs=_group_offsets(counts, x.device) if offs is None else offs)


def bf16_grouped_backward(dy: torch.Tensor, x: torch.Tensor, wc: torch.Tensor, counts: list[int]):
    """(dx [R, K], dw [E, N, K]) of `bf16_grouped` for output gradient dy [R, N], all in dy's dtype.

    Two `torch._grouped_mm` calls (dx grouped over rows; dw grouped along the
    reduction over each expert's rows, an expert without rows getting zeros),
    on the CPU too, where they give a per-expert matmul loop's bits (tested).
    FP32 on CUDA, which has no grouped kernel, or rows not 16-byte aligned: that loop.
    """
    dy = dy.contiguous()  # e.g. the stride-0 gradient of a sum
    if (dy.is_cuda and not dy.dtype == x.dtype == wc.dtype == torch.bfloat16) or not _aligned(dy, x, wc):
        dx = torch.zeros_like(x)
        dw = torch.zeros(wc.shape, dtype=dy.dtype, device=dy.device)
        start = 0
        for e, m in enumerate(counts):
            if m:
                dx[start : start + m] = dy[start : start + m] @ wc[e]
                dw[e] = dy[start : start + m].t() @ x[start : start + m]
            start += m
        return dx, dw
    offs = _group_offsets(counts, dy.device)
    dx = torch._grouped_mm(dy, wc, offs=offs)
    dw = torch._grouped_mm(dy.t(), x, offs=offs)
    empty = to_device(torch.tensor([m == 0 for m in counts]), dy.device)
    return dx, dw.masked_fill(empty[:, None, None], 0.0)  # no rows: zero, whatever the kernel left there


def _group_offsets(counts, device) -> torch.Tensor:
    """int32 end row of each group (`torch._grouped_mm`'s offs) on `device`; counts a list or an int tensor."""
    if isinstance(counts, torch.Tensor):
        return counts.to(device=device, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    return to_device(torch.tensor(counts, dtype=torch.int32).cumsum(0, dtype=torch.int32), device)


def expert_grouping(flat_index: torch.Tensor, groups: int, k: int, maps: dict | None = None, tile_map: bool = True):
    """(order, tok, counts, inv) of a flat top-k index on its device, no host read: `argsort(stable)`,
    `order // k`, `device_counts`, and inv (inv[order] = arange: each entry's place in the grouped order;
    None from torch's path, where `trainer.combine` builds it only if its kernel runs).
    A decode step's small index takes one fused kernel (`kernels.route_triton`, the same integers) when the
    fused kernels are on (`kernels.fused`); given `maps` (the dict the layer's GEMMs share), that kernel's
    group offsets go into it as maps["offs"] (`bf16_grouped`'s, so the BF16 GEMMs compute no cumsum), and with
    `tile_map` (NVFP4 GEMMs, see `qgemm_triton.shared_tile_map`) their tile map for DECODE's row tiles too when
    the GEMMs will take those tiles (`qgemm_triton.decode_rows`)."""
    if fused.enabled(flat_index.device.type):
        from rl4bit.kernels.route_triton import MAX_ENTRIES, expert_order  # triton is optional off the fused path

        if flat_index.numel() <= MAX_ENTRIES:
            block_m = 0
            if maps is not None and tile_map:  # only for the 16-row tiles the layer's GEMMs will run
                from rl4bit.kernels.qgemm_triton import DECODE, decode_rows

                block_m = DECODE.block_m if decode_rows(flat_index.numel(), groups) else 0
            order, tok, counts, inv, cmap, offs = expert_order(flat_index, groups, k, block_m)
            if maps is not None:  # a new routing: whatever the dict held belongs to another one
                maps.clear()
                maps["counts"], maps["offs"] = counts, offs
            if cmap is not None:
                maps[(flat_index.numel(), block_m)] = cmap
            return order, tok, counts, inv
    order = torch.argsort(flat_index, stable=True)
    return order, order // k, device_counts(flat_index, groups), None  # inv: combine() makes it if it needs it


def inverse_order(order: torch.Tensor, n: int) -> torch.Tensor:
    """int64 [n] inv with inv[order] = arange(len(order)): where each entry landed in the grouped order (entries
    missing from `order`, the dropped expert-parallel sentinels, are left unset)."""
    inv = torch.empty(n, dtype=torch.int64, device=order.device)
    return inv.index_copy_(0, order, torch.arange(order.numel(), device=order.device, dtype=torch.int64))


def device_counts(flat_index: torch.Tensor, groups: int) -> torch.Tensor:
    """int32 [groups]: how many entries of `flat_index` name each group, computed on its device (no host read)."""
    counts = torch.zeros(groups, dtype=torch.int32, device=flat_index.device)
    return counts.index_add_(0, flat_index, torch.ones_like(flat_index, dtype=torch.int32))


def _aligned(*ts: torch.Tensor) -> bool:
    """K and N (the last dim of each operand, both of a weight [E, N, K]) multiples of 16 bytes, as
    `torch._grouped_mm` requires (multiples of 8 in BF16); the row count is free."""
    return all(n * t.element_size() % 16 == 0 for t in ts for n in t.shape[-2 if t.ndim == 3 else -1:])


def grouped_gemm(x: torch.Tensor, w: torch.Tensor, counts: list[int], spec: GemmSpec, keys=(0, 0, 0, 0),
                 qx: QTensor | None = None) -> torch.Tensor:
    """x [R, K] (rows grouped by expert, counts[e] each) times W [E, N, K] -> [R, N] in x's dtype.

    qx: x's NVFP4 QTensor when the caller already has it (`quantize_activation(x, spec)`
    or rows of one); used, and saved for the backward, instead of quantizing x.
    """
    if x.shape[0] != sum(counts):
        raise ValueError(f"x has {x.shape[0]} rows but counts sum to {sum(counts)}")
    if qx is not None and (spec.fmt != "nvfp4" or qx.fmt != "nvfp4" or qx.shape[0] != x.shape[0]):
        raise ValueError(f"qx ({qx.fmt} {list(qx.shape)}) must be an NVFP4 QTensor of x's {x.shape[0]} rows under an "
                         f"nvfp4 GemmSpec (got fmt {spec.fmt!r}); pass qx=None to quantize x here")
    return GroupedQGemm.apply(x, w, list(counts), spec, tuple(keys), qx)


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The autocast dtype if autocast is on for x's device, else x's own dtype."""
    dev = x.device.type
    if torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return x.dtype
