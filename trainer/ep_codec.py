"""Wire codecs of the expert-parallel all-to-alls: rows of a tensor packed to flat uint8 buffers and back.

    buf = pack_nvfp4(q)                         # dispatch: the tokens' NVFP4 QTensor, one row per token
    q2  = unpack_nvfp4(buf, hidden)             # bitwise the same QTensor on the expert's rank
    buf = encode_combine(o, "rht_s2f6", seed)   # combine: RHT (32-dim) then S2F6, E8M0 per 32
    z   = decode_combine(buf, "rht_s2f6", hidden, torch.float32)   # still in the RHT domain
    out = combine_output(sum_k w_k z_k, "rht_s2f6", seed)          # ONE inverse RHT after the weighted sum

Every buffer is uint8 [rows, row_bytes], so `all_to_all_single` splits it by
rows. Row layouts (H = hidden size, bits per value = 8 * row_bytes / H):

| what | row bytes | bits/value |
|---|---|---|
| dispatch nvfp4 | H/2 codes + H/16 E4M3 scales + 4 (fp32 per-token outer) | 4.5 + 32/H |
| dense (bf16 / compute dtype) | 2H (4H for fp32) | 16 (32) |
| combine / grad mxfp8 | H E4M3 + H/32 E8M0 | 8.25 |
| combine rht_s2f6 | H int8 + H/32 E8M0 | 8.25 |

Combine numerics (shared/docs/numerics.md, "RHT and S2F6 for the combine"):
z = deq(S2F6(rht(o, seed))) is in the RHT domain; since R is linear and
orthogonal, sum_k w_k Rᵀ z_k = Rᵀ sum_k w_k z_k, so the source rank sums in
that domain and applies `inverse_rht` once per token (`combine_output`). The
combine's gradient is the straight-through one: d o = d z @ Rᵀ
(`combine_grad_to_expert`), i.e. the quantization is ignored, the transform is not.
Error bound of one S2F6 row block (scale s = 2**e): |z - rht(o)| <= s/128
elementwise, and s < 2 * amax * 64/127, so ||z - rht(o)||_2 <= sqrt(32)/127 *
||o_block||_2 (`S2F6_REL_BOUND`): RHT keeps the L2 norm of every block of 32.

Leaves out: de-duplicating a token sent twice to one rank (top-k experts on
the same rank travel as separate rows, as in the single-process grouping),
fused Triton encoders (the reference composes quantize + views), NaN/Inf
(S2F6 refuses them with a ValueError).
"""

from __future__ import annotations

import math

import torch

from rl4bit.kernels import QTensor, dequantize, inverse_rht, quantize, rht

COMBINES = ("rht_s2f6", "mxfp8", "bf16")
"""Combine formats (cfg.trainer.combine)."""

GRAD_FORMATS = ("bf16", "mxfp8")
"""Formats of the backward all-to-alls (see rl4bit.trainer.expert_parallel)."""

S2F6_REL_BOUND = math.sqrt(32) / 127
"""||decode(encode(o)) - o||_2 <= S2F6_REL_BOUND * ||o||_2 per block of 32 (rht_s2f6, before fp32 rounding)."""


def check_format(name: str, fmt: str, valid) -> None:
    if fmt not in valid:
        raise ValueError(f"{name} {fmt!r} is not one of {valid}; set it to one of them "
                         "(cfg.trainer.combine for the combine)")


def _check_hidden(hidden: int, block: int, what: str) -> None:
    if hidden % block:
        raise ValueError(
            f"{what}: hidden size {hidden} is not a multiple of {block}; expert parallelism needs it "
            f"(pad the hidden size to {-(-hidden // block) * block} or run without expert_parallel)"
        )


# ---------------------------------------------------------------- row packing


def pack_rows(parts: list[torch.Tensor]) -> torch.Tensor:
    """Tensors with the same leading dim R -> uint8 [R, sum of their row bytes] (bytes concatenated per row)."""
    rows = parts[0].shape[0]
    flat = [p.contiguous().reshape(rows, p[0].numel() if rows else math.prod(p.shape[1:])).view(torch.uint8)
            for p in parts]
    return torch.cat(flat, dim=1) if len(flat) > 1 else flat[0]


