#!/usr/bin/env bash
# Issue 9 on the lent H200: train the EAGLE-3 head of SmolLM2-135M-Instruct, then time it. Each mode is
# one `run` call of the device tool, made one right after the other (the machine keeps /tmp while warm).
#   scripts/gpu_eagle.sh stash  carry .gguf1: copies part1 of the default model's GGUF to /tmp (seconds)
#   scripts/gpu_eagle.sh stash2 carry .gguf2a (when part2 does not fit beside the tree: split as 2a + 2b)
#   scripts/gpu_eagle.sh train  carry .gguf2 (or .gguf2b) .whl: joins the parts, converts; GPU checks (the hidden-
#                               stream fast path, EAGLE's graphs); `streamsd train-draft --device cuda` with
#                               time budgets (writing + answering 4 min, training 2.5 min; ~8.5 min in all);
#                               the head, its training.json and eval_report.json into $OUT/head.
#   scripts/gpu_eagle.sh ablate carry .gguf2b .whl (after stash + stash2): the target answers the 4539 prompts
#                               it wrote in session 3 (2.5 min, saved with their streams to /tmp/samples.pt),
#                               then heads that differ in one setting train 80 s each on those same answers
#                               (train-draft --samples-cache); their validation figures -> $OUT/ablation.json.
#   scripts/gpu_eagle.sh final  (at once after ablate) the setting with the best validation trains for 5 min
#                               on the same answers, then the held-out evaluation; the head into $OUT/head.
#   scripts/gpu_eagle.sh b1     carry .gguf2 .whl .head (after a fresh `stash`, or at once after `train`):
#                               batch-1 tokens/s of plain / n-gram / eagle / HF at T=0 and T=1, then host ms per
#                               step by phase for each engine (bench_eagle.py --phases)
#                               (scripts/bench_eagle.py), ~3 min.
#   scripts/gpu_eagle.sh figures carry .gguf2b .whl (after stash + stash2): the shipped head at batch 1, fixed and
#                               adaptive policy: 6 prompts x 128 tokens beside HF, then all 16 held-out x 256
#                               (no HF); then `streamsd bench offline` plain vs n-gram vs HF + prompt lookup, ~6 min.
#   scripts/gpu_eagle.sh heldout carry .gguf2b .whl (after stash + stash2): the 16 held-out x 256 of `figures` only
#                               (METHODS=eagle,eagle-ad: those beside plain; PHASES=1: then host ms per phase)
#   scripts/gpu_eagle.sh kernels carry .gguf2b .whl (after stash + stash2): kernels per step, plain vs eagle k = 4
#   scripts/gpu_eagle.sh gaps   carry .gguf2b .whl (after stash + stash2): the GPU's idle time between kernels,
#                               plain vs tree TREES (default 4,6,6,24): short gaps inside a replay, long ones between
#   scripts/gpu_eagle.sh timeline carry .gguf2b .whl (after stash + stash2): per-step wall times of whole answers,
#                               plain vs TREES (scripts/step_timeline.py): start, steady steps and end apart
#   scripts/gpu_eagle.sh treetests carry .gguf1 (= stash, then the CUDA tests of draft trees and of EAGLE's chains;
#                               TESTS_K: another pytest -k selection)
#   scripts/gpu_eagle.sh trees  carry .gguf2b .whl (after stash + stash2; HEAD_DIR: another head): batch 1, 16 held-out x 256: plain, n-gram,
#                               eagle k = 4 and the draft trees of TREES ('D,M,C,N;...'), T=0 and T=1 (PHASES=1:
#                               host ms per phase; HF=1: HF transformers beside them;
#                               DTYPE=float32: the engines in float32; TEMPS: e.g. 0)
#   scripts/gpu_eagle.sh batches carry .gguf2b .whl (after stash + stash2): plain vs eagle adaptive vs TREE (default
#                               4,6,6,24; GATE=N: and the tree while at most N decode) at BATCHES (default
#                               1,4,16,64), T=0 and T=1 (scripts/tree_batch.py)
#   scripts/gpu_eagle.sh shapes carry .gguf2b .whl (after stash + stash2): each tree shape of SHAPES alone on the
#                               default model, graphs captured up to batch 16, answers beside plain's (BLOCKING=1:
#                               CUDA_LAUNCH_BLOCKING=1, so a device-side assert names its kernel)
#   scripts/gpu_eagle.sh bench  (optional, while still warm; carry .whl) `streamsd bench offline` with the
#                               new head: plain vs eagle vs HF, then plain vs n-gram vs HF + prompt lookup
#   scripts/gpu_eagle.sh biggen carry .gguf2b .whl (after stash + stash2): more answers than session 6's: the 4539
#                               prompts of session 3, as many again written by the target, answered alternately at
#                               T = 0 / 0.7 / 1 (5 min), saved with their streams to /tmp/big.pt; a token training run
#   scripts/gpu_eagle.sh bigtrain (at once after biggen) norm_first trains ${MINUTES:-7.5} min on /tmp/big.pt, then the
#                               held-out evaluation; the head into $OUT/head and /tmp/eagle_head (trees: HEAD_DIR=)
# Writes logs and JSON under $OUT (./out here). Tables print last.
set -uo pipefail
MODE=${1:-train}
OUT=${OUT:-out}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} STREAMSD_HOME=/tmp/sdhome
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=$PYTHONPATH:/tmp/site
elif [ -d /tmp/site ]; then
  export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
