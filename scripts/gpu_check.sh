#!/usr/bin/env bash
# GPU checks on the lent H200 image (torch, triton, transformers; no ray, no vllm), one device call a mode (each
# under the 10-minute call limit; fourteenth-session times), outputs into $OUT (or ./gpu-check-out), at most 8
# files a mode (what the device tool brings back). Stops at nothing: every step's exit code is in steps.txt.
#   source scripts/device_env.sh && bash scripts/gpu_check.sh [tests | perf | profile | decode | kernels | padding | grid | rl | step | all]
#   tests: the GPU tests of the decode path's kernels (~5.5 min on the H200; on a cold H100 the first call
#          passed 6 minutes at half the tests, the same tests warm took 2.8 min: seventeenth session)
#   perf: the batch-1 decode profile, `bench rollout` (4.5 min on the H100), `bench gemm --decode`, the one-token decode GEMM sweep and
#         the attention split sweep (~7 min)
#   rl:   RL parity (2 steps, invariant kernels on and off; 6.3 min on a cold H100, eighteenth session, where
#         the "on" run's 160 s limit cut its final evaluation: now 220 s)
#   step: `bench step` alone (the nvfp4 job took ~3 min on the H100 before the bf16 job ran out of memory;
#         both jobs, half-size micro-batches on GPUs under 100 GB: predicted 6-8 min, not yet run)
#   profile: decode profiles at batch 16 and 64 (where the NVFP4 / BF16 targets are), the routing kernel's
#         warp sweep and the decode GEMM sweep at those batches (not yet run; ~7 min predicted)
#   decode: which 16-wide-step form is wrong (check_k16), the decode tile sweep on bench rollout's experts at
#         1 / 16 / 64 tokens (w_first and 8-warp tiles included), then the NVFP4 engine's rollout with the
#         default tile beside the sweep's best, side by side (scripts/ab_decode_config.py; 235 s, cold H100)
#   kernels: `bench gemm --decode` (the whole table), the attention split sweep (batch 8 added), the
#         batch-1 decode profile (87 s on a warm H100, eighteenth session) and the activation quantize's warp sweep
#   padding: the batch-1 profile and `bench rollout --compare-unmarked` at batch 1 / 4 / 16 (twentieth session,
#         174 s warm on an H100)
#   grid: `probe_gemm_context.py --padding`, the grouped GEMM GPU tests, then `padding` (the twentieth session's
#         grid change, not yet run: ~8 min predicted, cold)
#   all (the default): tests, then the profile and `bench rollout` (~9.7 min warm on the H200, the fourteenth
#         session's first call; past the 10-minute call limit on a cold H100: there, `tests` and `perf` apart)
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
    run k16 90 python3 -P scripts/check_k16.py  # which 16-wide-step form is wrong (seventeenth session)
    tail -40 "$out/k16.txt"
}
profile_and_rollout() {
    run profile1 90 python3 -P scripts/profile_decode.py --batch 1 --new 128 --temperature 1.0 --rows 30
    grep -A 20 "GPU kernels" "$out/profile1.txt" | head -44
    run rollout 300 python3 -P -m rl4bit.bench_rollout --device cuda
    tail -30 "$out/rollout.txt"
}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv > "$out/gpu.txt" 2>&1
case "$mode" in
    tests) tests ;;
    all) tests; profile_and_rollout ;;
    perf)
        profile_and_rollout
        run gemm 60 python3 -P -m rl4bit.bench_gemm --decode
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
        run k16 90 python3 -P scripts/check_k16.py
        tail -40 "$out/k16.txt"
        run sweep-decode 280 python3 -P scripts/sweep_decode_gemm.py --one-token --rollout --out "$out"
        grep -E "^[a-z0-9]|pick_config|not bitwise" "$out/sweep-decode.txt" | head -40
        run ab 200 python3 -P scripts/ab_decode_config.py --sweep "$out/sweep_decode_gemm.json" --out "$out"
        cat "$out/ab.txt" | tail -20 ;;
    kernels)
        run gemm 90 python3 -P -m rl4bit.bench_gemm --decode --out "$out"
        run attention 120 python3 -P scripts/sweep_attention.py
        tail -40 "$out/attention.txt"
        run profile1 90 python3 -P scripts/profile_decode.py --batch 1 --new 128 --temperature 1.0 --rows 30
        grep -A 30 "GPU kernels" "$out/profile1.txt" | head -70
        run quantize 120 python3 -P scripts/sweep_quantize.py  # written in the eighteenth session, not yet run
        cat "$out/quantize.txt" ;;
    padding)
        # the padding mark's gain (nineteenth session, built on the CPU): the batch-1 profile, then both engines
        # with the mark on and off side by side at batch 1 / 4 / 16 (16: no padding rows, the spread)
        run profile1 90 python3 -P scripts/profile_decode.py --batch 1 --new 128 --temperature 1.0 --rows 30
        grep -A 30 "GPU kernels" "$out/profile1.txt" | head -70
        run unmarked 300 python3 -P -m rl4bit.bench_rollout --device cuda --batches 1,4,16 --new-tokens 256 \
            --compare-unmarked --out "$out"
        tail -30 "$out/unmarked.txt" ;;
    grid)
        # the grouped GEMMs' live-tiles-first grid (twentieth session, built on the CPU): the probe's 64-row cases
        # against the 4-row call, the grouped GEMM GPU tests, then what `padding` runs
        run probe 120 python3 -P scripts/probe_gemm_context.py --padding
        grep -v Warn "$out/probe.txt" | tail -12
        run qgemm 300 python3 -P -m pytest -q -p no:cacheprovider tests/kernels/test_qgemm_triton.py
        tail -3 "$out/qgemm.txt"
        bash "$0" padding ;;
    rl)
        # RL_INVARIANT (default "true false") picks the runs, RL_TEMPERATURE (default 1.0) the sampling temperature
        limit=220  # the first job compiles (25 s a step on an H100)
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
        # configs/gpu-h200.yaml's bf16 job peaked at 77.3 GiB on the H200 and ran out of memory on an 80 GB H100
        # (eighteenth session): there, the same rollouts in half-size micro-batches
        mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
        small=(); [ "${mib:-0}" -lt 100000 ] && small=(-o trainer.tokens_per_microbatch=8192)
        run step 540 python3 -P -m rl4bit.bench_step --device cuda --steps 3 --new-tokens 128 --out "$out" "${small[@]}"
        tail -30 "$out/step.txt" ;;
    *) echo "usage: bash scripts/gpu_check.sh [tests | perf | profile | decode | kernels | padding | grid | rl | step | all]" >&2
       exit 2 ;;
esac
