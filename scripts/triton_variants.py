"""Run `rl4bit bench step` on the GPU, then print how many compiled variants each rl4bit Triton kernel holds.

    source scripts/device_env.sh && python3 -P scripts/triton_variants.py --steps 3 --new-tokens 64

More than one or two variants of a kernel means its integer arguments were specialized on values that
change from step to step (see ``rl4bit.kernels.formats_triton.NO_SPECIALIZE``): each new variant is a
compile, seconds, in the middle of an RL step.
"""

import argparse
import importlib

import triton

from rl4bit import bench_step

MODULES = ("rl4bit.kernels.nvfp4_triton", "rl4bit.kernels.mxfp8_triton", "rl4bit.kernels.s2f6_triton",
           "rl4bit.kernels.qgemm_triton", "rl4bit.kernels.mxfp8_gemm_triton", "rl4bit.sampler.noise_triton")


def variants(fn) -> int:
    caches = getattr(fn, "device_caches", None)
    if caches is not None:  # triton >= 3.2: {device: (kernel cache, ...)}
        return sum(len(c[0]) for c in caches.values())
    return sum(len(c) for c in getattr(fn, "cache", {}).values())


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--out")
    a = p.parse_args()
    bench_step.run(device="cuda", steps=a.steps, new_tokens=a.new_tokens, out=a.out)
    print("\ncompiled variants per Triton kernel after both jobs:")
    for name in MODULES:
        mod = importlib.import_module(name)
        for attr in dir(mod):
            fn = getattr(mod, attr)
            if isinstance(fn, triton.runtime.jit.JITFunction) and attr.endswith("kernel"):
                print(f"  {name.split('.')[-1]}.{attr}: {variants(fn)}")


if __name__ == "__main__":
    main()
