#!/usr/bin/env bash
# Do the GPU tests and benchmarks pass on this card? One mode a device call (each fits a 10-minute call);
# outputs into $OUT (or ./gpu-check-out), every step's exit code in steps.txt; a failing step stops nothing.
#   source scripts/device_env.sh && bash scripts/gpu_check.sh [tests | perf | profile | decode | kernels | formats | padding | rl | step | train | all]
#   tests:   the GPU tests of the decode path's kernels
#   perf:    the batch-1 decode profile, `bench rollout`, `bench gemm --decode`, the one-token decode GEMM sweep and
#            the attention split sweep
#   rl:      RL parity, 2 steps, invariant kernels on and off (RL_INVARIANT, RL_TEMPERATURE pick the runs)
#   step:    `bench step`, STEP_RECIPES (default nvfp4,mxfp8,bf16; half-size micro-batches under 100 GB)
#   train:   issue 42's training-side figures: `bench gemm` (training GEMMs), `bench train`, where the train step's
#            time goes (PROFILE_RECIPES, default bf16,nvfp4; PROFILE_ARGS, default --sites: by source line) and, with SWEEP_MXFP8=1, the MXFP8 dgrad / wgrad tile
#            sweep (each config bitwise-checked first)
#   formats: `bench kernels` (the format kernels against copy bandwidth), then `bench kernels --sweep` (their tiles
#            and warps at training shapes, each config bitwise-checked against the kernel's default first)
#   profile: decode profiles at batch 16 and 64, the routing kernel's warp sweep, the decode GEMM sweep there
#   decode:  the decode tile sweep at 1 / 16 / 64 tokens, then the engine's rollout with the default tile beside
#            the sweep's best (scripts/ab_decode_config.py)
#   kernels: `bench gemm --decode`, the attention split sweep, the batch-1 profile, the activation quantize sweep
#   padding: the batch-1 profile and `bench rollout --compare-unmarked` at batch 1 / 4 / 16
#   all (the default): tests, then the batch-1 profile and `bench rollout`
# Every step runs under `timeout` so that one slow step cannot take the call's later output with it.
set -uo pipefail
out=${OUT:-gpu-check-out}
mode=${1:-all}
mkdir -p "$out"
log() { echo "[$(date +%T)] $*" | tee -a "$out/steps.txt"; }
run() {  # run NAME SECONDS CMD...: output to $out/NAME.txt, exit code to steps.txt (124: timed out)
    local name=$1 limit=$2; shift 2
    log "start $name"
    timeout "$limit" "$@" > "$out/$name.txt" 2>&1
    log "end $name rc=$?"
}
tests() {
    run tests 540 python3 -P -m pytest -q -p no:cacheprovider tests/kernels/test_qgemm_triton.py \
        tests/kernels/test_swiglu.py tests/kernels/test_qk_rope.py tests/kernels/test_fused_engine.py \
        tests/kernels/test_triton_quantize.py tests/kernels/test_attention.py tests/kernels/test_router.py \
        tests/kernels/test_route.py tests/kernels/test_rmsnorm.py tests/kernels/test_combine.py \
        tests/kernels/test_fused_layer.py tests/sampler/test_decode_graph.py tests/sampler/test_rope_table.py
    tail -3 "$out/tests.txt"
}
profile_and_rollout() {
    run profile1 90 python3 -P scripts/profile_decode.py --batch 1 --new 128 --temperature 1.0 --rows 30
    grep -A 20 "GPU kernels" "$out/profile1.txt" | head -44
    run rollout 300 python3 -P -m rl4bit.bench.rollout --device cuda
    tail -30 "$out/rollout.txt"
}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$out/gpu.txt" 2>&1
case "$mode" in
    tests) tests ;;
    all) tests; profile_and_rollout ;;
    perf)
        profile_and_rollout
        run gemm 60 python3 -P -m rl4bit.bench.gemm --decode
        tail -20 "$out/gemm.txt"
        run sweep 120 python3 -P scripts/sweep_decode_gemm.py --one-token
        grep -E "pick_config|not bitwise" "$out/sweep.txt" | head -20
        run attention 90 python3 -P scripts/sweep_attention.py
        cat "$out/attention.txt" ;;
    profile)
        for b in 16 64; do
            run profile$b 150 python3 -P scripts/profile_decode.py --batch $b --new 128 --temperature 1.0 --rows 30
            grep -A 24 "GPU kernels" "$out/profile$b.txt" | head -52
        done
        run route 60 python3 -P scripts/sweep_route.py
        cat "$out/route.txt"
        run sweep-rollout 150 python3 -P scripts/sweep_decode_gemm.py --rollout
        grep -E "pick_config|not bitwise" "$out/sweep-rollout.txt" | head -20 ;;
    decode)
        run sweep-decode 280 python3 -P scripts/sweep_decode_gemm.py --one-token --rollout --out "$out"
        grep -E "^[a-z0-9]|pick_config|not bitwise" "$out/sweep-decode.txt" | head -40
        run ab 200 python3 -P scripts/ab_decode_config.py --sweep "$out/sweep_decode_gemm.json" --out "$out"
        cat "$out/ab.txt" | tail -20 ;;
    kernels)
        run gemm 90 python3 -P -m rl4bit.bench.gemm --decode --out "$out"
        run attention 120 python3 -P scripts/sweep_attention.py
        tail -40 "$out/attention.txt"
        run profile1 90 python3 -P scripts/profile_decode.py --batch 1 --new 128 --temperature 1.0 --rows 30
        grep -A 30 "GPU kernels" "$out/profile1.txt" | head -70
        run quantize 120 python3 -P scripts/sweep_quantize.py
        cat "$out/quantize.txt" ;;
    padding)
        # the padding mark's gain: the batch-1 profile, then both engines with the mark on and off side by side
        # at batch 1 / 4 / 16 (16: no padding rows, the spread)
        run profile1 90 python3 -P scripts/profile_decode.py --batch 1 --new 128 --temperature 1.0 --rows 30
        grep -A 30 "GPU kernels" "$out/profile1.txt" | head -70
        run unmarked 300 python3 -P -m rl4bit.bench.rollout --device cuda --batches 1,4,16 --new-tokens 256 \
            --compare-unmarked --out "$out"
        tail -30 "$out/unmarked.txt" ;;
    rl)
        # RL_INVARIANT (default "true false") picks the runs, RL_TEMPERATURE (default 1.0) the sampling temperature
        limit=220  # the first job compiles its kernels: a longer limit
        for invariant in ${RL_INVARIANT:-true false}; do
            rm -rf /tmp/rl-$invariant  # a second call on a warm machine: no stale run dir
            run parity-$invariant $limit python3 -P -m rl4bit.cli train configs/gpu-h200.yaml \
                -o model.invariant_kernels=$invariant -o sampler.temperature=${RL_TEMPERATURE:-1.0} \
                -o rl.steps=2 -o sampler.max_new_tokens=32 \
                -o sampler.ignore_eos=true -o run.warmup_sft_steps=0 -o data.eval_size=8 --out /tmp/rl-$invariant
            cp /tmp/rl-$invariant/metrics.jsonl "$out/metrics-$invariant.jsonl" 2>/dev/null
            grep -oE '"(step|mismatch/k3|mismatch/max_abs|time/[a-z_]+)": [-0-9.e]+' \
                "$out/metrics-$invariant.jsonl" | head -24
            limit=160
        done ;;
    step)
        # configs/gpu-h200.yaml's bf16 job needs more than an 80 GB card holds at full micro-batches: there,
        # the same rollouts in half-size micro-batches
        mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
        small=(); [ "${mib:-0}" -lt 100000 ] && small=(-o trainer.tokens_per_microbatch=8192)
        run step ${STEP_S:-590} python3 -P -m rl4bit.bench.step --device cuda --steps 3 --new-tokens 128 --out "$out" \
            --recipes "${STEP_RECIPES:-nvfp4,mxfp8,bf16}" "${small[@]}"
        tail -30 "$out/step.txt" ;;
    train)
        run gemm-train 120 python3 -P -m rl4bit.bench.gemm --out "$out"
        grep -E "grouped forward|dgrad|wgrad" "$out/gemm-train.txt" | head -20
        run bench-train 120 python3 -P -m rl4bit.bench.train --device cuda --out "$out"
        tail -12 "$out/bench-train.txt"
        if [ "${SWEEP_MXFP8:-0}" = 1 ]; then  # adopted into MX_TRAIN / WGRAD (docs/performance.md); rerun on a new card
            run sweep-mxfp8 ${SWEEP_S:-200} python3 -P scripts/sweep_mxfp8_gemm.py --reps 5 --out "$out"
            grep -vE "^\s*$" "$out/sweep-mxfp8.txt" | tail -50
        fi
        mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
        small=(); [ "${mib:-0}" -lt 100000 ] && small=(-o trainer.tokens_per_microbatch=8192)
        run profile-train ${PROFILE_S:-200} python3 -P scripts/profile_train.py --recipes ${PROFILE_RECIPES:-bf16,nvfp4} ${PROFILE_ARGS:---sites} \
            "${small[@]}"
        tail -80 "$out/profile-train.txt" ;;
    formats)
        run bench-kernels 150 python3 -P -m rl4bit.bench.kernels --device cuda --out "$out"
        tail -45 "$out/bench-kernels.txt"
        mkdir -p "$out/sweep"
        run sweep-formats ${SWEEP_S:-400} python3 -P -m rl4bit.bench.kernels --device cuda --sweep --out "$out/sweep"
        grep -E "default|NO|Error" "$out/sweep-formats.txt" | head -20
        python3 - "$out/sweep/bench_kernels.json" <<'PY' 2>&1 | tee -a "$out/sweep-best.txt"
import json, sys
rows = json.load(open(sys.argv[1]))
for g in sorted({r["kernel"].split(" [")[0] for r in rows}):
    mine = [r for r in rows if r["kernel"].startswith(g + " [")]
    base = next(r for r in mine if r["kernel"].endswith("[default]"))
    ok = sorted((r for r in mine if r["bitwise"]), key=lambda r: r["us"])[:4]
    print(g, "default", round(base["us"], 1), "us", f"{base['of_copy']:.0%} of copy; best:",
          "; ".join(f"{r['kernel'].split(' [')[1][:-1]} {r['us']:.1f} us {r['of_copy']:.0%}" for r in ok),
          "| not bitwise:", sum(r["bitwise"] is False for r in mine))
PY
        ;;
    *) echo "usage: bash scripts/gpu_check.sh [tests | perf | profile | decode | kernels | formats | padding | rl | step | train | all]" >&2
       exit 2 ;;
esac
