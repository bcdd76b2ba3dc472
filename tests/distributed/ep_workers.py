"""Worker processes of the expert-parallel tests: each rank runs every scenario and writes what it measured as JSON.

    python tests/distributed/ep_workers.py RANK WORLD PORT OUT_DIR [layer|model]   # one per rank (gloo, CPU)

`launch(world, out_dir)` starts WORLD such processes with a free MASTER_PORT
and a hard timeout (a hang fails, it does not block CI), and returns each
rank's results. Each scenario builds the same tiny MoE experts layer on every
rank, runs the one-process recipe (`QuantExperts`) on the concatenated batch
of all ranks as the reference, then the expert-parallel layer on this rank's
slice of the batch, forward and backward under bf16 autocast with FP32
masters (the trainer's mode), and records: elements that differ (bitwise
scenarios), SQNR in dB, the combine error against its S2F6 bound, and the
wire metrics. The asserts live in test_expert_parallel.py.

`what="cuda"` runs the layer scenarios on GPUs over NCCL (Triton kernels on).
Leaves out: the full HF model on GPUs (the "model" launch is CPU only).
"""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta
from pathlib import Path

import torch

from rl4bit.bench.comm import free_port, run_ranks

HIDDEN, INTER, EXPERTS, TOP_K, TOKENS = 64, 32, 8, 2, 24
"""Tiny layer: hidden 64, expert width 32, 8 experts (2 or 4 ranks), top-2, 24 tokens per rank."""

SCENARIOS = {
    # name: (recipe fmt, stochastic requant, combine, backward format, routing)
    "bf16_combine": ("nvfp4", False, "bf16", "bf16", "random"),
    "skewed_bf16": ("nvfp4", False, "bf16", "bf16", "skewed"),
    "tail_mxfp8": ("mxfp8", False, "bf16", "bf16", "random"),
    "recipe_bf16": ("bf16", False, "bf16", "bf16", "random"),
    "rht_s2f6": ("nvfp4", False, "rht_s2f6", "bf16", "random"),
    "rht_s2f6_sr": ("nvfp4", True, "rht_s2f6", "bf16", "random"),  # the default recipe: SR re-quantization
    "mxfp8_combine": ("nvfp4", False, "mxfp8", "bf16", "random"),
    "mxfp8_backward": ("nvfp4", False, "bf16", "mxfp8", "random"),
}


class _Src(torch.nn.Module):
    """An HF-5.x-shaped fused experts module: what surgery hands to QuantExperts."""

    def __init__(self, gen):
        super().__init__()
        self.gate_up_proj = torch.nn.Parameter(torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=gen) * 0.2)
        self.down_proj = torch.nn.Parameter(torch.randn(EXPERTS, HIDDEN, INTER, generator=gen) * 0.2)
        self.act_fn = torch.nn.SiLU()


def _batch(world: int, routing: str, gen):
    n = TOKENS * world
    hidden = torch.randn(n, HIDDEN, generator=gen)
    hidden[:, 5] *= 20.0  # an outlier channel, as in real activations
    logits = torch.randn(n, EXPERTS, generator=gen)
    if routing == "skewed":  # every token to experts 0 and 1 (rank 0's): the other ranks receive no rows
        logits[:, :2] += 100.0
    w, idx = torch.softmax(logits, -1).topk(TOP_K, dim=-1)
    w = w / w.sum(-1, keepdim=True)
    grad_out = torch.randn(n, HIDDEN, generator=gen)
    return hidden, idx, w, grad_out


def _sqnr(ref, x) -> float:
    from rl4bit.trainer.ep_codec import sqnr_db

    v = sqnr_db(ref, x)
    return 1e9 if v == float("inf") else v


def _diff(a, b) -> int:
    return int((a.view(-1) != b.view(-1)).sum()) + int(a.shape != b.shape)


def _run(module, hidden, idx, w, grad_out):
    """out, d hidden, d weights, d expert params of one forward/backward under bf16 autocast."""
    hidden = hidden.clone().requires_grad_(True)
    w = w.clone().requires_grad_(True)
    with torch.autocast(hidden.device.type, dtype=torch.bfloat16):
        out = module(hidden, idx, w)
    (out * grad_out).sum().backward()
    return {"out": out.detach(), "d_hidden": hidden.grad, "d_w": w.grad,
            "d_gate_up": module.gate_up_proj.grad, "d_down": module.down_proj.grad}


