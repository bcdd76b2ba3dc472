"""Expert parallelism: a converted MoE experts module sharded over a process group, tokens moved by all-to-all.

    group = dist.new_group(...)                    # the EP ranks (size cfg.trainer.expert_parallel); None = default
    group
    shard_experts(model, group, combine=cfg.trainer.combine)   # after surgery.convert_model, before the optimizer
    loss.backward(); metrics.update(comm_metrics(model))        # {"comm/dispatch_bytes": ..., ...}

Every rank holds its own tokens and experts [r*E/N, (r+1)*E/N) of each MoE layer (`gate_up_proj` / `down_proj`
become those local slices, names kept). A forward routes, dispatches the tokens to their experts' owners (NVFP4
layers as their NVFP4 QTensor, quantized once), runs the grouped GEMMs there and combines the outputs back
(`ExpertParallelExperts` has the steps). Forward bitwise one process's with a bf16 combine; backward too
without stochastic rounding (with it: the same distribution, other draws). Readers of the full model use
`full_experts` / `full_expert_state`; `expert_params` gives the global shapes for sharded checkpoints.

Leaves out: capacity limits / token dropping, overlapping communication with compute, de-duplicating a token
sent twice to one rank, serving mode (load_quantized), EP groups smaller than the data-parallel group (2D meshes)."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from rl4bit.kernels import NonFiniteInputError, QTensor
from rl4bit.kernels.philox import derive_seed
from rl4bit.trainer import ep_codec
from rl4bit.trainer.combine import combine
from rl4bit.trainer.fused_swiglu import swiglu
from rl4bit.trainer.modules import QuantExperts
from rl4bit.trainer.qgemm import compute_dtype, grouped_gemm, quantize_activation

COMBINE_TENSOR_ID = 4
"""tensor_id of the combine's RHT seed in derive_seed (qgemm uses 0..3)."""

HEADER = ("hidden size", "local experts", "expert format", "combine", "backward format", "layer", "step", "call",
          "seed", "non-finite tokens")
"""What each rank states before a layer's tokens move (`ExpertParallelExperts._route`): the ranks must agree on all
but the last, which any rank may raise for all."""

_FMT_CODES = {"bf16": 0, "mxfp8": 1, "nvfp4": 2}

PHASES = ("dispatch", "combine", "combine_grad", "dispatch_grad")
"""Metric names: forward dispatch (source->owner), forward combine (owner->source), then the backward's."""


