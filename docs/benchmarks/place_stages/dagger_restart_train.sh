#!/usr/bin/env bash
cd "$(dirname "$0")/../../.."
D=${DATA:-/work/data}
# DAgger restarted from the shipped weights, and the two-step task's first stage: the demonstrations, 400 place
# takeovers the shipped weights drove with the commitment (round 3's labeller), 300 two-step demonstrations.
# data (each on its own core, scripts/train_sim_policy.sh's demonstration sets and smaller grounding sets in $D/r5):
#   .venv/bin/oxygen-sim-dataset on-policy --out $D/dagger/s51a --checkpoint models/sim_so101 --place 200 --seed 8000000 --threads 1 --gripper-commit
#   .venv/bin/oxygen-sim-dataset on-policy --out $D/dagger/s51b --checkpoint models/sim_so101 --place 200 --seed 8100000 --threads 1 --gripper-commit
#   .venv/bin/oxygen-sim-dataset demos --out $D/two_step/demos --touch 0 --place 0 --two-step 300
#   .venv/bin/oxygen-sim-dataset grounding --out $D/r5/grounding_start.npz --layouts 8000 --poses 1
#   .venv/bin/oxygen-sim-dataset grounding --out $D/r5/grounding_moved.npz --layouts 2500 --poses 5 --seed 3100000 --views along dart off_course
exec .venv/bin/oxygen-train --dataset $D/r5/demos_clean --dataset $D/r5/demos_dart \
  --dataset $D/dagger/s51a --dataset $D/dagger/s51b --dataset $D/two_step/demos \
  --out $D/r19/checkpoint --init-from models/sim_so101 --tokenizer models/sim_so101/tokenizer.model \
  --preset sim --grounding-heldout $D/r5/grounding_heldout.npz --probe-every 3000 --probe-scenes 200 \
  --image-positions sincos --seed 7 --data-seed 7 --rtc-training-max-delay 4 \
  --flat-fraction 0.1 --no-augment --no-knowledge-insulation --start-share 0.2 --start-frames 3 \
  --threads 1 --log-every 50 --resume-every-min 5 --stage dagger_restart --question-weight where_pad=0.25 \
  --grounding $D/r5/grounding_start.npz --grounding $D/r5/grounding_moved.npz --grounding-batch-size 24 \
  --batch-size 12 --steps 6000 --lr 3e-4 --warmup-steps 100 --time-budget-min 30
