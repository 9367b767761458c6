#!/usr/bin/env bash
# GPU checks and measurements for issue 7, each mode one `run` call of the device tool.
#   scripts/gpu_bench.sh check  GPU tests (kernels vs the torch references on CUDA), a profile, short benches
#   scripts/gpu_bench.sh full   stashes .gguf1/part1 in /tmp, an 8B step profile,
#                               8B plain B=1/16/64 + HF, synthetic a=0.8 k=4 with the 1B draft at B=1/16
#   scripts/gpu_bench.sh adaptive  issue 10: 8B synthetic, adaptive k vs plain, B 1..256 x alpha 0.3..0.9 (one call)
#   scripts/gpu_bench.sh b64       issue 10: the batch-64 row alone, adaptive then fixed k = 1 and 2 (alpha 0.7, 0.9),
#                               with each cost key's first samples: why the policy chooses the k it does (~3 min);
#                               BATCH=128 (or any) for another row, RUNS="fixed:1 fixed:2" for other policies
#   scripts/gpu_bench.sh verify    every CUDA test of the GPU paths, then scripts/launch_costs.py and host_phases.py
#   scripts/gpu_bench.sh pipeline  GPU tests (lookahead, kernels, EAGLE's CUDA paths); 8B plain B=1/16/64, pipelined
#                               plain steps vs not (--unpipelined-plain), one call
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
  verify)
    # Every CUDA test of the GPU paths (kernels, graphs, EAGLE, pipelined steps), unbounded by a short limit
    # (~4 min on a fresh machine: Triton compiles), then the host-cost probes. One call, no model files.
    log "CUDA tests"
    timeout 420 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_lookahead.py tests/test_eagle.py \
      -k "cuda or queued or pipelined or rejection or warp or sample_kernel or int32 or graph or rng or warm or restart" \
      2>&1 | tail -4 | tee -a "$OUT/run.log"
    log "launch costs, host phases (tiny target)"
    timeout 120 python3 scripts/launch_costs.py 2>&1 | grep -v shards | tee "$OUT/launch_costs.log" | tail -12
    timeout 150 python3 scripts/host_phases.py --out "$OUT/host_phases.json" > "$OUT/host_phases.log" 2>&1
    grep -E "^(exclusive|function|steps|wall)" "$OUT/host_phases.log" | tee -a "$OUT/run.log"
    ;;
  pipeline)
    log "GPU tests: lookahead, kernels, EAGLE on CUDA"
    timeout 200 python3 -m pytest -q -p no:cacheprovider tests/test_lookahead.py tests/test_kernels.py tests/test_eagle.py \
      -k "cuda or fast_eagle or chain or hidden or fast_forward or rng or warm or rejection or queued" 2>&1 | tail -6 \
      | tee -a "$OUT/run.log"
    log "8B plain, pipelined vs not"
    timeout 300 $B --model llama-3.1-8b --batch-sizes 1,16,64 --max-tokens 128 --no-hf --unpipelined-plain \
      --output-json "$OUT/pipeline_8b.json" 2>&1 | tail -12 | tee -a "$OUT/run.log"
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
    # Issue 10: adaptive k against plain, synthetic acceptance, 8B target (no draft model: c = 0).
    # Each cell: PAIRS (default 3) plain + measured pairs, the median pair reported.
    # One call: the grid B x alpha shares one plain pass per B (the JSON is rewritten after every B,
    # so a run cut short keeps its cells). Per cell: speedup, alpha, decode step ms, predicted vs
    # measured step time (pred_err_pct), and the start-up profile under "profile".
    log "8B synthetic K=4 adaptive: B 1,4,16,64,128,256 x alpha 0.3,0.5,0.7,0.9"
    timeout 420 $B --model llama-3.1-8b --speculative-method synthetic --acceptance-rate 0.3,0.5,0.7,0.9 \
      --num-speculative-tokens 4 --batch-sizes 1,4,16,64,128,256 --max-tokens 64 --no-hf \
      --speculation-policy adaptive --forced-plain --paired-plain --pairs "${PAIRS:-3}" --output-json "$OUT/adaptive_grid.json" --plot "$OUT/adaptive_grid.png" \
      > "$OUT/adaptive_grid.log" 2>&1
    tail -45 "$OUT/adaptive_grid.log" | tee -a "$OUT/run.log"
    python3 - "$OUT/adaptive_grid.json" <<'PY' | tee -a "$OUT/run.log"