class CommMeter:
    """Bytes each all-to-all of this rank sends, by phase: all of it, and the part that leaves the rank."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.sent = {p: 0 for p in PHASES}
        self.remote = {p: 0 for p in PHASES}
        self.values = {p: 0 for p in PHASES}
        self.routing = 0

    def add(self, phase: str, row_bytes: int, splits: list[int], rank: int, hidden: int) -> None:
        rows = sum(splits)
        self.sent[phase] += rows * row_bytes
        self.remote[phase] += (rows - splits[rank]) * row_bytes
        self.values[phase] += rows * hidden

    def metrics(self) -> dict:
        """{"comm/<phase>_bytes": payload bytes sent to other ranks, "..._bits_per_value", "..._bf16_bytes": BF16
        baseline}."""
        out = {}
        for p in PHASES:
            out[f"comm/{p}_bytes"] = self.remote[p]
            out[f"comm/{p}_bf16_bytes"] = 2 * self.values[p] * (self.remote[p] / self.sent[p] if self.sent[p] else 0)
            out[f"comm/{p}_bits_per_value"] = 8.0 * self.sent[p] / self.values[p] if self.values[p] else 0.0
        out["comm/routing_bytes"] = self.routing
        return out


@dataclass
class _Route:
    """Who sends what where, for one forward of one layer (identical use in its backward)."""

    order: torch.Tensor  # [R_send] flat (token, k) indices sorted by expert
    tok: torch.Tensor  # [R_send] token of each sorted row
    send_splits: list[int]  # rows to each rank
    recv_splits: list[int]  # rows from each rank
    perm: torch.Tensor  # [R_recv] expert-major row i = received row perm[i]
    local_counts: list[int]  # rows per local expert, expert-major


def _exclusive_cumsum(c: torch.Tensor) -> torch.Tensor:
    return torch.cumsum(c, 0) - c


def _a2a(buf: torch.Tensor, send: list[int], recv: list[int], group) -> torch.Tensor:
    out = buf.new_empty(sum(recv), *buf.shape[1:])
    dist.all_to_all_single(out, buf.contiguous(), output_split_sizes=recv, input_split_sizes=send, group=group)
    return out


class _Dispatch(torch.autograd.Function):
    """x rows (source order) -> the owner's rows (expert-major). NVFP4: returns a placeholder and puts the QTensor in
    `box`."""

    @staticmethod
    def forward(ctx, x, q_rows, layer, route, box):
        ctx.layer, ctx.route, ctx.x_dtype = layer, route, x.dtype
        hidden = x.shape[1]
        nvfp4 = layer.spec.fmt == "nvfp4"
        if not nvfp4:
            buf = ep_codec.pack_dense(x.detach())
        elif q_rows is not None:
            buf = ep_codec.pack_nvfp4(q_rows)
        else:  # no rows to send; every rank must still agree on the row width
            buf = x.new_empty(0, ep_codec.dispatch_row_bytes(hidden), dtype=torch.uint8)
        layer.meter.add("dispatch", buf.shape[1], route.send_splits, layer.rank, hidden)
        got = _a2a(buf, route.send_splits, route.recv_splits, layer.group)[route.perm]
        if nvfp4:
            box["q"] = ep_codec.unpack_nvfp4(got, hidden)
            return x.new_zeros(()).expand(got.shape[0], hidden)
        return ep_codec.unpack_dense(got, x.dtype, hidden)

    @staticmethod
    def backward(ctx, dx_local):
        layer, route = ctx.layer, ctx.route
        hidden = dx_local.shape[1]
        back = torch.empty_like(dx_local)
        back[route.perm] = dx_local  # expert-major -> received order
        buf = ep_codec.encode_grad(back, layer.backward_format)
        layer.meter.add("dispatch_grad", buf.shape[1], route.recv_splits, layer.rank, hidden)
        got = _a2a(buf, route.recv_splits, route.send_splits, layer.group)
        return ep_codec.decode_grad(got, layer.backward_format, hidden, ctx.x_dtype), None, None, None, None


class _Combine(torch.autograd.Function):
    """Owner's expert outputs (expert-major) -> decoded rows on the source (its sorted order; RHT domain for
    rht_s2f6)."""

    @staticmethod
    def forward(ctx, o, layer, route, seed, out_dtype):
        ctx.layer, ctx.route, ctx.seed, ctx.o_dtype = layer, route, seed, o.dtype
        hidden = o.shape[1]
        back = torch.empty_like(o)
        back[route.perm] = o.detach()
        failure = None
        try:
            buf = ep_codec.encode_combine(back, layer.combine, seed)
        except NonFiniteInputError as e:  # NaN/Inf in o, or the RHT's sums overflowing: raised below, on every rank
            failure = e
        layer._stop_together(failure, o)
        layer.meter.add("combine", buf.shape[1], route.recv_splits, layer.rank, hidden)
        got = _a2a(buf, route.recv_splits, route.send_splits, layer.group)
        return ep_codec.decode_combine(got, layer.combine, hidden, out_dtype)

    @staticmethod
    def backward(ctx, dz):
        layer, route = ctx.layer, ctx.route
        hidden = dz.shape[1]
        g = ep_codec.combine_grad_to_expert(dz, layer.combine, ctx.seed)
        buf = ep_codec.encode_grad(g, layer.backward_format)
        layer.meter.add("combine_grad", buf.shape[1], route.send_splits, layer.rank, hidden)
        got = _a2a(buf, route.send_splits, route.recv_splits, layer.group)[route.perm]
        return ep_codec.decode_grad(got, layer.backward_format, hidden, ctx.o_dtype), None, None, None, None


class ExpertParallelExperts(QuantExperts):
    """A QuantExperts whose experts live on the ranks of `group`; forward moves tokens with all-to-all.

    One forward (same signature as `QuantExperts`: hidden [T, H], top_k_index [T, k], top_k_weights [T, k]):

    1. route: every rank states its layer's settings and whether its tokens hold NaN/Inf (`HEADER`, one small
       all-gather): a disagreement is a ValueError naming it, and NaN/Inf on any rank stops the micro-batch on
       every rank before any payload moves (a rank that raised alone would leave the others waiting in the next
       all-to-all). The (token, k) pairs are sorted by expert as in QuantExperts (stable argsort), which groups
       them by owner rank; the per-expert counts go out in a small int64 all-to-all.
    2. dispatch (source -> owner): NVFP4 layers send the tokens' NVFP4 QTensor, quantized once per token; the
       owner's gate_up GEMM consumes and saves exactly that QTensor. MXFP8 / BF16 layers send compute-dtype rows
       (their backward needs a columnwise MXFP8 x quantized from high precision).
    3. the owner reorders received rows expert-major (source rank order inside an expert: the order of one
       process running the concatenated batch) and runs the grouped GEMMs of rl4bit.trainer.qgemm.
    4. combine (owner -> source): `bf16`, `mxfp8` or `rht_s2f6` (ep_codec). First the ranks exchange one flag:
       NaN/Inf in a rank's expert outputs, or an error of its GEMMs or encoding, stops every rank there. The
       source decodes, multiplies by the routing weights, sums per token and, for rht_s2f6, applies the inverse
       RHT once after the sum.

    Backward (`backward=`, default "bf16"): the combine's gradient feeds the down GEMM, whose wgrad needs dY
    quantized to MXFP8 columnwise from high precision (TE mxfp8.rst), so it travels as BF16; the dispatch's
    gradient travels as BF16 too, so EP is bitwise one process with a bf16 combine. "mxfp8" sends both as MXFP8
    rows (half the bytes; an ablation): the combine gradient leaves the down GEMM's grads bitwise unchanged
    (E4M3 rounding commutes with power-of-two block scales), the dispatch gradient costs ~31 dB SQNR on d hidden.
    The rht_s2f6 combine's gradient is straight-through (ep_codec). Stochastic re-quantization draws its bits by
    flat position in the local tensors, with call key calls * world + rank so ranks do not share streams.
    The local expert slices are FSDP2's `ignored_params`; their gradients are complete as autograd leaves them.
    """

    def __init__(self, src: QuantExperts, group=None, combine: str = "rht_s2f6", backward: str = "bf16"):
        nn.Module.__init__(self)
        if src.served is not None:
            raise ValueError("shard_experts: this experts module is in serving mode; shard the training model instead")
        ep_codec.check_format("combine", combine, ep_codec.COMBINES)
        ep_codec.check_format("backward format", backward, ep_codec.GRAD_FORMATS)
        self.group = group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        e = src.num_experts
        if e % self.world:
            raise ValueError(
                f"shard_experts: {e} experts do not split over {self.world} ranks; "
                f"set trainer.expert_parallel to a divisor of {e}"
            )
        n_local = e // self.world
        self.first_expert, self.global_num_experts = self.rank * n_local, e
        sl = slice(self.first_expert, self.first_expert + n_local)
        self.gate_up_proj = nn.Parameter(src.gate_up_proj.detach()[sl].clone(),
                                         requires_grad=src.gate_up_proj.requires_grad)
        self.down_proj = nn.Parameter(src.down_proj.detach()[sl].clone(), requires_grad=src.down_proj.requires_grad)
        self.act_fn = src.act_fn
        self.num_experts = n_local
        # the GLOBAL shapes [E, ...]: what the weight sync / export layout describes (the parameters are the slices)
        self.expert_weight_shapes = dict(src.expert_weight_shapes)
        self._init_quant(src.spec, src.seed, src.layer_id)
        self.combine, self.backward_format = combine, backward
        self.meter = CommMeter()
        self._full: dict | None = None  # set inside full_experts(): the gathered weights

    def quantized_weights(self) -> dict:
        """{param name: QTensor} of ALL experts (all ranks must call it: an all-gather of the local QTensors).

        Quantization is per expert (NVFP4 outer="group", MXFP8 blocks along K), so
        this rank's slice quantizes to exactly the rows of the full tensor's QTensor:
        the gathered QTensors equal one process's bitwise for the same masters.
        """
        if self._full is not None and self.spec.fmt != "bf16":
            return {k: v for k, v in self._full.items() if isinstance(v, QTensor)}
        return {k: gather_qtensor(q, self.group) for k, q in super().quantized_weights().items()}

    def _keys(self, gemm: int) -> tuple[int, int, int, int]:
        # world 1 gives QuantExperts' own keys; the RHT seed below is NOT keyed by rank (both ends must agree)
        return (self.seed, self.step, 2 * self.layer_id + gemm, self.calls * self.world + self.rank)

    def _header(self, tokens: torch.Tensor) -> torch.Tensor:
        """int64 [len(HEADER)] on the device: what every rank must agree on before tokens move, and whether this
        rank's tokens hold NaN/Inf (a device reduction; the all-gathered headers are read on the host once).
        `tokens` are the hidden states in the compute dtype, as they are dispatched: a value finite in FP32 but
        past BF16's range becomes Inf there, and the dispatch's quantize would raise on this rank alone."""
        fields = [tokens.shape[-1], self.num_experts, _FMT_CODES[self.spec.fmt],
                  ep_codec.COMBINES.index(self.combine), ep_codec.GRAD_FORMATS.index(self.backward_format),
                  self.layer_id, self.step, self.calls, self.seed & (2**62 - 1), 0]
        head = torch.tensor(fields, dtype=torch.int64, device=tokens.device)
        head[-1] = (~torch.isfinite(tokens)).any().to(torch.int64)
        return head

    def _check_headers(self, heads: torch.Tensor) -> None:
        """ValueError naming what the ranks disagree on; NonFiniteInputError on EVERY rank when any rank's tokens
        hold NaN/Inf: all raise at the same point, before any payload all-to-all, so none waits on the others."""
        rows = heads.tolist()
        for i, name in enumerate(HEADER[:-1]):
            values = [r[i] for r in rows]
            if len(set(values)) > 1:
                raise ValueError(f"expert parallelism, layer {self.layer_id}: the ranks disagree on {name} "
                                 f"({', '.join(f'rank {r}: {v}' for r, v in enumerate(values))}); every rank must "
                                 f"build the same model and recipe and run the same steps")
        bad = [r for r, row in enumerate(rows) if row[-1]]
        if bad:
            raise NonFiniteInputError(f"NaN/Inf in the hidden states entering expert layer {self.layer_id} on "
                                      f"rank(s) {bad} (in the compute dtype, as dispatched); every rank stops this "
                                      f"micro-batch")

    def _stop_together(self, failure: Exception | None, o: torch.Tensor | None) -> None:
        """Before the combine's all-to-all: NonFiniteInputError on EVERY rank when any rank's experts or combine
        encoding raised one or produced NaN/Inf (one int64 all-gather), so no rank is left waiting in the
        all-to-all; a rank that raised re-raises its own error, the others name it."""
        dev = self.gate_up_proj.device
        mine = (torch.ones(1, dtype=torch.int64, device=dev) if failure is not None
                else (~torch.isfinite(o.detach())).any().to(torch.int64).reshape(1))  # on the device: no host read
        flags = torch.zeros(self.world, dtype=torch.int64, device=dev)
        dist.all_gather_into_tensor(flags, mine, group=self.group)  # read once, below
        self.meter.routing += 8 * (self.world - 1)
        ranks = [r for r, f in enumerate(flags.tolist()) if f]
        if not ranks:
            return
        if failure is not None:
            failure.add_note(f"expert layer {self.layer_id}, rank {self.rank}: every rank stops this micro-batch")
            raise failure
        raise NonFiniteInputError(f"NaN/Inf in the outputs of expert layer {self.layer_id} on rank(s) {ranks} "
                                  f"(their experts' GEMMs overflowed or hold a NaN/Inf weight); every rank stops "
                                  f"this micro-batch")

    def _route(self, top_k_index: torch.Tensor, tokens: torch.Tensor) -> _Route:
        n_tok, k = top_k_index.shape
        e, n_local = self.global_num_experts, self.num_experts
        with torch.no_grad():
            head = self._header(tokens)
            heads = head.new_empty(self.world * head.numel())
            dist.all_gather_into_tensor(heads, head, group=self.group)  # fixed width: safe whatever ranks differ in
            self._check_headers(heads.view(self.world, -1).cpu())
            flat = top_k_index.reshape(-1)
            order = torch.argsort(flat, stable=True)
            counts = torch.bincount(flat, minlength=e + 1)[:e]
            order = order[: int(counts.sum())]  # drops the HF "not local" sentinel index == num_experts
            send = counts.reshape(self.world, n_local).to(torch.int64)
            recv = _a2a(send, [1] * self.world, [1] * self.world, self.group)  # [source, local expert]
            self.meter.routing += 8 * (n_local + len(HEADER)) * (self.world - 1)
            recv_flat = recv.reshape(-1).cpu()
            start_recv = _exclusive_cumsum(recv_flat).reshape(self.world, n_local).t().reshape(-1)
            by_expert = recv.t().reshape(-1).cpu()  # counts in expert-major order
            total = int(by_expert.sum())
            offs = torch.arange(total) - torch.repeat_interleave(_exclusive_cumsum(by_expert), by_expert)
            perm = (torch.repeat_interleave(start_recv, by_expert) + offs).to(top_k_index.device)
        return _Route(order=order, tok=order // k, send_splits=send.sum(1).tolist(), recv_splits=recv.sum(1).tolist(),
                      perm=perm, local_counts=recv.sum(0).tolist())

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor,
                residual: torch.Tensor | None = None) -> torch.Tensor:
        """QuantExperts.forward's contract over the expert-parallel group (the residual added with torch here)."""
        if self.served is not None:
            raise ValueError("ExpertParallelExperts has no serving mode; serve from a gathered, unsharded model")
        dt = compute_dtype(hidden_states)
        tokens = hidden_states.detach().to(dt)  # what is dispatched, checked for NaN/Inf by every rank's header
        route = self._route(top_k_index, tokens)
        x = hidden_states[route.tok].to(dt)  # the same gather as QuantExperts, so the gradient sums the same way
        nvfp4 = self.spec.fmt == "nvfp4"
        q_rows = None
        if nvfp4 and x.shape[0]:
            with torch.no_grad():  # one quantization per token (row-local, so equal to quantizing x's rows)
                q_rows = ep_codec.gather_rows(quantize_activation(tokens, self.spec), route.tok)
        box: dict = {}
        x_local = _Dispatch.apply(x, q_rows, self, route, box)
        counts = route.local_counts
        try:
            if sum(counts) == 0:  # no rows for my experts: keep the graph (zero weight grads), every backward meets
                o = x_local * 0 + (self.gate_up_proj.sum() + self.down_proj.sum()).to(x_local.dtype) * 0
            else:
                h = grouped_gemm(x_local, self.gate_up_proj, counts, self.spec, self._keys(0), qx=box.get("q"))
                o = grouped_gemm(swiglu(h, self.act_fn), self.down_proj, counts, self.spec, self._keys(1))
        except NonFiniteInputError as e:  # an overflow or a NaN weight on my experts: raised on every rank
            self._stop_together(e, None)  # (the others meet it in _Combine.forward)
        seed = derive_seed(self.seed, self.step, 2 * self.layer_id, COMBINE_TENSOR_ID, self.calls)
        z = _Combine.apply(o, self, route, seed, dt)
        w = top_k_weights.reshape(-1)[route.order, None]
        if self.combine == "rht_s2f6":  # sum in the RHT domain (fp32), one inverse RHT per token
            # each (token, k) row in its own slot, then added in k order, one add at a time: the same order on every
            # device and at every token count (an index_add adds a token's rows with atomics on CUDA, in whatever
            # order they land; a sum over k would leave the order to the reduction kernel)
            n_tok, k = top_k_index.shape
            slots = torch.zeros(n_tok * k, hidden_states.shape[1], dtype=torch.float32, device=hidden_states.device)
            slots = slots.index_put((route.order,), z * w.float()).view(n_tok, k, -1)
            acc = slots[:, 0]
            for j in range(1, k):
                acc = acc + slots[:, j]
            out = ep_codec.combine_output(acc, self.combine, seed).to(hidden_states.dtype)
        else:  # the exact combine of QuantExperts.forward (trainer/combine.py: the fixed-order kernel when fused)
            out = combine(z, top_k_weights, top_k_index, route.order, route.tok, None, hidden_states,
                          self.global_num_experts)
        self.calls += 1
        return out if residual is None else residual + out

    def extra_repr(self) -> str:
        return (f"{super().extra_repr()}, experts {self.first_expert}..{self.first_expert + self.num_experts - 1} "
                f"of {self.global_num_experts} on rank {self.rank}/{self.world}, combine={self.combine}, "
                f"backward={self.backward_format}")


