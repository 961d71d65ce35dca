#!/usr/bin/env bash
# Issue 43's GPU checks in one call on a GPU machine that has torch and transformers but nothing of
# this project's (carry .gpu/wheels and .gpu/qwen3.tar.gz, built here by `bash bench/gpu_wheels.sh --trl`):
#   1. the demo scored in process on the GPU: `score --backend transformers --device cuda --dtype
#      bfloat16` over the demo's tiny model, then `scorers list` (the dtype in its column);
#   2. bench/gpu.py: the floor and the episode layout end to end at the default concurrency (4), CUDA
#      graphs on (capture passes first, unmeasured), forwards packed as the library does and one
#      sequence a forward (the 8B's replays took x1.038 the body's time packed at concurrency 4,
#      x1.015 alone at 1). Two runs of the script:
#      a. the 8B (2/3 of GPU_SECONDS; gpu-8b.json; on an H200 2026-12-04: 184 s packed alone, ~280 s
#         with both): 128 episodes a run. Packed (~2 a forward) or not, a window then holds about 64
#         replays or more, so its periodic checks (one replay in 64, verify.CUDA_GRAPHS) come near
#         the policy's rate (each run's checks_at_policy_rate beside its forward_kinds): 48 episodes
#         (24 forwards) held one check, 4 % of that window, where a long run pays ~1.6 %;
#      b. the 0.6B and 1.7B (the rest; gpu-small.json): 64 episodes a run (on an H200: 130 s).
#   3. bench/gpu_trl.py: one TRL GRPO step's hindsight share.
# Everything lands in $OUT (demo.log, gpu-*.json/.log, trl.json/.log). Each part has its own time limit.
# GPU_ALL_DEMO=0 leaves out part 1 (~35 s, at most GPU_ALL_DEMO_S=75; shown on the H100 on 2026-11-28, calls b and c), GPU_ALL_TRL=0
# part 3 (measured with its breakdown on 2026-11-28, calls c and d). With both left out, part 2 alone:
#   GPU_ALL_DEMO=0 GPU_ALL_TRL=0 bash bench/gpu_all.sh 560     # run with timeout_s 600: ~11.5 minutes of device time with the start
#
#   bash bench/gpu_all.sh [GPU_SECONDS] [TRL_SECONDS]      # defaults 400 and 130
set -uo pipefail
gpu_s="${1:-400}"
trl_s="${2:-130}"
out="${OUT:-/tmp/hcapo-out}"
mkdir -p "$out"
nvidia-smi -L
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/hcapo/site-packages \
  .gpu/wheels/*.whl || exit 1
export PYTHONPATH="$PWD:/tmp/hcapo/site-packages" PYTHONUNBUFFERED=1

demo_part() {
  local demo=/tmp/hcapo-demo model
  mkdir -p "$demo"
  python3 -m hcapo_store --db "$demo/demo.db" demo --dir "$demo" --json >"$demo.json" &&
    model="$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["model_dir"])' "$demo.json")" &&
    python3 -m hcapo_store --db "$demo/demo.db" score --backend transformers --model "$model" \
      --device cuda --dtype bfloat16 --max-context 8192 --json &&
    python3 -m hcapo_store --db "$demo/demo.db" scorers list
}
if [[ "${GPU_ALL_DEMO:-1}" != 0 ]]; then
  # bounded, so that the measurements after it keep their time
  timeout "${GPU_ALL_DEMO_S:-75}" bash -c "$(declare -f demo_part); demo_part" 2>&1 | tail -40 | tee "$out/demo.log"
fi

big_s=$((gpu_s * 2 / 3))
timeout "$big_s" python3 bench/gpu.py --shapes 8b --layouts episode --concurrency 4 --prepare processes \
  --graphs on --pack-tokens default 0 --episodes 128 --run-episodes 128 --capture-passes 2 --no-drift \
  --budget-s $((big_s - 10)) --out "$out/gpu-8b.json" 2>&1 | tee "$out/gpu-8b.log"
timeout $((gpu_s - big_s)) python3 bench/gpu.py --shapes 0.6b 1.7b --layouts episode --concurrency 4 \
  --prepare processes --graphs on --pack-tokens default 0 --episodes 64 --run-episodes 64 --capture-passes 2 \
  --no-drift --budget-s $((gpu_s - big_s - 10)) --out "$out/gpu-small.json" 2>&1 | tee "$out/gpu-small.log"
if [[ "${GPU_ALL_TRL:-1}" != 0 ]]; then
  timeout "$trl_s" python3 bench/gpu_trl.py --out "$out/trl.json" 2>&1 | tee "$out/trl.log"
fi
