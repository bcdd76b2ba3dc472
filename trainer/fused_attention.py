"""Qwen3-style attention with its per-head q/k RMSNorms and rotary embedding in one kernel (CUDA).

    fuse_attention(module)     # by `trainer.surgery.convert_model`, for trainer and samplers alike

HF's Qwen3 / Qwen3-MoE attention runs q_norm, k_norm and `apply_rotary_pos_emb`
between its projections and the attention function: with the norms fused, two
norm kernels and ten small elementwise kernels (products, negations, two
`cat`s, sums) per layer, a tenth of a batch-1 decode step's launches. The
replacement forward is HF's own with that stretch done by
`kernels.qk_rope_triton` (one launch, the same bits as the fused norms followed
by HF's rotary ops: tested), the q, k and v projections as one GEMM over their
stacked weights (`projections`: plain linears only; the engine keeps the three
weights as views of one tensor, `pack_qkv`, so serving stacks nothing), and the
rest untouched: the configured attention function (the engine's, the trainer's
or HF's), o_proj. A forward that needs gradients (training) runs the kernel and
the stacked GEMM too (`_QKNormRope`, whose backward differentiates HF's ops), so
the training forward, the trainer's logprob recompute and the samplers run the
same forward bits by construction.

`fuse_attention` installs it only where the q/k norms are fused HF RMSNorms
(`rmsnorm.fuse_norm` checked their formula on a random weight) and the
replacement reproduces the module's forward bitwise: on a probe (a copy of the
module, every kernel off, HF's eager attention, full-width rotary) the
replacement's own path of torch ops (`reference`) must equal the original
forward; another layout (OLMoE's norm over all heads, no q/k norm, Gemma's
norms) keeps HF's forward. At run time it takes the kernel when the fused
kernels are on for the tensors' device (`kernels.fused`), no KV cache object
is passed, position embeddings are given and span the whole head (partial
rotary: HF's forward), and shapes and dtypes suit the kernel; else HF's
forward, decided the same way in every pass.

Leaves out: attention modules of other families (their forwards stay HF's).
"""

from __future__ import annotations

import functools
import sys

import torch
from torch import nn

from rl4bit.kernels import fused


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def reference(q, k, q_norm: nn.Module, k_norm: nn.Module, cos, sin):
    """What HF's forward runs between projections and attention, as torch ops (the norms through their own
    modules: fused norms when those are on), on q [B, T, Hq, D] and k [B, T, Hkv, D], cos/sin [B, T, D]."""
    q, k = q_norm(q), k_norm(k)
    c, s = cos.unsqueeze(2), sin.unsqueeze(2)
    return q * c + _rotate_half(q) * s, k * c + _rotate_half(k) * s


class _QKNormRope(torch.autograd.Function):
    """The kernel's forward; the backward differentiates HF's ops (`rmsnorm.reference` + the rotation),
    recomputed from the saved inputs: right gradients, and every pass runs the same forward bits."""

    @staticmethod
    def forward(ctx, q, k, wq, wk, cos, sin, eps_q, eps_k):
        from rl4bit.kernels.qk_rope_triton import qk_norm_rope

        ctx.save_for_backward(q, k, wq, wk, cos, sin)
        ctx.eps = (eps_q, eps_k)
        return qk_norm_rope(q, k, wq, wk, eps_q, eps_k, cos, sin)

    @staticmethod
    def backward(ctx, dq, dk):
        from rl4bit.kernels.rmsnorm import reference as rms

        saved = ctx.saved_tensors
        need = ctx.needs_input_grad[:4]
        with torch.enable_grad():
            q, k, wq, wk = (t.detach().requires_grad_(n) for t, n in zip(saved[:4], need))
            c, s = saved[4].unsqueeze(2), saved[5].unsqueeze(2)
            qn, kn = rms(q, wq, ctx.eps[0]), rms(k, wk, ctx.eps[1])
            outs = (qn * c + _rotate_half(qn) * s, kn * c + _rotate_half(kn) * s)
        wanted = [t for t, n in zip((q, k, wq, wk), need) if n]
        pairs = [(o, g) for o, g in zip(outs, (dq, dk)) if o.requires_grad]  # a side with no input needing grad
        grads = iter(torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs], allow_unused=True))
        return (*(next(grads) if n else None for n in need), None, None, None, None)


def _kernel_ok(module, cos) -> bool:
    """Whether the kernel covers this layer and call: even head dim <= 1024, full-width rotary, float norm
    weights and cos/sin. Decided before the projections, from shapes and dtypes alone (the same in every pass)."""
    d = module.head_dim
    floats = (torch.float32, torch.bfloat16, torch.float16)
    return (d % 2 == 0 and d <= 1024 and cos.shape[-1] == d and cos.dtype in floats
            and all(n.weight.dtype in floats for n in (module.q_norm, module.k_norm)))