def gather_experts(t: torch.Tensor, group=None) -> torch.Tensor:
    """All-gather the ranks' expert slices along dim 0 in rank order (bytes: any dtype, float8 included)."""
    world = dist.get_world_size(group)
    raw = t.detach().contiguous()
    raw = raw.view(torch.uint8) if raw.dim() else raw.reshape(1).view(torch.uint8)
    parts = [torch.empty_like(raw) for _ in range(world)]
    dist.all_gather(parts, raw, group=group)
    return torch.cat(parts).view(t.dtype)


def gather_qtensor(q: QTensor, group=None) -> QTensor:
    """A [E/N, N, K] QTensor slice per rank -> the [E, N, K] QTensor (per-expert NVFP4 outers gathered too)."""
    world = dist.get_world_size(group)
    outer = gather_experts(q.outer, group) if q.fmt == "nvfp4" else q.outer  # mxfp8/s2f6: one broadcast 1
    return QTensor(gather_experts(q.data, group), gather_experts(q.scale, group), outer, q.fmt,
                   (q.shape[0] * world, *q.shape[1:]))


@contextmanager
def full_experts(model: nn.Module, module_names=None):
    """Inside: the EP modules named (all when None) show ALL experts to readers (weight sync, export).

    `quantized_weights()` returns the gathered QTensors, and for dense (bf16 recipe)
    experts `module.gate_up_proj` / `down_proj` read as the gathered masters. Every
    rank must enter it with the same names (all-gathers). Training inside is an error
    of the caller: the parameters themselves stay the local slices.
    """
    mods = [(n, m) for n, m in model.named_modules() if isinstance(m, ExpertParallelExperts)
            and (module_names is None or n in set(module_names))]
    try:
        for _, m in mods:
            if m.spec.fmt == "bf16":
                m._full = {k: gather_experts(getattr(m, k), m.group) for k in m._param_names}
                m.__dict__.update(m._full)  # shadows the Parameter of the same name for attribute reads
            else:
                m._full = {k: gather_qtensor(q, m.group) for k, q in QuantExperts.quantized_weights(m).items()}
        yield
    finally:
        for _, m in mods:
            for k in m._param_names:
                m.__dict__.pop(k, None)
            m._full = None


