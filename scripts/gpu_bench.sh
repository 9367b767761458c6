#!/usr/bin/env bash
# GPU checks and measurements for issue 7, each mode one `run` call of the device tool.
#   scripts/gpu_bench.sh check  GPU tests (kernels vs the torch references on CUDA), a profile, short benches
#   scripts/gpu_bench.sh full   stashes .gguf1/part1 in /tmp, an 8B step profile,
#                               8B plain B=1/16/64 + HF, synthetic a=0.8 k=4 with the 1B draft at B=1/16
#   scripts/gpu_bench.sh adaptive  issue 10: 8B synthetic alpha 0.3/0.7/0.9, adaptive k vs plain at B=1/16/64/256
#   scripts/gpu_bench.sh smol   joins /tmp/part1 + .gguf2/part2 (call it at once after `full`), converts,
#                               SmolLM2-135M B=1/16: plain, n-gram, HF plain and prompt lookup; GPU tests
# Writes logs, JSON and PNG under $OUT (./out here). Tables print last.
set -uo pipefail
MODE=${1:-check}
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
B="python3 -m streamsd.cli --log-level warning bench offline"
log() { echo "=== $(date +%T) $*" | tee -a "$OUT/run.log"; }
gpu_tests() {
  log "GPU tests"
  timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py 2>&1 | grep -v "^\s*$" | tail -12 \
    | tee -a "$OUT/run.log"
}

case "$MODE" in
  check)
    gpu_tests
    timeout 120 python3 scripts/profile_step.py llama-3.1-8b 1 > "$OUT/profile_b1.log" 2>&1; tail -30 "$OUT/profile_b1.log"
    timeout 200 $B --model llama-3.1-8b --batch-sizes 1,16,64 --max-tokens 64 --no-hf \
      --output-json "$OUT/check_8b.json" 2>&1 | tail -12 | tee -a "$OUT/run.log"
    ;;
  full)
    if [ -f .gguf1/part1 ]; then cp .gguf1/part1 /tmp/part1 && log "stashed part1 in /tmp"; fi
    nvidia-smi --query-gpu=name,memory.total,clocks.sm,clocks.mem --format=csv | tee -a "$OUT/run.log"
    log "profile 8B"
    # to a file first: `tee | head` would let head's exit cut the log (and the kernel table) short
    timeout 100 python3 scripts/profile_step.py llama-3.1-8b 1 > "$OUT/profile_b1.log" 2>&1; head -3 "$OUT/profile_b1.log"
    log "8B plain + HF"
    timeout 280 $B --model llama-3.1-8b --batch-sizes 1,16,64 --max-tokens 128 \
      --output-json "$OUT/plain_8b.json" --plot "$OUT/plain_8b.png" 2>&1 | tail -13 | tee -a "$OUT/run.log"
    log "8B synthetic a=0.8 k=4, 1B draft"
    timeout 240 $B --model llama-3.1-8b --draft-model llama-3.2-1b --speculative-method synthetic \
      --acceptance-rate 0.8 --num-speculative-tokens 4 --batch-sizes 1,16 --max-tokens 128 --no-hf \
      --output-json "$OUT/synth_8b.json" --plot "$OUT/synth_8b.png" 2>&1 | tail -11 | tee -a "$OUT/run.log"
    ;;
  smol)
    cat /tmp/part1 .gguf2/part2 > /tmp/smollm2.gguf && sha256sum /tmp/smollm2.gguf | tee -a "$OUT/run.log"
    log "convert"
    STREAMSD_HOME=/tmp/sdhome timeout 200 python3 -c \
      'from streamsd.model.loader import resolve_model; print(resolve_model("/tmp/smollm2.gguf", progress=False))' \
      2>&1 | tail -2 | tee -a "$OUT/run.log"
    log "SmolLM2: plain, n-gram, HF plain + prompt lookup"
    STREAMSD_HOME=/tmp/sdhome timeout 240 $B --model /tmp/smollm2.gguf --speculative-method ngram \
      --batch-sizes 1,16 --max-tokens 128 --output-json "$OUT/smol.json" --plot "$OUT/smol.png" \
      2>&1 | tail -13 | tee -a "$OUT/run.log"
    gpu_tests
    ;;
  adaptive)
    # Issue 10: adaptive k against plain, synthetic acceptance, 8B target (no draft model: c = 0)
    for a in 0.3 0.7 0.9; do
      log "8B synthetic a=$a K=4 adaptive"
      timeout 170 $B --model llama-3.1-8b --speculative-method synthetic --acceptance-rate $a \
        --num-speculative-tokens 4 --batch-sizes 1,16,64,256 --max-tokens 48 --no-hf --speculation-policy adaptive \
        --output-json "$OUT/adaptive_a$a.json" 2>&1 | tail -11 | tee -a "$OUT/run.log"
    done
    ;;
esac
log "done"
