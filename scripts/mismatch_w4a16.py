"""How far is vLLM-on-Hopper's NVFP4 (Marlin: W4A16) from the trainer's forward (NVFP4 activations, 4/6)?

The trainer's converted model in serving mode (the embedded engine's form) beside the same model whose
quantized weights are replaced by their dequantized values and run with BF16 activations (what Marlin
computes), and beside the unquantized model; the log-probabilities of the trainer form's greedy tokens,
teacher-forced over random prompts, under BF16 autocast. Set the result beside the vLLM-vs-embedded
mismatch `scripts/vllm_gpu_check.py` measures on a GPU (docs/vllm.md) to see how much of it is the
activations' quantization. Runs on the CPU.

    python -P scripts/mismatch_w4a16.py --size small
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from vllm_gpu_check import SIZES  # noqa: E402  the GPU check's model sizes


def build(size: str, tokenizer):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("qwen3_moe", vocab_size=len(tokenizer), max_position_embeddings=256,
                               norm_topk_prob=True, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
                               pad_token_id=0, **SIZES[size])
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():  # as vllm_gpu_check.build: routers included, BF16-representable values
        for name, p in model.named_parameters():
            if p.ndim > 1:
                p.normal_(0, 0.05 if "embed" not in name else 1.0)
        for p in model.parameters():
            p.copy_(p.bfloat16().float())
    return model


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="small", choices=sorted(SIZES))
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--len", type=int, default=128, help="tokens a sequence; the second half is scored")
    a = ap.parse_args(argv)

    from rl4bit.kernels.api import dequantize
    from rl4bit.trainer.recipe import RecipeConfig
    from rl4bit.trainer.surgery import convert_model, load_quantized, quantized_weights
    from rl4bit.trainer.tokenizer import build_tokenizer

    tok = build_tokenizer()
    raw = build(a.size, tok)
    a4 = copy.deepcopy(raw)
    plan = convert_model(a4, RecipeConfig(name="nvfp4"))
    q = quantized_weights(a4)
    load_quantized(a4, q)
    w16 = copy.deepcopy(raw)  # the quantized weights' values, BF16 activations
    params = dict(w16.named_parameters())
    with torch.no_grad():
        for module, ps in q.items():
            for name, qt in ps.items():
                w, p = dequantize(qt, torch.float32), params[f"{module}.{name}"]
                if w.shape != p.shape:
                    raise SystemExit(f"{module}.{name}: QTensor {tuple(w.shape)} vs parameter {tuple(p.shape)}")
                p.copy_(w)
    forms = {"W4A16 (vLLM's Marlin form)": w16, "unquantized": copy.deepcopy(raw)}
    for m in forms.values():
        convert_model(m, RecipeConfig(name="bf16"))  # the same fused modules as the trainer form
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(4, len(tok), (a.batch, a.len), generator=g)
    ids[:, 0] = 1

    def logprobs(m):
        with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
            return torch.log_softmax(m(ids).logits.float(), -1)

    ref = logprobs(a4)
    pick = ref.argmax(-1, keepdim=True)
    print(f"{a.size}: formats {sorted(set(plan.values()))}; {a.batch} x {a.len - a.len // 2} scored tokens")
    for label, m in forms.items():
        d = (ref.gather(-1, pick) - logprobs(m).gather(-1, pick)).abs()[:, a.len // 2:]
        print(f"trainer form (A4) vs {label}: mean |dlogprob| {d.mean():.4f}, max {d.max():.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