def full_expert_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """{state-dict name: gathered [E, ...] master} of every EP parameter (a collective; rank order)."""
    out = {}
    for name, m in model.named_modules():
        if isinstance(m, ExpertParallelExperts):
            for k in m._param_names:
                out[f"{name}.{k}" if name else k] = gather_experts(getattr(m, k), m.group)
    return out


def expert_params(model: nn.Module) -> dict[str, tuple[nn.Parameter, tuple[int, ...]]]:
    """{parameter name: (local slice, global shape)} of the EP modules' expert parameters."""
    out = {}
    for name, m in model.named_modules():
        if isinstance(m, ExpertParallelExperts):
            for k in m._param_names:
                out[f"{name}.{k}" if name else k] = (getattr(m, k), tuple(m.expert_weight_shapes[k]))
    return out


def shard_experts(model: nn.Module, group=None, *, combine: str = "rht_s2f6", backward: str = "bf16") -> nn.Module:
    """Replace every QuantExperts of a converted model by its expert-parallel shard on this rank; returns model.

    Call on every rank of `group` after `surgery.convert_model` and before building the optimizer
    (the experts' parameters are replaced by local slices). All ranks must then run the same number of
    forward/backward passes through each layer (the all-to-alls are collective).
    """
    if not dist.is_initialized():
        raise ValueError("shard_experts needs an initialized torch.distributed process group (dist.init_process_group)")
    for name, module in list(model.named_modules()):
        if isinstance(module, QuantExperts) and not isinstance(module, ExpertParallelExperts):
            parent_name, _, child = name.rpartition(".")
            parent = model.get_submodule(parent_name) if parent_name else model
            setattr(parent, child, ExpertParallelExperts(module, group, combine=combine, backward=backward))
    return model