def unpack_rows(buf: torch.Tensor, layout: list[tuple[torch.dtype, int]]) -> list[torch.Tensor]:
    """uint8 [R, B] -> [R, n] tensors for each (dtype, n) of `layout`, in order; B must match exactly."""
    want = sum(n * torch.empty((), dtype=dt).element_size() for dt, n in layout)
    if buf.dim() != 2 or buf.dtype != torch.uint8 or buf.shape[1] != want:
        raise ValueError(f"unpack_rows: expected a uint8 [R, {want}] buffer, got {buf.dtype} {tuple(buf.shape)}")
    out, start = [], 0
    for dt, n in layout:
        nb = n * torch.empty((), dtype=dt).element_size()
        out.append(buf[:, start : start + nb].contiguous().view(dt))
        start += nb
    return out


# ---------------------------------------------------------------- dispatch: NVFP4 rows, or dense rows


def dispatch_row_bytes(hidden: int) -> int:
    """Bytes per token row of the NVFP4 dispatch: codes, E4M3 block scales, fp32 outer."""
    return hidden // 2 + hidden // 16 + 4


def pack_nvfp4(q: QTensor) -> torch.Tensor:
    """NVFP4 QTensor [R, H] with a per-row outer ([R, 1]) -> uint8 [R, H/2 + H/16 + 4]."""
    if q.fmt != "nvfp4" or len(q.shape) != 2:
        raise ValueError(f"pack_nvfp4 expects a 2D NVFP4 QTensor, got {q!r}")
    rows = q.shape[0]
    outer = q.outer.reshape(-1, 1).float()
    if outer.shape[0] != rows:
        if outer.shape[0] != 1:
            raise ValueError(f"pack_nvfp4: outer of shape {tuple(q.outer.shape)} is neither per row nor per tensor")
        outer = outer.expand(rows, 1)
    return pack_rows([q.data, q.scale.view(torch.uint8), outer])


