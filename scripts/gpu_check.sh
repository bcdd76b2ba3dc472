#!/usr/bin/env bash
# One device call's worth of GPU checks (the lent H200 image: torch, triton, transformers, no ray/vllm):
# the GPU tests of the decode path's kernels, then `bench rollout` and the decode-step profile, each into
# $OUT (or ./gpu-check-out). About 8 minutes on an H200; stops at nothing (every step's exit code is logged).
#   source scripts/device_env.sh && bash scripts/gpu_check.sh [--quick | --sweep]
#   --quick: tests + batch-1 profile; --sweep: also the one-token decode GEMM sweep (~2 more minutes)
#   --rl: instead, RL parity (2 steps, invariant kernels on and off) and `bench_step` (~8 minutes)
set -uo pipefail
out=${OUT:-gpu-check-out}
mkdir -p "$out"
log() { echo "[$(date +%T)] $*" | tee -a "$out/steps.txt"; }
run() {  # run NAME CMD...: output to $out/NAME.txt, exit code to steps.txt
    local name=$1; shift
    log "start $name"
    "$@" > "$out/$name.txt" 2>&1
    log "end $name rc=$?"
}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$out/gpu.txt" 2>&1
if [[ "${1:-}" == "--rl" ]]; then
    for mode in true false; do
        run parity-$mode timeout 170 python3 -P -m rl4bit.cli train configs/gpu-h200.yaml \
            -o model.invariant_kernels=$mode -o rl.steps=2 -o sampler.max_new_tokens=32 \
            -o sampler.ignore_eos=true -o run.warmup_sft_steps=0 -o data.eval_size=8 \
            --out /tmp/rl-$mode
        cp /tmp/rl-$mode/metrics.jsonl "$out/metrics-$mode.jsonl"
        grep -oE '"(step|mismatch/k3|mismatch/max_abs|time/[a-z_]+)": [-0-9.e]+' "$out/metrics-$mode.jsonl" | head -24
    done
    run step timeout 240 python3 -P -m rl4bit.bench_step --device cuda --steps 3 --new-tokens 128
    tail -30 "$out/step.txt"
    exit 0
fi
run tests python3 -P -m pytest -q -p no:cacheprovider tests/kernels/test_qgemm_triton.py tests/kernels/test_swiglu.py \
    tests/kernels/test_qk_rope.py tests/kernels/test_fused_engine.py tests/kernels/test_triton_quantize.py \
    tests/kernels/test_attention.py tests/kernels/test_router.py tests/kernels/test_route.py \
    tests/kernels/test_rmsnorm.py tests/kernels/test_combine.py tests/kernels/test_fused_layer.py \
    tests/sampler/test_decode_graph.py tests/sampler/test_rope_table.py
tail -3 "$out/tests.txt"
run profile1 python3 -P scripts/profile_decode.py --batch 1 --new 128 --temperature 1.0 --rows 30
grep -A 20 "GPU kernels" "$out/profile1.txt" | head -44
if [[ "${1:-}" != "--quick" ]]; then
    run rollout python3 -P -m rl4bit.bench_rollout --device cuda
    tail -30 "$out/rollout.txt"
fi
if [[ "${1:-}" == "--sweep" ]]; then
    run sweep python3 -P scripts/sweep_decode_gemm.py --one-token --out "$out"
    grep -E "pick_config|DECODE|not bitwise" "$out/sweep.txt" | head -40
fi
