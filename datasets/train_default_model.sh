#!/usr/bin/env bash
# The recipe of the shipped default model: data, two training phases, export.
#
#   bash datasets/train_default_model.sh [RUN_DIR]
#
# Phase 1 trains on short sequences (distractor documents dropped to fit SHORT_LEN tokens): few
# candidates per question, so the retrieval circuit forms in fewer steps. Phase 2 continues on
# whole prompts (4-12 documents, up to 2048 tokens). Knobs (environment): TRAIN_EXAMPLES (30000),
# MINUTES_SHORT (2.75, 0 skips phase 1), MINUTES (3.25), SHORT_LEN (768), SHORT_BATCH (64),
# BATCH (32), LR (2e-3), WARMUP (100), WORKERS (all cores), DEVICE (auto), KERNEL (auto; torch
# avoids FLA), INIT_FROM (a checkpoint to start from), MEMORY_HEADS (per linear layer, heads given a
# fixed document-scale decay of MEMORY_DECAY per token, default 0.005: hypic_data.train --memory-heads),
# SHIP (1: write hypic/assets/default_model).
# Minutes are training time per phase; data and start-up add about a minute on a 16-core machine.
set -euo pipefail
RUN_DIR=${1:-runs/default-model}
DATA=${DATA:-datasets/synthetic_qa/train-extra8}
WORKERS=${WORKERS:-$(nproc)}
MINUTES_SHORT=${MINUTES_SHORT:-2.75}
MINUTES=${MINUTES:-3.25}

python3 -m hypic_data.synthetic_qa --out "$DATA" --train "${TRAIN_EXAMPLES:-30000}" \
    --validation 500 --test 0 --extra-questions 8 --workers "$WORKERS"

common=(--data "$DATA" --tokenizer hypic/assets/default_model/tokenizer.json
        --device "${DEVICE:-auto}" --kernel "${KERNEL:-auto}" --steps 100000 --lr "${LR:-2e-3}"
        --warmup-steps "${WARMUP:-100}" --extra-questions 8 --answer-weight 1 --eval-every 250
        --eval-examples 400 --workers "$WORKERS" --save-every 0 --no-progress
        --memory-heads "${MEMORY_HEADS:-0}" --memory-decay "${MEMORY_DECAY:-0.005}")
phase() {  # phase MINUTES SEQ_LEN BATCH OUT [INIT]
    python3 -m hypic_data.train "${common[@]}" --schedule-minutes "$1" \
        --max-minutes "$(python3 -c "print($1 + 0.25)")" --seq-len "$2" --batch-size "$3" \
        --out "$4" ${5:+--init-from "$5"}
}
init=${INIT_FROM:-}
if [[ "$MINUTES_SHORT" != 0 ]]; then
    phase "$MINUTES_SHORT" "${SHORT_LEN:-768}" "${SHORT_BATCH:-64}" "$RUN_DIR/short" "$init"
    init=$RUN_DIR/short
fi
phase "$MINUTES" 2048 "${BATCH:-32}" "$RUN_DIR" "$init"
if [[ "${SHIP:-0}" == 1 ]]; then
    python3 -m hypic_data.export --src "$RUN_DIR" --dst hypic/assets/default_model --dtype bfloat16
fi
