#!/usr/bin/env bash
# The default model's training run on one H200 (README "Retraining"), split over two device calls of <= 10
# minutes on the same warm machine (the run tool's limit per call). Extra arguments go to training.train_default.
#
#   call 1: CALL=1 PAUSE_S=555 MINUTES=14.5 W=/tmp/dm bash training/h200_run.sh
#           builds the corpus (training.code_corpus) in the background while the step programs compile (into
#           the persistent cache under $W), trains until PAUSE_S seconds after the script started, writes the
#           resumable checkpoint ($W/run/ckpt.pkl) and a copy of the masters split into $OUT (<= 15 MB a file),
#           in case the machine is not the same for call 2.
#   call 2: CALL=2 LEFT_MIN=9.55 MINUTES=14.5 W=/tmp/dm bash training/h200_run.sh
#           resumes the same schedule (MINUTES of training in all), cut to end LEFT_MIN minutes after it starts
#           (export and evaluation included), and leaves $OUT/default_model.tar.part-* (the exported HF checkpoint,
#           training.json, loss_curve.png; split in parts of <= 15 MB). When $W is gone (a fresh machine), it rebuilds the corpus and resumes
#           from the masters carried back in .dm/ (masters.pkl.part-*) with a fresh optimizer state.
# One call (no split): CALL=0 MINUTES=9 LEFT_MIN=9.5 W=/tmp/dm bash training/h200_run.sh (the corpus is built beside
# the compiles, as in call 1).
# Continued training (a second stage from the shipped model: its weights, a fresh optimizer and schedule, the
# 8K phase longer; README "Retraining" says how the shipped model was made). The shipped stage 2 (on an H100,
# where 8 x 8K runs out of memory, hence 8192x4; on an H200 8192x8 fits):
#   CALL=0 MINUTES=5.5 LEFT_MIN=9.5 W=/tmp/dm bash training/h200_run.sh --init-from dsv41_jax/default_model \
#       --peak-lr 6e-4 --phases 2048x32:0.7,8192x4:0.3
# then its draft: python -m training.train_dspark --backbone /tmp/dm/run --corpus /tmp/dm/corpus --out /tmp/dsp \
#       --cache-dir /tmp/dm/jax_cache --total-minutes 5.3 --install
# ATTENTION (default flash: the fused Pallas kernels, 1.49x the step throughput of blocked at 2048 x 32;
# dsv41_jax/train_attention.py, docs/BENCHMARKS.md "Training the default model") picks the training attention;
# HEAD (default bf16: the LM head GEMM in bf16 operands, f32 accumulation, in training only) its head.
set -euo pipefail
T0=$(date +%s)
W=${W:-/tmp/dm}
CALL=${CALL:-0}
MINUTES=${MINUTES:-14.5}
OUT=${OUT:-$W/out}
mkdir -p "$W" "$OUT"
export PYTHONUNBUFFERED=1
COMMON=(--corpus "$W/corpus" --out "$W/run" --cache-dir "$W/jax_cache" --attention "${ATTENTION:-flash}" --head "${HEAD:-bf16}")

WAIT=()
if [ "$CALL" != 2 ] && [ ! -f "$W/corpus/manifest.json" ]; then
  python3 -m training.code_corpus --out "$W/corpus" ${CORPUS_ARGS:-} > "$W/corpus.log" 2>&1 &
  CORPUS_PID=$!
  WAIT=(--wait-corpus 400)
fi
if [ "$CALL" = 1 ]; then
  python3 -m training.train_default "${COMMON[@]}" "${WAIT[@]}" --minutes "$MINUTES" --total-minutes 1000 \
      --pause-at $(( T0 + ${PAUSE_S:-540} )) "$@"
  [ -n "${CORPUS_PID:-}" ] && wait "$CORPUS_PID" && tail -n 3 "$W/corpus.log"
  split -b 15000000 -d "$W/run/masters.pkl" "$OUT/masters.pkl.part-"
  ls -la "$OUT"
  exit 0
fi

if [ "$CALL" = 2 ] && [ ! -f "$W/run/ckpt.pkl" ]; then
  echo "no checkpoint in $W/run: a fresh machine; resuming from the masters in .dm/"
  mkdir -p "$W/run"
  cat .dm/masters.pkl.part-* > "$W/run/masters.pkl"
fi
RESUME=()
[ "$CALL" = 2 ] && RESUME=(--resume)
LEFT=$(python3 -c "import time; print(round(${LEFT_MIN:-9.3} - (time.time() - $T0) / 60, 2))")
python3 -m training.train_default "${COMMON[@]}" "${RESUME[@]}" "${WAIT[@]}" --minutes "$MINUTES" --total-minutes "$LEFT" \
    --reserve 75 "$@"
tar -C "$W/run" -cf "$W/default_model.tar" --exclude ckpt.pkl --exclude masters.pkl --exclude '*.tmp' .
split -b 15000000 -d "$W/default_model.tar" "$OUT/default_model.tar.part-"  # <= 15 MB a returned file
ls -la "$OUT"