def comm_metrics(model: nn.Module | list, reset: bool = True, *, reduce: bool = False) -> dict:
    """Wire bytes sent since the last reset, summed over the EP layers of `model` (a module or a list of them).

    reduce=False: this rank's bytes. reduce=True (a collective on the default group):
    the bytes of all ranks summed (bits per value from the summed counts).
    """
    total = CommMeter()
    for mod in (model if isinstance(model, (list, tuple)) else [model]):
        for m in mod.modules():
            if isinstance(m, ExpertParallelExperts):
                for p in PHASES:
                    total.sent[p] += m.meter.sent[p]
                    total.remote[p] += m.meter.remote[p]
                    total.values[p] += m.meter.values[p]
                total.routing += m.meter.routing
                if reset:
                    m.meter.reset()
    if reduce:
        counts = [total.sent[p] for p in PHASES] + [total.remote[p] for p in PHASES] + [total.values[p] for p in PHASES]
        t = torch.tensor(counts + [total.routing], dtype=torch.float64)  # exact below 2**53 bytes
        if dist.get_backend() == "nccl":
            t = t.cuda()
        dist.all_reduce(t)
        v = [int(x) for x in t.cpu().tolist()]
        n = len(PHASES)
        total.sent, total.remote, total.values = (dict(zip(PHASES, v[i * n:(i + 1) * n])) for i in range(3))
        total.routing = v[-1]
    return total.metrics()