def scenario(name: str, rank: int, world: int, device=torch.device("cpu")) -> dict:
    from rl4bit.trainer.ep_codec import S2F6_REL_BOUND
    from rl4bit.trainer.expert_parallel import ExpertParallelExperts, comm_metrics
    from rl4bit.trainer.modules import QuantExperts
    from rl4bit.trainer.qgemm import GemmSpec

    fmt, sr, combine, backward, routing = SCENARIOS[name]
    gen = torch.Generator().manual_seed(1234)
    spec = GemmSpec(fmt=fmt, stochastic_requant=sr)
    ref_mod = QuantExperts(_Src(gen), spec, seed=7, layer_id=3)
    hidden, idx, w, grad_out = _batch(world, routing, gen)
    ep_src = QuantExperts(_Src(torch.Generator().manual_seed(1234)), spec, seed=7, layer_id=3)
    ep = ExpertParallelExperts(ep_src, None, combine=combine, backward=backward)
    ref_mod, ep = ref_mod.to(device), ep.to(device)
    hidden, idx, w, grad_out = (t.to(device) for t in (hidden, idx, w, grad_out))

    ref = _run(ref_mod, hidden, idx, w, grad_out)
    rows = slice(rank * TOKENS, (rank + 1) * TOKENS)
    experts = slice(ep.first_expert, ep.first_expert + ep.num_experts)
    got = _run(ep, hidden[rows], idx[rows], w[rows], grad_out[rows])
    want = {"out": ref["out"][rows], "d_hidden": ref["d_hidden"][rows], "d_w": ref["d_w"][rows],
            "d_gate_up": ref["d_gate_up"][experts], "d_down": ref["d_down"][experts]}
    res = {"diff": {k: _diff(got[k], want[k]) for k in want}, "sqnr": {k: _sqnr(want[k], got[k]) for k in want},
           "numel": {k: want[k].numel() for k in want}, "metrics": comm_metrics(ep)}
    if combine == "rht_s2f6":  # per token and block of 32: ||err||_2 <= sum_k w_k (bound + bf16 rounding) ||o_k||_2
        with torch.no_grad(), torch.autocast(device.type, dtype=torch.bfloat16):
            ones = torch.ones(hidden.shape[0], 1, device=device)
            o_k = [ref_mod(hidden, idx[:, j : j + 1], ones)[rows].float() for j in range(TOP_K)]
        norms = sum(w[rows, j, None] * o_k[j].unflatten(-1, (-1, 32)).norm(dim=-1) for j in range(TOP_K))
        err = (got["out"] - want["out"]).unflatten(-1, (-1, 32)).norm(dim=-1)
        bound = (S2F6_REL_BOUND + 2.0**-8) * norms + 1e-6
        res["bound_ratio_max"] = float((err / bound).max())
        res["err_over_norm_mean"] = float((err / norms.clamp(min=1e-12)).mean())
    return res


def disagreement_scenarios(rank: int, world: int) -> dict:
    """What each rank raises (type and message) when rank 0's tokens hold an Inf, when the last rank's tokens
    hold a value finite in FP32 but past BF16's range (Inf once cast for the dispatch), when the last rank runs
    another combine, and when the last rank's experts hold a NaN weight: every rank must raise at the same point
    (no rank left waiting in an all-to-all)."""
    from rl4bit.trainer.expert_parallel import ExpertParallelExperts
    from rl4bit.trainer.modules import QuantExperts
    from rl4bit.trainer.qgemm import GemmSpec

    out = {}
    for name in ("inf_on_rank_0", "bf16_overflow_on_last_rank", "combine_differs", "nan_weight_on_last_rank"):
        gen = torch.Generator().manual_seed(1234)
        src = QuantExperts(_Src(gen), GemmSpec(fmt="nvfp4"), seed=7, layer_id=3)
        combine = "mxfp8" if name == "combine_differs" and rank == world - 1 else "bf16"
        ep = ExpertParallelExperts(src, None, combine=combine, backward="bf16")
        hidden, idx, w, grad_out = _batch(world, "random", gen)
        rows = slice(rank * TOKENS, (rank + 1) * TOKENS)
        hidden = hidden[rows].clone()
        if name == "inf_on_rank_0" and rank == 0:
            hidden[3, 5] = float("inf")
        if name == "bf16_overflow_on_last_rank" and rank == world - 1:
            hidden[3, 5] = 3.4e38  # finite in FP32; rounds to Inf in BF16 (its largest finite value is 3.39e38)
        if name == "nan_weight_on_last_rank" and rank == world - 1:
            with torch.no_grad():
                ep.down_proj[0, 1, 2] = float("nan")
        try:
            _run(ep, hidden, idx[rows], w[rows], grad_out[rows])
            out[name] = ["no error", ""]
        except ValueError as e:  # NonFiniteInputError is one
            out[name] = [type(e).__name__, "\n".join([str(e), *getattr(e, "__notes__", [])])]
    return out


