#!/usr/bin/env bash
# The recipe of models/sim_so101, from nothing: expert demonstrations and grounding scenes rendered
# from the simulated arm, then pi0.5 trained on them from random weights (one CPU core: about
# 10 minutes of rendering and 35 of training on a 2-core machine shared with other work).
#
#   scripts/train_sim_policy.sh [WORK_DIR]        (default data/sim_policy)
#
# The checkpoint lands in WORK_DIR/checkpoint (a LeRobot pi05 folder; copy it over models/sim_so101
# without its resume.pt). Resumable: data already written is kept, and a training run that was
# stopped continues from its resume file. Sizes can be made smaller for
# a quick try (TOUCH, DART_TOUCH, LAYOUTS, HELDOUT, STEPS, GROUNDING_ONLY, ONE_COLOUR); the
# defaults are the shipped checkpoint's. RESUME_EVERY_MIN: minutes between resume files. BIN: where the oxygen-* commands are (default .venv/bin).
set -euo pipefail
WORK="${1:-data/sim_policy}"
BIN="${BIN:-.venv/bin}"
TOUCH="${TOUCH:-600}"               # clean touch demonstrations, seeds 1,000,000 ...
DART_TOUCH="${DART_TOUCH:-600}"     # touch demonstrations, half with 0.03 rad DART drift
LAYOUTS="${LAYOUTS:-3000}"          # grounding layouts (3 views each), seeds 3,000,000 ...
HELDOUT="${HELDOUT:-150}"           # held-out grounding layouts for the probe, seeds 9,000,000 ...
STEPS="${STEPS:-6000}"
GROUNDING_ONLY="${GROUNDING_ONLY:-1500}"
ONE_COLOUR="${ONE_COLOUR:-600}"
RESUME_EVERY_MIN="${RESUME_EVERY_MIN:-5}"
mkdir -p "$WORK"

demos() {  # demos OUT ARGS...: a dataset, unless a finished one is there
  local out="$1"
  shift
  if [[ ! -f "$out/meta/info.json" ]]; then
    rm -rf "$out"
    "$BIN/oxygen-sim-dataset" demos --out "$out" "$@"
  fi
}

scenes() {  # scenes OUT.npz ARGS...: grounding scenes, written whole or not at all
  local out="$1"
  shift
  if [[ ! -f "$out" ]]; then
    "$BIN/oxygen-sim-dataset" grounding --out "${out%.npz}.partial.npz" "$@"
    mv "${out%.npz}.partial.npz" "$out"
  fi
}

# Touch demonstrations recorded 1 s past the touch: the expert finishes its reach (1.7 cm above the
# cube's centre) and holds there, so the data shows the last centimetres.
demos "$WORK/touch_settle" --touch "$TOUCH" --touch-settle-s 1.0
demos "$WORK/touch_dart_settle" --touch "$DART_TOUCH" --touch-seed 1001200 --touch-settle-s 1.0 \
  --perturbed-share 0.5 --perturbation-rad 0.03
scenes "$WORK/grounding_train.npz" --layouts "$LAYOUTS"
scenes "$WORK/grounding_heldout.npz" --layouts "$HELDOUT" --seed 9000000

resume=()
if [[ -f "$WORK/checkpoint/model.safetensors" ]]; then
  echo "train_sim_policy: $WORK/checkpoint is already trained"
  exit 0
elif [[ -f "$WORK/checkpoint/resume.pt" ]]; then
  resume=(--resume)
fi
"$BIN/oxygen-train" --dataset "$WORK/touch_settle" --dataset "$WORK/touch_dart_settle" \
  --out "$WORK/checkpoint" --preset sim \
  --grounding "$WORK/grounding_train.npz" --grounding-heldout "$WORK/grounding_heldout.npz" \
  --probe-every 500 --probe-scenes 80 --grounding-batch-size 24 \
  --grounding-only-steps "$GROUNDING_ONLY" --one-colour-steps "$ONE_COLOUR" \
  --image-positions sincos --steps "$STEPS" --batch-size 12 --lr 1e-3 --warmup-steps 50 \
  --seed 0 --data-seed 0 --rtc-training-max-delay 4 --flat-fraction 0.1 --no-augment \
  --no-knowledge-insulation --start-share 0.2 --start-frames 3 --threads 1 --log-every 50 \
  --resume-every-min "$RESUME_EVERY_MIN" "${resume[@]}"