import json, sys
d = json.load(open(sys.argv[1]))
print("profile:", {k: v for k, v in (d.get("profile") or {}).items() if k != "step_ms"})
plain = {c["batch"]: c for c in d["cells"] if c["method"] == "plain"}
print("alpha  B   speedup(vs paired plain)  decode_speedup  alpha_meas  dec_step_vs_plain  pred_err%  raw%  shape_err%  plain_steps  desyncs  compiles")
for c in d["cells"]:
    if c["method"] == "synthetic":
        print(f"{c['acceptance_rate']:.1f} {c['batch']:4d}  {c['measured_speedup']:6.2f}  {c.get('decode_speedup')}  "
              f"{c['acceptance']}  {c.get('decode_step_vs_plain')}  {c.get('pred_err_pct')}  {c.get('pred_err_raw_pct')}  "
              f"{c.get('pred_err_shape_pct')}  {c.get('plain_step_share')}  {c.get('desyncs')}/{c.get('warm_desyncs_per_pass')}  "
              f"{c.get('kernel_compiles')}  drift {c.get('plain_drift')}  pairs {c.get('pair_measured_speedup')}  "
              f"A/A {c.get('plain_spread')}  {c.get('verdict')}")
for c in d["cells"]:
    if c["method"] == "spec k=0":
        print(f"forced k=0 B={c['batch']}: decode step {c.get('decode_step_vs_plain')}x plain, TPOT ratio {c.get('measured_speedup')}, "
              f"decode tok/s ratio {c.get('decode_speedup')}, plain drift {c.get('plain_drift')}, "
              f"pairs TPOT {c.get('pair_measured_speedup')} step {c.get('pair_decode_step_vs_plain')}, "
              f"A/A {c.get('plain_spread')} {c.get('verdict')}")
print("compiles in plain passes:", [c.get("kernel_compiles") for c in d["cells"] if c["method"] == "plain"])
print("method alpha B: gc_ms device_allocs alloc_retries decode_step_ms decode_step_max_ms")
for c in d["cells"]:
    print(c["method"], c.get("acceptance_rate"), c["batch"], c.get("gc_ms"), c.get("device_allocs"), c.get("alloc_retries"),
          c.get("decode_step_ms"), c.get("decode_step_max_ms"))
PY
    ;;
  b64)
    # Issue 10: at B = 64, alpha 0.7 fixed k = 1 read 1.44x and the adaptive policy 1.30x at k = 2 (session 21):
    # the adaptive row, then fixed k = 1 and 2, each cell's chosen k and the cost keys of batch 64 with the first
    # samples (measured / raw) that priced them.
    batch=${BATCH:-64}
    for run in ${RUNS:-adaptive:4 fixed:1 fixed:2}; do
      policy=${run%%:*} k=${run##*:} name="b${batch}_${run%%:*}_k${run##*:}"
      log "B=$batch alpha 0.7,0.9: $policy k=$k"
      timeout 150 $B --model llama-3.1-8b --speculative-method synthetic --acceptance-rate 0.7,0.9 \
        --num-speculative-tokens "$k" --batch-sizes "$batch" --max-tokens 64 --no-hf --speculation-policy "$policy" \
        --paired-plain --pairs "${PAIRS:-3}" --output-json "$OUT/$name.json" > "$OUT/$name.log" 2>&1
      python3 - "$OUT/$name.json" "$batch" <<'PY' | tee -a "$OUT/run.log"
import json, sys
d = json.load(open(sys.argv[1]))
bucket = f"{int(sys.argv[2]).bit_length() - 1}x"  # batch buckets 1, 2, 4, ...: key = batch x width bucket
for c in d["cells"]:
    if c["method"] == "plain":
        continue
    a = c.get("adaptive") or {}
    print(f"alpha {c.get('acceptance_rate')}: {c.get('measured_speedup')}x pairs {c.get('pair_measured_speedup')} "
          f"step/plain {c.get('decode_step_vs_plain')} tau {c.get('tau')} acceptance {c.get('acceptance')} "
          f"desyncs {c.get('desyncs')} queued {c.get('queued_steps_taken')}/{c.get('queued_steps_dropped')} "
          f"chosen k {a.get('chosen_k')} prior {a.get('prior_means')}")
    for key, v in (a.get("cost_relative") or {}).items():
        if key.startswith(bucket):
            print(f"  key {key}: relative {v[0]:.3f} from {v[1]} samples, first {v[2]}")
PY
    done
    ;;
esac
log "done"