log() { echo "=== $(date +%T) $*" | tee -a "$OUT/run.log"; }
HEAD=/tmp/eagle_head
GGUF=/tmp/smollm2.gguf
join_gguf() {  # part1 (stash) + part2, carried whole or as 2a (stash2) + 2b
  # (two parts: part1 + .gguf2b/part, with no stash2, when the tree travels without docs/)
  if [ -f .gguf2/part2 ]; then cat /tmp/part1 .gguf2/part2 > $GGUF
  else cat /tmp/part1 $([ -f /tmp/part2a ] && echo /tmp/part2a) .gguf2b/part > $GGUF; fi
}

model_and_prompts() {  # the joined, converted model; session 3's self-written prompts and the held-out ones as JSONL
  join_gguf && sha256sum $GGUF | tee -a "$OUT/run.log"
  timeout 90 python3 -c "from streamsd.model.loader import resolve_model; print(resolve_model('$GGUF', progress=False))" \
    2>&1 | tail -1 | tee -a "$OUT/run.log"
  python3 scripts/eagle_variants.py prompts docs/issue9-eagle/session3/retrain/head/training.json \
    streamsd/assets/eagle/smollm2-135m-instruct/training.json /tmp/prompts.jsonl /tmp/heldout.jsonl | tee -a "$OUT/run.log"
}

# biggen and bigtrain: the same answers (biggen writes /tmp/big.pt, bigtrain reads it) and the same recipe
BIG="python3 -m streamsd.cli --log-level warning train-draft --model $GGUF --device cuda --prompts /tmp/prompts.jsonl
  --eval-prompts-file /tmp/heldout.jsonl --num-prompts 9000 --temperatures 0,0.7,1 --max-new-tokens 512 --gen-batch 512
  --epochs 100 --batch-tokens 16384 --samples-cache /tmp/big.pt --lr 2e-3 --norm-before-residual on"

case "$MODE" in
  stash)
    cp .gguf1/part1 /tmp/part1 && ls -l /tmp/part1 | tee -a "$OUT/run.log"
    ;;
  stash2)
    # With the shipped head tracked, part1 + part2 no longer fit one call's 64 MiB beside the tree:
    # part2 travels as .gguf2a (stashed here) and .gguf2b (carried by train / b1).
    cp .gguf2a/part /tmp/part2a && ls -l /tmp/part2a | tee -a "$OUT/run.log"
    ;;
  train)
    join_gguf && sha256sum $GGUF | tee -a "$OUT/run.log"
    log "convert"
    timeout 90 python3 -c "from streamsd.model.loader import resolve_model; print(resolve_model('$GGUF', progress=False))" \
      2>&1 | tail -2 | tee -a "$OUT/run.log"
    nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader | tee -a "$OUT/run.log"
    log "GPU checks: the fast forward's captured streams, a graph that returns them"
    GRAPHS=""
    timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py tests/test_eagle.py \
      -k "fast_forward or hidden or cuda" > "$OUT/gpu_tests.log" 2>&1
    rc=$?
    tail -3 "$OUT/gpu_tests.log" | tee -a "$OUT/run.log"
    if [ $rc -ne 0 ]; then
      GRAPHS="--no-cuda-graphs"; log "checks exit $rc: training and evaluating without CUDA graphs"
    fi
    # The 16 MT-Bench first turns the CPU-trained head was evaluated on (in its training.json): held out
    # again, so the two heads compare; the training prompts are all written by the target itself.
    python3 -c "
