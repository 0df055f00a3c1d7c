#!/usr/bin/env bash
cd "$(dirname "$0")/../../.."
D=${DATA:-/work/data}
# DAgger restarted, round 4: round 3's weights (dagger_restart3_checkpoint/) on round 3's mix (its script's header) plus
# what round 3 drove with the commitment, 700 touch and 400 place takeovers, and 600 more touch demonstrations: round 3
# placed 72/180 but touched 85/120 (wrong cube 10 of 60 in each draw), so touch gets its own on-policy data.
# data: .venv/bin/oxygen-sim-dataset on-policy --out $D/dagger/s52r4_touch --checkpoint $D/r21/checkpoint --touch 300 --seed 8600000 --threads 1 --gripper-commit
#       .venv/bin/oxygen-sim-dataset on-policy --out $D/dagger/s52r4_touch2 --checkpoint $D/r21/checkpoint --touch 400 --seed 8700000 --threads 1 --gripper-commit
#       .venv/bin/oxygen-sim-dataset on-policy --out $D/dagger/s52r4_0 --checkpoint $D/r21/checkpoint --place 200 --seed 8800000 --threads 1 --gripper-commit
#       .venv/bin/oxygen-sim-dataset on-policy --out $D/dagger/s52r4_1 --checkpoint $D/r21/checkpoint --place 200 --seed 8900000 --threads 1 --gripper-commit
#       .venv/bin/oxygen-sim-dataset demos --out $D/r5/demos_touch2 --touch 600 --place 0 --touch-seed 1003000 --touch-settle-s 1.0
# ($D/r21/checkpoint: docs/benchmarks/place_stages/dagger_restart3_checkpoint)
exec .venv/bin/oxygen-train --dataset $D/r5/demos_clean --dataset $D/r5/demos_dart --dataset $D/r5/demos_touch2 \
  --dataset $D/dagger/s51a --dataset $D/dagger/s51b --dataset $D/dagger/s51r2_0 --dataset $D/dagger/s51r2_1 \
  --dataset $D/dagger/s52r3_0 --dataset $D/dagger/s52r3_1 --dataset $D/dagger/s52r4_0 --dataset $D/dagger/s52r4_1 \
  --dataset $D/dagger/s52r4_touch --dataset $D/dagger/s52r4_touch2 --dataset $D/two_step/demos \
  --out $D/r22/checkpoint --init-from docs/benchmarks/place_stages/dagger_restart3_checkpoint --tokenizer models/sim_so101/tokenizer.model \
  --preset sim --grounding-heldout $D/r5/grounding_heldout.npz --probe-every 3000 --probe-scenes 200 \
  --image-positions sincos --seed 10 --data-seed 10 --rtc-training-max-delay 4 \
  --flat-fraction 0.1 --no-augment --no-knowledge-insulation --start-share 0.2 --start-frames 3 \
  --threads 1 --log-every 50 --resume-every-min 5 --stage dagger_restart4 --question-weight where_pad=0.25 \
  --grounding $D/r5/grounding_start.npz --grounding $D/r5/grounding_moved.npz --grounding-batch-size 24 \
  --batch-size 12 --steps 5000 --lr 3e-4 --warmup-steps 100 --time-budget-min 26