def _forward(module: nn.Module, orig_forward, eager, hidden_states, position_embeddings, attention_mask, *args,
             use_reference: bool = False, **kwargs):
    cache = kwargs.get("past_key_values", kwargs.get("cache"))
    if (args or cache is not None or position_embeddings is None
            or not (use_reference or fused.enabled(hidden_states.device.type))):
        return orig_forward(hidden_states, position_embeddings, attention_mask, *args, **kwargs)
    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, module.head_dim)
    cos, sin = position_embeddings
    if cos.shape[-1] != module.head_dim or not (use_reference or _kernel_ok(module, cos)):
        return orig_forward(hidden_states, position_embeddings, attention_mask, *args, **kwargs)  # partial rotary &c.
    if use_reference:
        q, k, v = (p(hidden_states) for p in (module.q_proj, module.k_proj, module.v_proj))
    else:
        q, k, v = projections(module, hidden_states)
    q, k, v_rows = q.view(hidden_shape), k.view(hidden_shape), v.view(hidden_shape)
    v = v_rows.transpose(1, 2)
    if use_reference:
        q, k = reference(q, k, module.q_norm, module.k_norm, cos, sin)
    else:
        wq, wk = module.q_norm.weight, module.k_norm.weight
        eq, ek = module.q_norm.variance_epsilon, module.k_norm.variance_epsilon
        if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, wq, wk)):
            q, k = _QKNormRope.apply(q, k, wq, wk, cos, sin, eq, ek)
        else:
            from rl4bit.kernels.qk_rope_triton import qk_norm_rope

            cache = _engine_cache(module, kwargs.get("rl4bit_step"), q, k, v_rows)
            q, k = qk_norm_rope(q, k, wq, wk, eq, ek, cos, sin, cache=cache)
            if cache is not None:
                kwargs["rl4bit_kv_written"] = True  # engine_attention skips its cache write
    kwargs.pop("past_key_values", None)
    kwargs.pop("cache", None)
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    attention = ALL_ATTENTION_FUNCTIONS.get_interface(module.config._attn_implementation, eager)
    out, weights = attention(module, q.transpose(1, 2), k.transpose(1, 2), v, attention_mask,
                             dropout=0.0 if not module.training else module.attention_dropout, scaling=module.scaling,
                             sliding_window=getattr(module, "sliding_window", None), **kwargs)
    return module.o_proj(out.reshape(*input_shape, -1).contiguous()), weights


def _engine_cache(module: nn.Module, step, q, k, v_rows) -> tuple | None:
    """(v, kc, vc, slot, pos) for `qk_norm_rope(cache=)` when this forward is the embedded engine's (its
    `rl4bit_step` kwarg) and its attention takes the kernel path, which then skips its own cache write
    (`sampler.kv_cache.engine_attention`); else None."""
    if step is None or q.shape[0] != 1:
        return None
    from rl4bit.kernels.attention import fused_attention_ok

    kc, vc = step.cache.k[module.layer_idx], step.cache.v[module.layer_idx]
    if not fused_attention_ok(q.transpose(1, 2), k.transpose(1, 2), v_rows.transpose(1, 2), kc.dtype):
        return None
    return v_rows, kc, vc, step.token_slot, step.token_pos


def _stackable(lins) -> bool:
    """Plain `nn.Linear`s (not subclasses: QuantLinear has its own GEMM) over one input, weights of one dtype and
    device, all with a bias or none."""
    if not all(type(lin) is nn.Linear and "forward" not in vars(lin) and not lin._forward_hooks
               and not lin._forward_pre_hooks for lin in lins):
        return False  # a hooked or replaced forward would be skipped by the stacked GEMM
    w = [lin.weight for lin in lins]
    b = [lin.bias for lin in lins]
    same = all(t.dtype == w[0].dtype and t.device == w[0].device and t.shape[1] == w[0].shape[1] for t in w)
    return same and (all(t is None for t in b) or all(t is not None and t.dtype == b[0].dtype for t in b))


def _packed(tensors, base: torch.Tensor | None) -> bool:
    """Whether `tensors` are, in order, the consecutive row blocks of `base` (what `pack_qkv` left)."""
    if base is None:
        return False
    at = base.data_ptr()
    for t in tensors:
        if t.dtype != base.dtype or t.data_ptr() != at or not t.is_contiguous():
            return False
        at += t.numel() * t.element_size()
    return at == base.data_ptr() + base.numel() * base.element_size()


