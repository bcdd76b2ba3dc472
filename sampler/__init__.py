"""rl4bit.sampler: rollout generation.

types.py (Request, SamplingParams, Rollout, WeightUpdate: the interface every
backend speaks), engine.py (EmbeddedEngine: batched, batch-invariant
generation over a Hugging Face model), kv_cache.py (its KV cache and
attention/experts plug-ins), sampling.py (temperature/top-k/top-p/min-p and
logprobs), detokenizer.py (a completion's text and stop strings, as vLLM writes
them), actor.py (Sampler: the plain class Ray wraps in rl4bit/actors.py).
"""
