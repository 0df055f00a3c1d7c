#!/usr/bin/env bash
cd "$(dirname "$0")/../../.."
D=${DATA:-/work/data}
# DAgger's fourth round: round 3 (dagger_round3_train.sh, its checkpoint in $D/r15) drives place episodes with its
# planned gripper switches kept (--gripper-commit); the stage leaves out every earlier on-policy set, whose touch
# takeovers came with worse touch in every round: the demonstrations and these place takeovers only.
# data: .venv/bin/oxygen-sim-dataset on-policy --out $D/dagger/round4a --checkpoint $D/r15/checkpoint --place 200 --seed 7600000 --threads 1 --gripper-commit
#       .venv/bin/oxygen-sim-dataset on-policy --out $D/dagger/round4b --checkpoint $D/r15/checkpoint --place 200 --seed 7700000 --threads 1 --gripper-commit
exec .venv/bin/oxygen-train --dataset $D/r5/demos_clean --dataset $D/r5/demos_dart --dataset $D/dagger/round4a --dataset $D/dagger/round4b --out $D/r16/checkpoint \
  --init-from $D/r15/checkpoint --tokenizer models/sim_so101/tokenizer.model \
  --preset sim --grounding-heldout $D/r5/grounding_heldout.npz --probe-every 2500 --probe-scenes 200 \
  --image-positions sincos --seed 4 --data-seed 4 --rtc-training-max-delay 4 \
  --flat-fraction 0.1 --no-augment --no-knowledge-insulation --start-share 0.2 --start-frames 3 \
  --threads 1 --log-every 50 --resume-every-min 5 --stage dagger_round4 --question-weight where_pad=0.25 \
  --grounding $D/r5/grounding_start.npz --grounding $D/r5/grounding_moved.npz --grounding-batch-size 24 \
  --batch-size 12 --steps 5000 --lr 3e-4 --warmup-steps 100 --time-budget-min 24
