"""Where the sampler-vs-trainer logprob gaps of the mode-off parity job come from.

    source scripts/device_env.sh && python3 -P scripts/mismatch_outliers.py [--temperature 0.7] [--invariant false]

Runs `gpu_check.sh rl`'s job (configs/gpu-h200.yaml, 2 RL steps, 32 new tokens, warm start off; local mode) and
looks inside the trainer's epoch-0 logprob recompute of every micro-batch:
- per step, the distribution of every token's smallest router top-k margin over the layers (the k-th minus the
  (k+1)-th router logit) and the largest gaps beside their token's margin;
- for the worst token of each sequence whose gap exceeds `--probe-above`: which tokens of the sequence have a gap;
  the token's hidden row through the LM head in a 16-row call against the packed call (logits that differ, and
  the float64 logprob difference beside the gap); the sequence recomputed alone (equal to the packed recompute?);
  and, for the token's three nearest routing ties, the logprob with the k-th expert swapped for the (k+1)-th (how
  far a routing flip would move it).
A gap that the 16-row LM-head call reproduces comes from the LM head's row-count-dependent kernel; one that a
swap reproduces, from a routing flip. On the CPU (`--config configs/quickstart.yaml`) the two sides agree
bitwise, so every gap is 0: a smoke run of the script itself.

`--lm-head fixed-order` sends the LM head's forward, on both sides, through the fixed-order kernel that
`model.invariant_kernels` uses (`invariant_triton.bmm`; its backward stays on cuBLAS, no logprob depends on it) and
leaves every other product as the mode-off job runs it: if the LM head is the whole mode-off gap, every gap is 0.

Diagnostic only: it wraps the routers' FP32 forward (`surgery._fp32_router_forward`, before the models are
built), the trainer's `_microbatch_loss` and its `sequence_logprobs` in this process (no library code changes),
and reads the trainer's side alone (the sampler's decode runs in CUDA graphs); `--lm-head fixed-order` also wraps
`nn.Linear.forward` and transformers' `get_output_embeddings` in this process."""

import argparse
import sys

import torch

from rl4bit import driver
from rl4bit.kernels import invariant_triton
from rl4bit.trainer import actor, surgery

RECORD: dict = {"on": False, "logits": [], "force": None, "layer": 0}
"""on: record the margins of this forward's routers; force: (layer, packed row) whose k-th expert is swapped for
its (k+1)-th (the other side of a near-tie), counted by `layer` from the forward's first router call."""


def _recording_router(orig):
    def router_forward(module, orig_forward, hidden_states, *args, **kwargs):
        out = orig(module, orig_forward, hidden_states, *args, **kwargs)
        k = module.top_k
        if RECORD["on"]:
            top = out[0].detach().float().topk(k + 1, dim=-1).values
            RECORD["logits"].append(top[:, k - 1] - top[:, k])  # the k-th minus the (k+1)-th logit
        if RECORD["force"] is not None:
            layer, row = RECORD["force"]
            if RECORD["layer"] == layer:
                out = _swapped(module, out, row, k)
            RECORD["layer"] += 1
        return out
    return router_forward


class _FixedOrderLinear(torch.autograd.Function):
    """x [M, K] @ w [N, K]^T forward through the fixed-order kernel; the backward's products on cuBLAS."""

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(x, w)
        return invariant_triton.bmm(x.unsqueeze(0), w.t().unsqueeze(0))[0]

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        return g @ w, g.t() @ x


def _lm_head_fixed_order() -> None:
    """Mark every module `get_output_embeddings` returns (the sampler and the trainer fetch their LM head through
    it) and run a marked `nn.Linear`'s CUDA forward through `_FixedOrderLinear`, in the dtype autocast would use."""
    from transformers import Qwen3MoeForCausalLM
    owner = next(c for c in Qwen3MoeForCausalLM.__mro__ if "get_output_embeddings" in c.__dict__)
    orig_get, orig_forward = owner.get_output_embeddings, torch.nn.Linear.forward

    def get_output_embeddings(self):
        head = orig_get(self)
        if head is not None:
            head._probe_fixed_order = True
        return head

    def forward(self, x):
        if not getattr(self, "_probe_fixed_order", False) or not x.is_cuda or self.bias is not None:
            return orig_forward(self, x)
        dtype = torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else x.dtype
        with torch.autocast("cuda", enabled=False):
            y = _FixedOrderLinear.apply(x.reshape(-1, x.shape[-1]).to(dtype), self.weight.to(dtype))
        return y.reshape(*x.shape[:-1], y.shape[-1])

    owner.get_output_embeddings, torch.nn.Linear.forward = get_output_embeddings, forward


