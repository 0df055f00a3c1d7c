#!/usr/bin/env bash
cd "$(dirname "$0")/../../.."
D=${DATA:-/work/data}
# DAgger restarted, round 2: the restart's weights ($D/r19, dagger_restart_train.sh) on its mix plus 300 place takeovers they drove
# with the commitment. $D/r19 is the restart's checkpoint: git show 06ae044:docs/benchmarks/place_stages/dagger_restart_checkpoint/...
# data: .venv/bin/oxygen-sim-dataset on-policy --out $D/dagger/s51r2_0 --checkpoint $D/r19/checkpoint --place 150 --seed 8200000 --threads 1 --gripper-commit
#       .venv/bin/oxygen-sim-dataset on-policy --out $D/dagger/s51r2_1 --checkpoint $D/r19/checkpoint --place 150 --seed 8300000 --threads 1 --gripper-commit
exec .venv/bin/oxygen-train --dataset $D/r5/demos_clean --dataset $D/r5/demos_dart \
  --dataset $D/dagger/s51a --dataset $D/dagger/s51b --dataset $D/dagger/s51r2_0 --dataset $D/dagger/s51r2_1 --dataset $D/two_step/demos \
  --out $D/r20/checkpoint --init-from $D/r19/checkpoint --tokenizer models/sim_so101/tokenizer.model \
  --preset sim --grounding-heldout $D/r5/grounding_heldout.npz --probe-every 3000 --probe-scenes 200 \
  --image-positions sincos --seed 8 --data-seed 8 --rtc-training-max-delay 4 \
  --flat-fraction 0.1 --no-augment --no-knowledge-insulation --start-share 0.2 --start-frames 3 \
  --threads 1 --log-every 50 --resume-every-min 5 --stage dagger_restart2 --question-weight where_pad=0.25 \
  --grounding $D/r5/grounding_start.npz --grounding $D/r5/grounding_moved.npz --grounding-batch-size 24 \
  --batch-size 12 --steps 6000 --lr 3e-4 --warmup-steps 100 --time-budget-min 25