import json
held = json.load(open('streamsd/assets/eagle/smollm2-135m-instruct/training.json'))['held_out']
open('/tmp/heldout.jsonl', 'w').write(''.join(json.dumps({'prompt': p}) + '\n' for p in held))
print(len(held), 'held-out prompts')" | tee -a "$OUT/run.log"
    # Written straight into $OUT: saved before the evaluation, so it comes back even if the call runs out.
    log "train-draft (log: $OUT/train.log)"
    # Session 3: 4x the prompts, answers admitted in waves (graph replays), and no draft vocabulary: the
    # head drafts through the target's frozen lm_head over all 49152 ids (14 % of MT-Bench answer tokens
    # fell outside the 6144 of the session 2 head), so the file holds no vocabulary-sized matrix.
    timeout 480 python3 -m streamsd.cli --log-level warning train-draft --model $GGUF --out "$OUT/head" --device cuda \
      --eval-prompts-file /tmp/heldout.jsonl --num-prompts 6000 --max-new-tokens 512 --gen-batch 256 \
      --gen-time-budget 3.0 --epochs 6 --time-budget 2.0 --batch-tokens 16384 --lr 2e-3 \
      --draft-vocab-size 0 $GRAPHS > "$OUT/train.log" 2>&1
    echo "train-draft exit $?" | tee -a "$OUT/run.log"
    grep -v "^\[" "$OUT/train.log" | tail -8 | tee -a "$OUT/run.log"
    ls -l "$OUT/head" | tee -a "$OUT/run.log"
    rm -rf $HEAD && cp -r "$OUT/head" $HEAD  # for `bench`, a later call while the machine is warm
    grep "eagle_train\|^\[" "$OUT/train.log" | tail -14 | tee -a "$OUT/run.log"
    ;;
  ablate)
    model_and_prompts
    rm -f /tmp/samples.pt
    for v in $(python3 scripts/eagle_variants.py names); do
      log "variant $v"
      timeout 300 python3 -m streamsd.cli --log-level warning train-draft --model $GGUF --out /tmp/variants/$v \
        --device cuda --prompts /tmp/prompts.jsonl --no-self-prompts --eval-prompts-file /tmp/heldout.jsonl \
        --num-prompts 6000 --max-new-tokens 512 --gen-batch 512 --gen-time-budget 2.5 --epochs 100 \
        --time-budget 1.33 --batch-tokens 16384 --samples-cache /tmp/samples.pt --no-eval \
        $(python3 scripts/eagle_variants.py flags $v) > "$OUT/train_$v.log" 2>&1
      echo "exit $?" | tee -a "$OUT/run.log"
      grep "never trained on" "$OUT/train_$v.log" | tee -a "$OUT/run.log"
    done
    python3 scripts/eagle_variants.py table /tmp/variants "$OUT/ablation.json" | tee -a "$OUT/run.log"
    cp "$OUT/ablation.json" /tmp/ablation.json
    ;;
  final)
    BEST=$(python3 scripts/eagle_variants.py best /tmp/ablation.json)
    log "final: variant $BEST, 5 min on the same answers"
    timeout 540 python3 -m streamsd.cli --log-level warning train-draft --model $GGUF --out "$OUT/head" \
      --device cuda --prompts /tmp/prompts.jsonl --no-self-prompts --eval-prompts-file /tmp/heldout.jsonl \
      --num-prompts 6000 --max-new-tokens 512 --gen-batch 512 --epochs 100 --time-budget 5.0 \
      --batch-tokens 16384 --samples-cache /tmp/samples.pt $(python3 scripts/eagle_variants.py flags $BEST) \
      > "$OUT/train.log" 2>&1
    echo "train-draft exit $?" | tee -a "$OUT/run.log"
    grep -v "^\[" "$OUT/train.log" | tail -6 | tee -a "$OUT/run.log"
    grep "never trained on" "$OUT/train.log" | tee -a "$OUT/run.log"
    rm -rf $HEAD && cp -r "$OUT/head" $HEAD
    ;;
  biggen)
    model_and_prompts
    rm -f /tmp/big.pt
    log "biggen: 9000 prompts (4539 given, the rest self-written), T = 0 / 0.7 / 1, 5 min"
    timeout 560 $BIG --out /tmp/variants/gen --gen-time-budget 5.0 --time-budget 0.1 --no-eval \
      > "$OUT/train_gen.log" 2>&1
    echo "exit $?" | tee -a "$OUT/run.log"
    grep -v "^\[" "$OUT/train_gen.log" | tail -4 | tee -a "$OUT/run.log"
    grep "prompts written\|answer tokens\|saved to\|never trained on" "$OUT/train_gen.log" | tee -a "$OUT/run.log"
    ls -l /tmp/big.pt | tee -a "$OUT/run.log"
    ;;
  bigtrain)
    log "bigtrain: norm_first, ${MINUTES:-7.5} min on /tmp/big.pt"
    timeout 585 $BIG --out "$OUT/head" --time-budget ${MINUTES:-7.5} > "$OUT/train.log" 2>&1
    echo "train-draft exit $?" | tee -a "$OUT/run.log"
    grep -v "^\[" "$OUT/train.log" | tail -6 | tee -a "$OUT/run.log"
    grep "never trained on" "$OUT/train.log" | tee -a "$OUT/run.log"
    rm -rf $HEAD && cp -r "$OUT/head" $HEAD
    ;;
  b1)
    # batch-1 tokens/s of plain / n-gram / eagle / HF with a head: carry .gguf2 (after `stash`) and the
    # head directory as .head (or HEAD_DIR=...); ~3 min.
    SRC=${HEAD_DIR:-.head}
    [ -f $GGUF ] || join_gguf
    if [ -d "$SRC" ]; then rm -rf $HEAD && cp -r "$SRC" $HEAD; fi  # else the head `train` left in /tmp
    log "batch 1, plain / n-gram / eagle / HF, T=0 and T=1 (held-out prompts)"
    timeout 240 python3 scripts/bench_eagle.py --model $GGUF --head $HEAD --held-out $HEAD/training.json \
      --prompts 6 --max-tokens 128 --device cuda --phases --out "$OUT/bench_b1.json" > "$OUT/bench_b1.log" 2>&1
    echo "bench exit $?" | tee -a "$OUT/run.log"
    tail -28 "$OUT/bench_b1.log" | tee -a "$OUT/run.log"
    ;;
  figures)
    [ -f $GGUF ] || join_gguf
    sha256sum $GGUF | tee -a "$OUT/run.log"
    timeout 90 python3 -c "from streamsd.model.loader import resolve_model; print(resolve_model('$GGUF', progress=False))" \
      2>&1 | tail -1 | tee -a "$OUT/run.log"
    SHIPPED=streamsd/assets/eagle/smollm2-135m-instruct
    log "batch 1, 6 held-out x 128, plain / n-gram / eagle fixed / eagle adaptive / HF, T=0 and T=1"
    timeout 200 python3 scripts/bench_eagle.py --model $GGUF --head $SHIPPED --held-out $SHIPPED/training.json \
      --prompts 6 --max-tokens 128 --device cuda --adaptive --out "$OUT/b1_hf.json" > "$OUT/b1_hf.log" 2>&1
    echo "bench exit $?" | tee -a "$OUT/run.log"; tail -14 "$OUT/b1_hf.log" | tee -a "$OUT/run.log"
    log "batch 1, all 16 held-out x 256, no HF"
    timeout 150 python3 scripts/bench_eagle.py --model $GGUF --head $SHIPPED --held-out $SHIPPED/training.json \
      --prompts 16 --max-tokens 256 --device cuda --adaptive --no-hf --out "$OUT/heldout16.json" > "$OUT/heldout16.log" 2>&1
    echo "bench exit $?" | tee -a "$OUT/run.log"; tail -13 "$OUT/heldout16.log" | tee -a "$OUT/run.log"
    log "bench offline SmolLM2: plain vs n-gram vs HF plain + prompt lookup, B=1/16"
    timeout 200 python3 -m streamsd.cli --log-level warning bench offline --model $GGUF --speculative-method ngram \
      --batch-sizes 1,16 --max-tokens 128 --output-json "$OUT/smol.json" --plot "$OUT/smol.png" 2>&1 | tail -13 \
      | tee -a "$OUT/run.log"
    ;;
  heldout)
    # carry .gguf2b .whl (after stash + stash2): only the 16 held-out x 256 of `figures`, ~1.5 min.
    [ -f $GGUF ] || join_gguf
    SHIPPED=streamsd/assets/eagle/smollm2-135m-instruct
    log "batch 1, all 16 held-out x 256, no HF"
    timeout 200 python3 scripts/bench_eagle.py --model $GGUF --head $SHIPPED --held-out $SHIPPED/training.json \
      --prompts 16 --max-tokens 256 --device cuda --adaptive --no-hf ${METHODS:+--methods $METHODS} \
      ${PHASES:+--phases} --out "$OUT/heldout16.json" > "$OUT/heldout16.log" 2>&1
    echo "bench exit $?" | tee -a "$OUT/run.log"; grep -v "^\[\|shards\|converting" "$OUT/heldout16.log" | tail -60 \
      | tee -a "$OUT/run.log"
    ;;
  treetests)
    cp .gguf1/part1 /tmp/part1 && ls -l /tmp/part1 | tee -a "$OUT/run.log"
    log "CUDA tests: draft trees, the Triton tree windows, EAGLE's chains and graphs"
    timeout 420 python3 -m pytest -q -p no:cacheprovider tests/test_tree.py tests/test_kernels.py ${EAGLE_TESTS:+tests/test_eagle.py} \
      -k "${TESTS_K:-cuda or tree or topk or bookkeeping or paged_attention or graph or warm or nan_inside}" > "$OUT/cuda_tests.log" 2>&1
    tail -15 "$OUT/cuda_tests.log" | tee -a "$OUT/run.log"
    ;;
  shapes)
    # Each tree shape of SHAPES alone (scripts/tree_shapes_cuda.py), its graphs captured up to batch 16;
    # BLOCKING=1 runs it with CUDA_LAUNCH_BLOCKING=1, so a device-side assert names its kernel.
    [ -f $GGUF ] || join_gguf
    log "tree shapes one by one: ${SHAPES:-3,8,8,24;4,6,6,24}"
    CUDA_LAUNCH_BLOCKING=${BLOCKING:-0} timeout ${LIMIT:-300} python3 scripts/tree_shapes_cuda.py --model $GGUF \
      --head streamsd/assets/eagle/smollm2-135m-instruct --shapes "${SHAPES:-3,8,8,24;4,6,6,24}" > "$OUT/shapes.log" 2>&1
    echo "shapes exit $?" | tee -a "$OUT/run.log"; grep -v "^\[\|shards\|converting" "$OUT/shapes.log" | tail -60 \
      | tee -a "$OUT/run.log"
    ;;
  diag)
    # The bench's engines built one after the other (TREES), CUDA_LAUNCH_BLOCKING=1, a short timed pass:
    # a fault in a tree graph's capture then names its line.
    [ -f $GGUF ] || join_gguf
    SHIPPED=streamsd/assets/eagle/smollm2-135m-instruct
    for blocking in 1 0; do
      log "engines of the bench, CUDA_LAUNCH_BLOCKING=$blocking: trees ${TREES:-5,4,4,16;3,8,8,24}"
      CUDA_LAUNCH_BLOCKING=$blocking timeout 150 python3 scripts/bench_eagle.py --model $GGUF --head $SHIPPED \
        --held-out $SHIPPED/training.json --prompts 1 --max-tokens 32 --device cuda --no-hf --methods eagle,ngram \
        --trees "${TREES:-5,4,4,16;3,8,8,24}" > "$OUT/diag_$blocking.log" 2>&1
      echo "exit $?" | tee -a "$OUT/run.log"
      grep -v "Indexing.cu\|^\[\|shards\|converting" "$OUT/diag_$blocking.log" | tail -40 | tee -a "$OUT/run.log"
    done
    ;;
  trees)
    [ -f $GGUF ] || join_gguf
    SHIPPED=${HEAD_DIR:-streamsd/assets/eagle/smollm2-135m-instruct}
    log "batch 1, ${PROMPTS:-16} held-out x 256: plain, n-gram, eagle k=4, trees ${TREES:-6,6,6,31}"
    timeout ${LIMIT:-420} python3 scripts/bench_eagle.py --model $GGUF --head $SHIPPED --held-out $SHIPPED/training.json \
      --prompts ${PROMPTS:-16} --max-tokens 256 --device cuda $([ -n "${HF:-}" ] || echo --no-hf) --methods ${METHODS:-eagle,ngram} \
      --trees "${TREES:-6,6,6,31}" ${PHASES:+--phases} ${DTYPE:+--dtype $DTYPE} ${TEMPS:+--temperatures $TEMPS} --out "$OUT/trees.json" > "$OUT/trees.log" 2>&1
    echo "bench exit $?" | tee -a "$OUT/run.log"; grep -v "^\[\|shards\|converting" "$OUT/trees.log" | tail -70 \
      | tee -a "$OUT/run.log"
    ;;
  batches)
    # carry .gguf2b .whl (after stash + stash2): plain vs the adaptive chain vs a tree as the batch grows
    [ -f $GGUF ] || join_gguf
    SHIPPED=streamsd/assets/eagle/smollm2-135m-instruct
    log "batches ${BATCHES:-1,4,16,64}: plain, eagle adaptive, tree ${TREE:-4,6,6,24}"
    timeout ${LIMIT:-500} python3 scripts/tree_batch.py --model $GGUF --head $SHIPPED --held-out $SHIPPED/training.json \
      --tree ${TREE:-4,6,6,24} --gate ${GATE:-0} --batches ${BATCHES:-1,4,16,64} --out "$OUT/batches.json" > "$OUT/batches.log" 2>&1
    echo "batches exit $?" | tee -a "$OUT/run.log"; grep -v "^\[\|shards\|onverting" "$OUT/batches.log" | tail -40 \
      | tee -a "$OUT/run.log"
    ;;
  kernels)
    # carry .gguf2b .whl (after stash + stash2, or at once after figures): the CUDA profiler's kernels per
    # step, plain against fixed eagle k = 4 at batch 1 (scripts/profile_eagle_kernels.py), ~1.5 min.
    [ -f $GGUF ] || join_gguf
    log "kernels per step, plain vs eagle k = 4, batch 1"
    timeout 240 python3 scripts/profile_eagle_kernels.py $GGUF streamsd/assets/eagle/smollm2-135m-instruct 96 \
      "${TREES:-}" > "$OUT/kernels.log" 2>&1
    echo "profile exit $?" | tee -a "$OUT/run.log"; grep "===" "$OUT/kernels.log" | tee -a "$OUT/run.log"
    ;;
  gaps)
    # carry .gguf2b .whl (after stash + stash2): idle GPU time between kernels, plain vs a tree (scripts/profile_gaps.py)
    [ -f $GGUF ] || join_gguf
    log "gaps between kernels, plain vs tree ${TREES:-4,6,6,24}, batch 1"
    timeout 150 python3 scripts/profile_gaps.py $GGUF streamsd/assets/eagle/smollm2-135m-instruct 96 "${TREES:-4,6,6,24}" \
      > "$OUT/gaps.log" 2>&1
    echo "gaps exit $?" | tee -a "$OUT/run.log"; grep -v "^\[" "$OUT/gaps.log" | tail -50 | tee -a "$OUT/run.log"
    ;;
  timeline)
    # carry .gguf2b .whl (after stash + stash2): per-step wall times of whole answers, plain vs TREES
    # (scripts/step_timeline.py): the start, the steady steps and the end of each answer apart
    [ -f $GGUF ] || join_gguf
    log "step timelines, plain vs tree ${TREES:-4,6,6,24}, ${PROMPTS:-4} held-out x 256, batch 1"
    timeout ${LIMIT:-240} python3 scripts/step_timeline.py --model $GGUF --head streamsd/assets/eagle/smollm2-135m-instruct --trees "${TREES:-4,6,6,24}" \
      --prompts ${PROMPTS:-4} --out "$OUT/timeline.json" > "$OUT/timeline.log" 2>&1
    echo "timeline exit $?" | tee -a "$OUT/run.log"; grep -v "^\[\|shards\|converting" "$OUT/timeline.log" | tail -30 \
      | tee -a "$OUT/run.log"
    ;;
  bench)
    B="python3 -m streamsd.cli --log-level warning bench offline --model $GGUF --batch-sizes 1,16 --max-tokens 128"
    log "bench offline: plain vs eagle (the new head) vs HF"
    timeout 200 $B --speculative-method eagle --draft-model $HEAD --output-json "$OUT/offline_eagle.json" \
      2>&1 | tail -10 | tee -a "$OUT/run.log"
    log "bench offline: plain vs n-gram vs HF + prompt lookup"
    timeout 200 $B --speculative-method ngram --output-json "$OUT/offline_ngram.json" 2>&1 | tail -10 \
      | tee -a "$OUT/run.log"
    ;;
esac
log "done"