def _swapped(module, out, row: int, k: int):
    """The router's (logits, weights, index) with row `row`'s k-th expert replaced by its (k+1)-th."""
    logits, weights, index = out
    probs = torch.softmax(logits.float(), dim=-1)
    order = probs.topk(k + 1, dim=-1).indices
    index = index.clone()
    index[row] = torch.cat([order[row, : k - 1], order[row, k:]]).to(index.dtype)
    top = probs.gather(1, index.long())
    if getattr(module, "_rl4bit_router_normalize", getattr(module, "norm_topk_prob", True)):
        top = top / top.sum(dim=-1, keepdim=True)
    return logits, top.to(weights.dtype), index


def _alone(trainer, prompt, completion, force=None) -> torch.Tensor:
    """The trainer's logprobs of one sequence packed alone (batch-invariant: the packed recompute's bits), with
    the routing swap `force` = (layer, row in this packing) or without."""
    RECORD["force"], RECORD["layer"] = force, 0
    try:
        with torch.no_grad(), trainer._autocast():
            return actor.sequence_logprobs(trainer.model, [prompt], [completion], trainer.cfg.sampler.temperature,
                                           trainer.cfg.model.max_seq_len)[0][0].double().cpu()
    finally:
        RECORD["force"] = None


def _rows(prompts, completions):
    """The packed row whose hidden state predicts each completion token (as `sequence_logprobs` packs them)."""
    rows, start = [], 0
    for p, c in zip(prompts, completions):
        rows.append(list(range(start + len(p) - 1, start + len(p) - 1 + len(c))))
        start += len(p) + len(c) - 1
    return rows


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--temperature", default="0.7")
    p.add_argument("--invariant", default="false")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--top", type=int, default=8)
    p.add_argument("--probe-above", type=float, default=3e-4,
                   help="swap-test the largest-gap token of every sequence whose largest gap is above this")
    p.add_argument("--out", default="/tmp/rl-outliers")
    p.add_argument("--config", default="configs/gpu-h200.yaml")
    p.add_argument("-o", "--override", action="append", default=[])
    p.add_argument("--lm-head", choices=("cublas", "fixed-order"), default="cublas",
                   help="fixed-order: the LM head's forward through the invariant mode's kernel on both sides")
    a = p.parse_args()
    if a.lm_head == "fixed-order":
        _lm_head_fixed_order()

    surgery._fp32_router_forward = _recording_router(surgery._fp32_router_forward)  # before any model is built
    tokens: list[tuple[float, float, int]] = []  # (gap, smallest margin, its layer) of every token this step
    probes: list[str] = []  # this step's forced-swap lines
    steps: list[list] = []
    orig_loss = actor.Trainer._microbatch_loss

    def microbatch_loss(self, batch, mb, epoch, old, ref, sums, **kw):
        if epoch != 0:
            return orig_loss(self, batch, mb, epoch, old, ref, sums, **kw)
        RECORD["on"], RECORD["logits"] = True, []
        orig_lp = actor.sequence_logprobs

        head = self.model.get_output_embeddings()

        def keep_head(module, args, out):  # the LM head's rows in, logits out (packed completion-token order)
            if RECORD["on"]:
                RECORD["head"] = (args[0].detach(), out.detach())

        def policy_recompute(*args, **kwargs):  # records the first call only: the policy's, not the reference's
            hook = head.register_forward_hook(keep_head)
            try:
                return orig_lp(*args, **kwargs)
            finally:
                hook.remove()
                RECORD["on"] = False
        actor.sequence_logprobs = policy_recompute
        try:
            loss = orig_loss(self, batch, mb, epoch, old, ref, sums, **kw)
        finally:
            actor.sequence_logprobs = orig_lp
            RECORD["on"] = False
        margins = torch.stack(RECORD["logits"])  # [layers, packed rows]
        small, layer = margins.min(0)
        comps = [batch.completion_ids[i] for i in mb]
        head_in, head_out = RECORD.pop("head")
        first_token = 0  # this sequence's first row in the LM head's packed input
        for i, rows in zip(mb, _rows([batch.prompt_ids[i] for i in mb], comps)):
            first_token += len(rows)
            samp = torch.as_tensor(batch.sampler_logprobs[i], dtype=torch.float64)
            gap = (samp - old[i].detach().double().cpu()).abs()
            for g, r in zip(gap.tolist(), rows):
                tokens.append((g, small[r].item(), layer[r].item()))
            j = int(gap.argmax())
            if gap[j] < a.probe_above:
                continue
            # the token's three nearest ties, each swapped alone in a recompute of its sequence
            prompt, comp = batch.prompt_ids[i], batch.completion_ids[i]
            nz = (gap > 0).nonzero().flatten().tolist()
            line = (f"  seq {i} token {j}/{len(comp)}: gap {gap[j]:.3e}; nonzero gaps in the sequence at "
                    f"{nz[:12]}{' ...' if len(nz) > 12 else ''}")
            k = first_token - len(rows) + j
            with torch.no_grad(), self._autocast():  # the same hidden row through the LM head in a 16-row call
                few = head(torch.cat([head_in[k:k + 1], head_in[k:k + 1].new_zeros(15, head_in.shape[1])]))[0]
            t = float(self.cfg.sampler.temperature)
            lp = [torch.log_softmax(x.double() / t, -1)[comp[j]].item() for x in (head_out[k], few)]
            line += (f"\n    LM head on this row in a 16-row call: {int((few != head_out[k]).sum())} of "
                     f"{few.numel()} logits differ from the packed call's; float64 logprob 16-row - packed "
                     f"{lp[1] - lp[0]:+.3e} (sampler - trainer {samp[j] - old[i][j].item():+.3e})")
            base = _alone(self, prompt, comp)
            line += f"\n    alone == packed: {bool(torch.equal(base, old[i].detach().double().cpu()))}"
            for lay in margins[:, rows[j]].argsort()[:3].tolist():
                forced = _alone(self, prompt, comp, (lay, len(prompt) - 1 + j))
                line += (f"\n    swap layer {lay} (margin {margins[lay, rows[j]]:.3e}): sampler - trainer at the "
                         f"token {samp[j] - forced[j]:+.3e} (unswapped {samp[j] - base[j]:+.3e}); later tokens' "
                         f"largest |change| {(forced[j + 1:] - base[j + 1:]).abs().max().item() if j + 1 < len(comp) else 0:.2e}")
            probes.append(line)
        return loss

    actor.Trainer._microbatch_loss = microbatch_loss
    orig_step = actor.Trainer.train_step

    def train_step(self, batch):
        tokens.clear()
        probes.clear()
        out = orig_step(self, batch)
        steps.append((list(tokens), list(probes)))
        return out

    actor.Trainer.train_step = train_step
    overrides = [f"model.invariant_kernels={a.invariant}", f"sampler.temperature={a.temperature}",
                 f"rl.steps={a.steps}", f"sampler.max_new_tokens={a.new_tokens}", "sampler.ignore_eos=true",
                 "run.warmup_sft_steps=0", "data.eval_size=8", "ray.mode=local", *a.override]
    rc = driver.main(a.config, a.out, overrides=overrides)
    print(f"T={a.temperature} invariant={a.invariant} lm head={a.lm_head}: job rc {rc}")
    for s, (toks, lines) in enumerate(steps, 1):
        gaps = torch.tensor([t[0] for t in toks])
        small = torch.tensor([t[1] for t in toks])
        q = torch.tensor([0.001, 0.01, 0.1, 0.5])
        print(f"step {s}: {len(toks)} tokens; smallest top-k margin over the layers, quantiles 0.1% / 1% / 10% / "
              f"50%: {' / '.join(f'{v:.2e}' for v in torch.quantile(small, q).tolist())}")
        print(f"  tokens with gap > 1e-3: {int((gaps > 1e-3).sum())}; > 1e-4: {int((gaps > 1e-4).sum())}; "
              f"> 0: {int((gaps > 0).sum())}; "
              f"median gap {gaps.median().item():.2e}")
        order = torch.argsort(gaps, descending=True)[: a.top]
        for j in order.tolist():
            g, m, layer = toks[j]
            rank = (small < m).float().mean().item()
            print(f"  gap {g:.3e}  smallest margin {m:.3e} (layer {layer}; quantile {rank:.4f})")
        print("\n".join(lines))
    sys.exit(rc)


if __name__ == "__main__":
    main()
