#!/usr/bin/env bash
# The default model's whole training run on one H200 (README "Retraining"): corpus, a throughput probe of the
# curriculum's shapes (their compiled programs land in the persistent cache the run reuses), then the run,
# which is cut to end MINUTES after this script starts. Extra arguments go to training.train_default.
#   MINUTES=12 W=/tmp/dm bash training/h200_run.sh
# The next session's one device call (probe 3 batch shapes with the blocked training attention, then train the
# shipped model; run tool, carry [".wt/<worktree>"], timeout 600):
#   cd .wt/<worktree> && set -o pipefail && MINUTES=9.5 W=/tmp/dm PROBE=2048x32,2048x64,8192x8 \
#     bash training/h200_run.sh 2>&1 | tail -c 20000 > $OUT/log;
#   cp /tmp/dm/probe/*.json /tmp/dm/run/*.json /tmp/dm/run/*.png $OUT/ 2>/dev/null || true
# ATTENTION (default blocked, dsv41_jax/train_attention.py) picks the training attention of probe and run.
set -euo pipefail
W=${W:-/tmp/dm}
MINUTES=${MINUTES:-12}
END=$(( $(date +%s) + ${MINUTES%.*} * 60 ))
mkdir -p "$W"
rm -f "$W/DONE"
trap 'touch "$W/DONE"' EXIT
export PYTHONUNBUFFERED=1
python3 -m training.code_corpus --out "$W/corpus"
python3 -m training.train_default --corpus "$W/corpus" --out "$W/probe" --cache-dir "$W/jax_cache" \
    --probe "${PROBE:-2048x32,8192x8}" --probe-steps 8 --attention "${ATTENTION:-blocked}"
LEFT=$(python3 -c "import time; print(round(($END - time.time()) / 60, 2))")
python3 -m training.train_default --corpus "$W/corpus" --out "$W/run" --cache-dir "$W/jax_cache" \
    --total-minutes "$LEFT" --minutes "$LEFT" --attention "${ATTENTION:-blocked}" "$@"
