#!/usr/bin/env bash
# The recipe of models/sim_so101, from nothing: expert demonstrations and grounding scenes rendered
# from the simulated arm, then pi0.5 trained on them from random weights in three stages on one
# CPU core (a curriculum, each stage ended by its held-out probe's gates or its step cap):
#
#   1. ground_start: grounding questions about scenes at the start pose only, until "where" and
#      "all_cubes" reach GATE there (mixed with moved-arm views from the start, the colours never
#      bind to their cubes);
#   2. ground_all: the same questions, and the node's subtask prompt, about scenes at every kind
#      of moment (start pose, along expert episodes, with DART drift, off-course reaches) until
#      "where", "all_cubes" and "subtask" reach GATE at the start pose and along the episode;
#   3. demos: touch and place demonstrations join (their own warmup and cosine), the questions
#      staying in every step's mix, so the grounding and the subtask's wording are kept.
#
#   scripts/train_sim_policy.sh [WORK_DIR]        (default data/sim_policy)
#
# The checkpoint lands in WORK_DIR/checkpoint (a LeRobot pi05 folder; copy it over models/sim_so101
# without its resume.pt). Resumable: data already written is kept, a stage that ended is not run
# again, and a stopped stage continues from its resume file. Sizes can be made smaller for a quick
# try (TOUCH, PLACE, START_LAYOUTS, MOVED_LAYOUTS, HELDOUT, *_STEPS, ONE_COLOUR, PROBE_EVERY,
# PROBE_SCENES); the defaults are the shipped checkpoint's. WORKERS: rendering processes.
# RESUME_EVERY_MIN: minutes between resume files. BIN: where the oxygen-* commands are (default
# .venv/bin).
set -euo pipefail
WORK="${1:-data/sim_policy}"
BIN="${BIN:-.venv/bin}"
TOUCH="${TOUCH:-500}"                   # touch demonstrations per set (clean, and half DART)
PLACE="${PLACE:-250}"                   # place demonstrations per set
START_LAYOUTS="${START_LAYOUTS:-20000}" # grounding layouts at the start pose, seeds 3,000,000 ...
MOVED_LAYOUTS="${MOVED_LAYOUTS:-6000}"  # layouts seen at 4 moments past the start, 3,100,000 ...
HELDOUT="${HELDOUT:-300}"               # held-out layouts for the probe, seeds 9,000,000 ...
START_STEPS="${START_STEPS:-4000}"      # each stage's cap (its gates usually end it sooner)
ALL_STEPS="${ALL_STEPS:-4000}"
DEMO_STEPS="${DEMO_STEPS:-5000}"
ONE_COLOUR="${ONE_COLOUR:-400}"
GATE="${GATE:-0.95}"
PROBE_EVERY="${PROBE_EVERY:-250}"
PROBE_SCENES="${PROBE_SCENES:-200}"
WORKERS="${WORKERS:-1}"
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
    "$BIN/oxygen-sim-dataset" grounding --out "${out%.npz}.partial.npz" --workers "$WORKERS" "$@"
    mv "${out%.npz}.partial.npz" "$out"
  fi
}

# Demonstrations recorded 1 s past a touch (the expert finishes its reach, 1.7 cm above the cube's
# centre, and holds), the second set with 0.03 rad DART drift on half of its episodes.
demos "$WORK/demos_clean" --touch "$TOUCH" --place "$PLACE" --touch-settle-s 1.0
demos "$WORK/demos_dart" --touch "$TOUCH" --place "$PLACE" --touch-seed 1001200 \
  --place-seed 2001200 --touch-settle-s 1.0 --perturbed-share 0.5 --perturbation-rad 0.03
scenes "$WORK/grounding_start.npz" --layouts "$START_LAYOUTS" --poses 1
scenes "$WORK/grounding_moved.npz" --layouts "$MOVED_LAYOUTS" --poses 5 --seed 3100000 \
  --views along dart off_course
scenes "$WORK/grounding_heldout.npz" --layouts "$HELDOUT" --poses 5 --seed 9000000 \
  --views along dart off_course

resume=()
[[ -f "$WORK/checkpoint/resume.pt" ]] && resume=(--resume)
common=(--dataset "$WORK/demos_clean" --dataset "$WORK/demos_dart" --out "$WORK/checkpoint"
  --preset sim --grounding-heldout "$WORK/grounding_heldout.npz" --probe-every "$PROBE_EVERY"
  --probe-scenes "$PROBE_SCENES" --image-positions sincos --seed 0 --data-seed 0
  --rtc-training-max-delay 4 --flat-fraction 0.1 --no-augment --no-knowledge-insulation
  --start-share 0.2 --start-frames 3 --threads 1 --log-every 50
  --resume-every-min "$RESUME_EVERY_MIN")
both=(start along)
"$BIN/oxygen-train" "${common[@]}" "${resume[@]}" --stage ground_start \
  --grounding "$WORK/grounding_start.npz" --grounding-batch-size 32 \
  --steps "$START_STEPS" --grounding-only-steps "$START_STEPS" --one-colour-steps "$ONE_COLOUR" \
  --lr 1e-3 --warmup-steps 50 --gate "start/where>=$GATE" --gate "start/all_cubes>=$GATE"
gates=()
for pose in "${both[@]}"; do
  for kind in where all_cubes subtask; do gates+=(--gate "$pose/$kind>=$GATE"); done
done
"$BIN/oxygen-train" "${common[@]}" --resume --stage ground_all \
  --grounding "$WORK/grounding_start.npz" --grounding "$WORK/grounding_moved.npz" \
  --grounding-batch-size 32 --steps "$ALL_STEPS" --grounding-only-steps "$ALL_STEPS" \
  --lr 5e-4 --warmup-steps 50 --probe-every "$((2 * PROBE_EVERY))" "${gates[@]}"
"$BIN/oxygen-train" "${common[@]}" --resume --stage demos \
  --grounding "$WORK/grounding_start.npz" --grounding "$WORK/grounding_moved.npz" \
  --grounding-batch-size 24 --batch-size 12 --steps "$DEMO_STEPS" --lr 7e-4 --warmup-steps 200 \
  --probe-every "$((2 * PROBE_EVERY))"
