#!/usr/bin/env bash
cd "$(dirname "$0")/../../.."
D=${DATA:-/work/data}
# DAgger restarted, round 3: round 2's weights (dagger_restart2_checkpoint/, kept in the tree) on round 2's mix plus 400 place
# takeovers they drove with the commitment. The mix's other sets: the two dagger_restart*_train.sh headers (s51r2_* are
# driven by round 1's weights, git show 06ae044:docs/benchmarks/place_stages/dagger_restart_checkpoint/ into $D/r19/checkpoint).
# data: .venv/bin/oxygen-sim-dataset on-policy --out $D/dagger/s52r3_0 --checkpoint docs/benchmarks/place_stages/dagger_restart2_checkpoint --place 200 --seed 8400000 --threads 1 --gripper-commit
#       .venv/bin/oxygen-sim-dataset on-policy --out $D/dagger/s52r3_1 --checkpoint docs/benchmarks/place_stages/dagger_restart2_checkpoint --place 200 --seed 8500000 --threads 1 --gripper-commit
exec .venv/bin/oxygen-train --dataset $D/r5/demos_clean --dataset $D/r5/demos_dart \
  --dataset $D/dagger/s51a --dataset $D/dagger/s51b --dataset $D/dagger/s51r2_0 --dataset $D/dagger/s51r2_1 \
  --dataset $D/dagger/s52r3_0 --dataset $D/dagger/s52r3_1 --dataset $D/two_step/demos \
  --out $D/r21/checkpoint --init-from docs/benchmarks/place_stages/dagger_restart2_checkpoint --tokenizer models/sim_so101/tokenizer.model \
  --preset sim --grounding-heldout $D/r5/grounding_heldout.npz --probe-every 3000 --probe-scenes 200 \
  --image-positions sincos --seed 9 --data-seed 9 --rtc-training-max-delay 4 \
  --flat-fraction 0.1 --no-augment --no-knowledge-insulation --start-share 0.2 --start-frames 3 \
  --threads 1 --log-every 50 --resume-every-min 5 --stage dagger_restart3 --question-weight where_pad=0.25 \
  --grounding $D/r5/grounding_start.npz --grounding $D/r5/grounding_moved.npz --grounding-batch-size 24 \
  --batch-size 12 --steps 6000 --lr 3e-4 --warmup-steps 100 --time-budget-min 30
