"""Where the sampler-vs-trainer logprob mismatch's largest tokens come from: near-tied MoE routing or not.

    source scripts/device_env.sh && python3 -P scripts/mismatch_outliers.py [--temperature 0.7] [--invariant false]

Runs `gpu_check.sh rl`'s job (configs/gpu-h200.yaml, 2 RL steps, 32 new tokens, warm start off) and, in the
trainer's epoch-0 logprob recompute of every micro-batch, records the router logits of every layer for every
packed token. Per step it prints the tokens with the largest |sampler - trainer| logprob gap beside their
smallest top-k margin over the layers (the k-th minus the (k+1)-th router logit, in the trainer's forward) and
that margin's quantile among all tokens' smallest margins. A token whose gap comes from a routing decision that
the two sides took differently (the sampler's hidden state differs by rounding where the invariant mode is off)
sits at a margin near zero; a gap spread through the stream does not.

Diagnostic only: it wraps the routers' FP32 forward (`surgery._fp32_router_forward`, before the models are
built) and the trainer's `_microbatch_loss` in this process (local mode; no library code changes), and reads the
trainer's side alone (the sampler's decode runs in CUDA graphs). On the CPU (`--config configs/quickstart.yaml`)
the two sides agree bitwise, so every gap is 0: a smoke run of the script itself.
"""

import argparse
import sys

import torch

from rl4bit import driver
from rl4bit.trainer import actor, surgery

RECORD: dict = {"on": False, "logits": []}


def _recording_router(orig):
    def router_forward(module, orig_forward, hidden_states, *args, **kwargs):
        out = orig(module, orig_forward, hidden_states, *args, **kwargs)
        if RECORD["on"]:
            k = module.top_k
            top = out[0].detach().float().topk(k + 1, dim=-1).values
            RECORD["logits"].append(top[:, k - 1] - top[:, k])  # the k-th minus the (k+1)-th logit
        return out
    return router_forward


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
    p.add_argument("--out", default="/tmp/rl-outliers")
    p.add_argument("--config", default="configs/gpu-h200.yaml")
    p.add_argument("-o", "--override", action="append", default=[])
    a = p.parse_args()

    surgery._fp32_router_forward = _recording_router(surgery._fp32_router_forward)  # before any model is built
    tokens: list[tuple[float, float, int]] = []  # (gap, smallest margin, its layer) of every token this step
    steps: list[list] = []
    orig_loss = actor.Trainer._microbatch_loss

    def microbatch_loss(self, batch, mb, epoch, old, ref, sums, **kw):
        if epoch != 0:
            return orig_loss(self, batch, mb, epoch, old, ref, sums, **kw)
        RECORD["on"], RECORD["logits"] = True, []
        orig_lp = actor.sequence_logprobs

        def first_call_only(*args, **kwargs):  # the policy's recompute, not the reference model's
            try:
                return orig_lp(*args, **kwargs)
            finally:
                RECORD["on"] = False
        actor.sequence_logprobs = first_call_only
        try:
            loss = orig_loss(self, batch, mb, epoch, old, ref, sums, **kw)
        finally:
            actor.sequence_logprobs = orig_lp
            RECORD["on"] = False
        margins = torch.stack(RECORD["logits"])  # [layers, packed rows]
        small, layer = margins.min(0)
        comps = [batch.completion_ids[i] for i in mb]
        for i, rows in zip(mb, _rows([batch.prompt_ids[i] for i in mb], comps)):
            gap = (torch.as_tensor(batch.sampler_logprobs[i], dtype=torch.float64)
                   - old[i].detach().double().cpu()).abs()
            for g, r in zip(gap.tolist(), rows):
                tokens.append((g, small[r].item(), layer[r].item()))
        return loss

    actor.Trainer._microbatch_loss = microbatch_loss
    orig_step = actor.Trainer.train_step

    def train_step(self, batch):
        tokens.clear()
        out = orig_step(self, batch)
        steps.append(list(tokens))
        return out

    actor.Trainer.train_step = train_step
    overrides = [f"model.invariant_kernels={a.invariant}", f"sampler.temperature={a.temperature}",
                 f"rl.steps={a.steps}", f"sampler.max_new_tokens={a.new_tokens}", "sampler.ignore_eos=true",
                 "run.warmup_sft_steps=0", "data.eval_size=8", "ray.mode=local", *a.override]
    rc = driver.main(a.config, a.out, overrides=overrides)
    print(f"T={a.temperature} invariant={a.invariant}: job rc {rc}")
    for s, toks in enumerate(steps, 1):
        gaps = torch.tensor([t[0] for t in toks])
        small = torch.tensor([t[1] for t in toks])
        q = torch.tensor([0.001, 0.01, 0.1, 0.5])
        print(f"step {s}: {len(toks)} tokens; smallest top-k margin over the layers, quantiles 0.1% / 1% / 10% / "
              f"50%: {' / '.join(f'{v:.2e}' for v in torch.quantile(small, q).tolist())}")
        print(f"  tokens with gap > 1e-3: {int((gaps > 1e-3).sum())}; > 1e-4: {int((gaps > 1e-4).sum())}; "
              f"median gap {gaps.median().item():.2e}")
        order = torch.argsort(gaps, descending=True)[: a.top]
        for j in order.tolist():
            g, m, layer = toks[j]
            rank = (small < m).float().mean().item()
            print(f"  gap {g:.3e}  smallest margin {m:.3e} (layer {layer}; quantile {rank:.4f})")
    sys.exit(rc)


if __name__ == "__main__":
    main()