def model_scenario(rank: int, world: int) -> dict:
    """shard_experts on a converted tiny Qwen3-MoE (nvfp4, its last layer the mxfp8 tail), bf16 combine.

    Reference: the unsharded model on this rank's sequences. The loss must be
    bitwise equal (per-token results do not depend on the batch); non-expert
    gradients are compared by SQNR because the MXFP8 dgrad GEMM is a plain
    torch.mm over a different number of rows (not row-invariant on CPU).
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    from rl4bit.trainer.ep_codec import sqnr_db
    from rl4bit.trainer.expert_parallel import ExpertParallelExperts, comm_metrics, shard_experts
    from rl4bit.trainer.recipe import RecipeConfig
    from rl4bit.trainer.surgery import convert_model

    cfg = AutoConfig.for_model("qwen3_moe", vocab_size=128, hidden_size=64, num_attention_heads=4,
                               num_key_value_heads=2, max_position_embeddings=64, num_hidden_layers=3, head_dim=16,
                               intermediate_size=128, moe_intermediate_size=32, num_experts=EXPERTS,
                               num_experts_per_tok=TOP_K, norm_topk_prob=True)

    def build():
        torch.manual_seed(0)
        m = AutoModelForCausalLM.from_config(cfg)
        m.config.use_cache = False
        convert_model(m, RecipeConfig(name="nvfp4", stochastic_requant=False))
        return m

    ids = torch.randint(0, 128, (2 * world, 16), generator=torch.Generator().manual_seed(5))[2 * rank : 2 * rank + 2]
    ref, ep = build(), shard_experts(build(), None, combine="bf16")
    n_ep = sum(isinstance(m, ExpertParallelExperts) for m in ep.modules())
    losses, grads = [], []
    for m in (ref, ep):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = m(input_ids=ids, labels=ids).loss
        loss.backward()
        losses.append(loss.detach())
        grads.append({n: p.grad for n, p in m.named_parameters() if ".experts." not in n and p.grad is not None})
    expert_grads_ok = all(p.grad is not None and bool(torch.isfinite(p.grad).all()) and float(p.grad.abs().sum()) > 0
                          for n, p in ep.named_parameters() if ".experts." in n)
    sq = min(sqnr_db(grads[0][n], grads[1][n]) for n in grads[0])
    return {"ep_layers": n_ep, "loss_diff": _diff(losses[0], losses[1]),
            "grad_names_equal": sorted(grads[0]) == sorted(grads[1]),
            "min_grad_sqnr": 1e9 if sq == float("inf") else sq, "expert_grads_ok": expert_grads_ok,
            "metrics": comm_metrics(ep)}


def main(rank: int, world: int, port: int, out_dir: str, what: str = "layer") -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    device = torch.device("cuda", rank) if what == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    from rl4bit.trainer.sharding import bind_world_defaults_early

    bind_world_defaults_early()
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    try:
        if what == "model":  # a launch of its own: importing transformers is the slow part
            results = {"model": model_scenario(rank, world)}
        elif what == "disagree":
            results = disagreement_scenarios(rank, world)
        else:
            results = {name: scenario(name, rank, world, device) for name in SCENARIOS}
        dist.barrier()
    finally:
        dist.destroy_process_group()
    path = Path(out_dir) / f"rank{rank}.json"
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w") as f:
        json.dump(results, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def launch(world: int, out_dir: Path, what: str = "layer", timeout_s: float = 240.0) -> list[dict]:
    """Run WORLD worker processes (`what`: "layer" scenarios, "cuda" the same on GPUs over NCCL, or "model");
    raise with their stderr if one fails or the whole run exceeds timeout_s."""
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if what != "cuda":
        env["RL4BIT_KERNELS"] = "reference"
    run_ranks([[sys.executable, __file__, str(r), str(world), str(port), str(out_dir), what] for r in range(world)],
              env, timeout_s, f"ep_workers {what}")
    return [json.loads((out_dir / f"rank{r}.json").read_text()) for r in range(world)]


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], *sys.argv[5:6])