def unpack_nvfp4(buf: torch.Tensor, hidden: int) -> QTensor:
    """Inverse of pack_nvfp4: the same codes, scales and per-row outer, bitwise."""
    _check_hidden(hidden, 32, "nvfp4 dispatch")
    data, scale, outer = unpack_rows(buf, [(torch.uint8, hidden // 2), (torch.uint8, hidden // 16), (torch.float32, 1)])
    return QTensor(data=data, scale=scale.view(torch.float8_e4m3fn), outer=outer, fmt="nvfp4",
                   shape=torch.Size([buf.shape[0], hidden]))


def gather_rows(q: QTensor, index: torch.Tensor) -> QTensor:
    """Rows `index` of a 2D per-row-outer QTensor (quantizing is row-local, so this equals quantizing x[index])."""
    outer = q.outer.reshape(-1, 1)
    outer = outer[index] if outer.shape[0] == q.shape[0] else outer.expand(index.numel(), 1)
    return QTensor(data=q.data[index], scale=q.scale[index], outer=outer, fmt=q.fmt,
                   shape=torch.Size([index.numel(), q.shape[1]]))


def pack_dense(x: torch.Tensor) -> torch.Tensor:
    """[R, H] in its own dtype -> uint8 [R, H * itemsize] (lossless)."""
    return pack_rows([x])


def unpack_dense(buf: torch.Tensor, dtype: torch.dtype, hidden: int) -> torch.Tensor:
    return unpack_rows(buf, [(dtype, hidden)])[0]


# ---------------------------------------------------------------- combine and gradients


def combine_row_bytes(fmt: str, hidden: int) -> int:
    """Bytes per row of a combine (or backward) buffer in `fmt`."""
    check_format("combine format", fmt, COMBINES)
    return 2 * hidden if fmt == "bf16" else hidden + hidden // 32


def bits_per_value(row_bytes: int, hidden: int) -> float:
    return 8.0 * row_bytes / hidden


def _encode_blocks(t: torch.Tensor, fmt: str) -> torch.Tensor:
    q = quantize(t, fmt)
    return pack_rows([q.data.view(torch.uint8), q.scale.view(torch.uint8)])


def _decode_blocks(buf: torch.Tensor, fmt: str, hidden: int) -> torch.Tensor:
    data, scale = unpack_rows(buf, [(torch.uint8, hidden), (torch.uint8, hidden // 32)])
    elem = torch.float8_e4m3fn if fmt == "mxfp8" else torch.int8
    ones = torch.ones(1, 1, dtype=torch.float32, device=buf.device)
    q = QTensor(data=data.view(elem), scale=scale.view(torch.float8_e8m0fnu), outer=ones, fmt=fmt,
                shape=torch.Size([buf.shape[0], hidden]))
    return dequantize(q, torch.float32)


def encode_combine(o: torch.Tensor, fmt: str, seed: int | None = None) -> torch.Tensor:
    """Expert outputs o [R, H] -> uint8 [R, combine_row_bytes(fmt, H)]; rht_s2f6 needs the RHT seed."""
    check_format("combine format", fmt, COMBINES)
    hidden = o.shape[-1]
    if fmt == "bf16":
        return pack_dense(o.to(torch.bfloat16))
    _check_hidden(hidden, 32, f"{fmt} combine")
    if o.shape[0] == 0:
        return torch.empty(0, combine_row_bytes(fmt, hidden), dtype=torch.uint8, device=o.device)
    if fmt == "mxfp8":
        return _encode_blocks(o, "mxfp8")
    if seed is None:
        raise ValueError("encode_combine: rht_s2f6 needs the RHT seed (the same one the source rank decodes with)")
    return _encode_blocks(rht(o, seed), "s2f6")


def decode_combine(buf: torch.Tensor, fmt: str, hidden: int, dtype: torch.dtype) -> torch.Tensor:
    """uint8 rows -> values [R, H]. rht_s2f6: fp32 in the RHT domain (apply combine_output after the sum);
    bf16 / mxfp8: the decoded expert outputs as `dtype` (exact: bf16 and E4M3 x 2^k values fit `dtype` >= bf16)."""
    check_format("combine format", fmt, COMBINES)
    if fmt == "bf16":
        return unpack_dense(buf, torch.bfloat16, hidden).to(dtype)
    if buf.shape[0] == 0:
        return torch.empty(0, hidden, dtype=torch.float32 if fmt == "rht_s2f6" else dtype, device=buf.device)
    z = _decode_blocks(buf, "s2f6" if fmt == "rht_s2f6" else "mxfp8", hidden)
    return z if fmt == "rht_s2f6" else z.to(dtype)


def combine_output(acc: torch.Tensor, fmt: str, seed: int | None = None) -> torch.Tensor:
    """The routing-weighted sum of decoded rows back in the model's domain: one inverse RHT for rht_s2f6."""
    check_format("combine format", fmt, COMBINES)
    return inverse_rht(acc, seed) if fmt == "rht_s2f6" else acc


def combine_grad_to_expert(dz: torch.Tensor, fmt: str, seed: int | None = None) -> torch.Tensor:
    """Straight-through gradient of decode(encode(o)) wrt o: dz @ Rᵀ for rht_s2f6 (fp32), dz otherwise."""
    check_format("combine format", fmt, COMBINES)
    if fmt != "rht_s2f6" or dz.shape[0] == 0:
        return dz
    return inverse_rht(dz, seed)


def encode_grad(g: torch.Tensor, fmt: str) -> torch.Tensor:
    """A gradient [R, H] for a backward all-to-all: "bf16" or "mxfp8" (RCEIL, nearest)."""
    check_format("backward format", fmt, GRAD_FORMATS)
    return encode_combine(g, fmt)


def decode_grad(buf: torch.Tensor, fmt: str, hidden: int, dtype: torch.dtype) -> torch.Tensor:
    check_format("backward format", fmt, GRAD_FORMATS)
    return decode_combine(buf, fmt, hidden, dtype)


def sqnr_db(ref: torch.Tensor, approx: torch.Tensor) -> float:
    """10 log10(||ref||^2 / ||ref - approx||^2) in fp64; inf when equal."""
    ref, approx = ref.double(), approx.double()
    noise = (ref - approx).pow(2).sum().item()
    return math.inf if noise == 0 else 10.0 * math.log10(ref.pow(2).sum().item() / noise)