def projections(module: nn.Module, x: torch.Tensor):
    """q, k, v of x: one GEMM over the three projections stacked along N, when they are plain linears of one dtype.

    A decode step's three small GEMMs are mostly launch and latency; one GEMM over the stacked [Nq + Nk + Nv, K]
    weight reads the same bytes in one
    launch. The stacked weight is the tensor `pack_qkv` made the three weights views of (serving: no copy),
    else a `torch.cat` of them (training: the gradients reach each weight through it). Every path of this
    forward (training, the trainer's recompute, the samplers) takes it, so they share the GEMM and its shape;
    against three separate GEMMs an output element is the same K sum in exact arithmetic, rounded by
    another kernel. Otherwise (quantized projections, mixed dtypes): the three modules' own forwards."""
    lins = (module.q_proj, module.k_proj, module.v_proj)
    if not _stackable(lins):
        return tuple(lin(x) for lin in lins)
    weights = [lin.weight for lin in lins]
    biases = [lin.bias for lin in lins] if lins[0].bias is not None else None
    wb, bb = getattr(module, "_rl4bit_qkv", (None, None))
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in weights + (biases or []))
    if wb is not None and not _packed(weights, wb):
        del module._rl4bit_qkv  # a weight was replaced (or moved): the stack is stale, let its memory go
        wb = bb = None
    w = wb if not grad and wb is not None else torch.cat(weights)
    b = None
    if biases is not None:
        b = bb if not grad and bb is not None and _packed(biases, bb) else torch.cat(biases)
    return torch.nn.functional.linear(x, w, b).split([t.shape[0] for t in weights], dim=-1)


def pack_qkv(model: nn.Module) -> list[str]:
    """Serving: the q/k/v weights (and biases) of each fused attention become views of one stacked tensor, so
    `projections` runs one GEMM without a copy; names of the packed modules.

    In place, new Parameters (requires_grad False: serving only; do not share the model with a trainer).
    Updates that copy into the weights (`EmbeddedEngine.update_weights`) write the stacked tensor through the
    views; anything that replaces or moves a weight ends the packing (`projections` then drops the stack and
    concatenates). The state dict holds views of one storage: clone before `safetensors.save_file`."""
    done = []
    for name, m in model.named_modules():
        if not getattr(m, "_rl4bit_fused_attention", False):
            continue
        lins = (m.q_proj, m.k_proj, m.v_proj)
        if not _stackable(lins):
            continue
        done.append(name)
        if _packed([lin.weight for lin in lins], getattr(m, "_rl4bit_qkv", (None,))[0]):
            continue  # packed already (another engine over this model): its captured graphs read this stack
        stacked = []
        for part in ("weight", "bias"):
            if getattr(lins[0], part) is None:
                stacked.append(None)
                continue
            base = torch.cat([getattr(lin, part).detach() for lin in lins])
            at = 0
            for lin in lins:
                n = getattr(lin, part).shape[0]
                setattr(lin, part, nn.Parameter(base[at:at + n], requires_grad=False))
                at += n
            stacked.append(base)
        m._rl4bit_qkv = tuple(stacked)
    return done


_NEEDS = ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm", "head_dim", "scaling", "config")


def reproduces(module: nn.Module) -> bool:
    """True when the replacement's torch-op path equals `module.forward` bitwise on a probe (see module doc),
    run on a copy of the module (its projections' call counters, which key stochastic rounding, stay as
    they are) whose q/k norms are fused HF RMSNorms (`rmsnorm.fuse_norm` checked their formula)."""
    import copy

    if not all(hasattr(module, a) for a in _NEEDS) or _eager(module) is None:
        return False
    if not all(getattr(n, "_rl4bit_fused_norm", False) for n in (module.q_norm, module.k_norm)):
        return False
    w = module.q_proj.weight
    if w is None or w.device.type == "meta":
        return False
    copy_ = copy.deepcopy(module)
    d = copy_.head_dim
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 5, w.shape[1], generator=g).to(w.dtype).to(w.device)
    angle = torch.arange(5.0)[:, None] * torch.linspace(0.1, 1.0, d)[None]
    cos, sin = angle.cos()[None].to(x), angle.sin()[None].to(x)
    copy_.config._attn_implementation = "eager"  # the copy's own config
    try:
        with torch.no_grad(), fused.disabled():
            want = copy_.forward(x, (cos, sin), None)
            got = _forward(copy_, copy_.forward, _eager(copy_), x, (cos, sin), None, use_reference=True)
    except Exception:  # noqa: BLE001 - a forward of another shape or signature is not the one this replaces
        return False
    return all(isinstance(a, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b) for a, b in
               ((got[0], want[0]), (got[1], want[1])))


def _eager(module: nn.Module):
    """The module's own family's `eager_attention_forward` (the default HF falls back to), or None."""
    return getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)


def fuse_attention(module: nn.Module) -> bool:
    """Route `module`'s forward through `_forward` if it reproduces it (see `reproduces`); idempotent."""
    if getattr(module, "_rl4bit_fused_attention", False):
        return True
    if not type(module).__name__.endswith("Attention") or not reproduces(module):
        return False
    module.forward = functools.partial(_forward, module, module.forward, _eager(module))
    module._rl4bit_fused_attention = True
    return True


def fuse_attentions(model: nn.Module) -> list[str]:
    """`fuse_attention` on every module of `model`; returns the names of the fused ones."""
    return [name for name, m in model.named_modules() if fuse_attention(m)]
