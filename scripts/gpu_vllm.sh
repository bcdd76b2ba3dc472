#!/usr/bin/env bash
# vLLM on the lent GPU: reassemble the wheelhouse parts copied to /tmp/wh, install, then the checks.
#   bash scripts/gpu_vllm.sh [install] [check-tiny] [check] [ipc] [check-mp] [sr] [tests] [bench-rollout] [rl] [bench-kernels]    outputs in $OUT
# bench-rollout leaves out the HF generate baseline (ROLLOUT_ARGS replaces `--no-hf`): minutes a call on a GPU.
# Each step runs under `timeout` (seconds from TINY_S, CHECK_S, MP_S, SR_S, TESTS_S, ROLLOUT_S, RL_S, BENCH_S) so one slow step cannot
# take the later ones' output with it. RL_ARGS: more `-o` overrides for the rl step (an H100: -o trainer.tokens_per_microbatch=8192).
# The rl step's first backend trains the 600-step warm start (~3 min) and caches it; the second reuses it.
set -uo pipefail
out=${OUT:-gpu-vllm-out}; mkdir -p "$out"
log() { echo "[$(date +%T)] $*" | tee -a "$out/steps.txt"; }
run() { local name=$1 limit=$2; shift 2; log "start $name"; timeout "$limit" "$@" > "$out/$name.txt" 2>&1; log "end $name rc=$?"; }
source scripts/device_env.sh
# -P everywhere a module is named from the repo root: its kernels/ would shadow Hugging Face's `kernels`
for step in "$@"; do case $step in
  install)
    if [ ! -f /tmp/site/vllm_env.sh ]; then
      # the parts of `rl4bit wheelhouse /tmp/house --split`, copied to /tmp/wh one call at a time
      (cd /tmp/wh && cat house.tar.part* > house.tar && sha256sum -c house.tar.sha256) && tar -xf /tmp/wh/house.tar -C /tmp \
        && bash /tmp/house/install.sh /tmp/site 2>&1 | tee -a "$out/steps.txt"
    fi
    source /tmp/site/vllm_env.sh
    run import 300 python3 -P -c "import vllm, torch, compressed_tensors; print(vllm.__version__, torch.__version__); from vllm import LLM; print('LLM ok')"
    ;;
  check) source /tmp/site/vllm_env.sh; VLLM_ENABLE_V1_MULTIPROCESSING=0 run check ${CHECK_S:-240} python3 scripts/vllm_gpu_check.py ${CHECK_ARGS:-} --out /tmp/vllm-check ;;
  check-tiny) source /tmp/site/vllm_env.sh; VLLM_ENABLE_V1_MULTIPROCESSING=0 run check_tiny ${TINY_S:-150} python3 scripts/vllm_gpu_check.py --size tiny --batch 16 --new 32 --out /tmp/vllm-check-tiny ;;
  check-mp) source /tmp/site/vllm_env.sh; VLLM_ENABLE_V1_MULTIPROCESSING=1 run check_mp ${MP_S:-200} python3 scripts/vllm_gpu_check.py --size small --batch 32 --new 64 --skip-embedded --out /tmp/vllm-check-mp ;;
  ipc) run ipc 120 python3 -P -m pytest -q -p no:cacheprovider tests/trainer/test_cuda_ipc.py ;;
  sr) run sr ${SR_S:-90} python3 -P -m pytest -q -p no:cacheprovider tests/kernels/test_triton_quantize.py ;;
  tests) source /tmp/site/vllm_env.sh; VLLM_ENABLE_V1_MULTIPROCESSING=0 RL4BIT_VLLM_TESTS=1 run tests ${TESTS_S:-400} python3 -P -m pytest tests/vllm -q -p no:cacheprovider ${TEST_ARGS:-} ;;
  bench-rollout) source /tmp/site/vllm_env.sh; run bench_rollout ${ROLLOUT_S:-480} python3 -P -m rl4bit.cli bench rollout --device cuda --out "$out/bench-rollout" ${ROLLOUT_ARGS:---no-hf} ;;
  rl) source /tmp/site/vllm_env.sh  # issue 40 item 5: the same GRPO job with each sampler, trainer and vLLM on one GPU
    for b in ${RL_BACKENDS:-vllm embedded}; do
      run rl_$b ${RL_S:-450} python3 -P -m rl4bit.cli train configs/gpu-h200.yaml --out /tmp/rl-$b -o rl.steps=${RL_STEPS:-40} \
        -o sampler.backend=$b -o sampler.kv_cache_gib=8 -o sampler.gpu_memory_utilization=0.1 -o run.checkpoint_every=0 -o run.tensorboard=false ${RL_ARGS:-}
      grep -oE '"(step|reward/mean|reward/zero_spread_frac|eval/accuracy|policy/entropy|mismatch/k3|mismatch/max_abs|tis/truncated_frac|time/(step|sample|train|sync)_s|sync/[a-z]+_s)": [-0-9.e]+' \
        /tmp/rl-$b/metrics.jsonl | paste -sd' ' | sed 's/"step"/\n"step"/g' > "$out/rl_$b.summary.txt"
      cp /tmp/rl-$b/metrics.jsonl "$out/metrics-$b.jsonl" 2>/dev/null
    done ;;
  bench-kernels) run bench_kernels ${BENCH_S:-240} python3 -P -m rl4bit.cli bench kernels --device cuda --out "$out/bench-kernels" ;;
esac; done
cp /tmp/vllm-check/result.json "$out/check.json" 2>/dev/null; cp /tmp/vllm-check-tiny/result.json "$out/check_tiny.json" 2>/dev/null; cp /tmp/vllm-check-mp/result.json "$out/check_mp.json" 2>/dev/null
for f in "$out"/*.txt; do echo "== $f"; tail -c 2500 "$f"; done
