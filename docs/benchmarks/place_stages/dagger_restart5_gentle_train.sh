#!/usr/bin/env bash
cd "$(dirname "$0")/../../.."
D=${DATA:-/work/data}
# DAgger restarted, round 5, gently: round 5's data and mix (its script's header), but a third of the learning rate and
# the weights' moving average (decay 0.99) as the checkpoint: round 5 at lr 3e-4 lost 22 of round 4's 71 places, so
# this asks whether a smaller step keeps round 4's place while the touch data works.
# data: .venv/bin/oxygen-sim-dataset on-policy --out $D/dagger/s53r5_touch0 --checkpoint $D/r22/checkpoint --touch 400 --seed 9100000 --threads 1 --gripper-commit
#       .venv/bin/oxygen-sim-dataset on-policy --out $D/dagger/s53r5_touch1 --checkpoint $D/r22/checkpoint --touch 400 --seed 9200000 --threads 1 --gripper-commit
#       .venv/bin/oxygen-sim-dataset on-policy --out $D/dagger/s53r5_place0 --checkpoint $D/r22/checkpoint --place 200 --seed 9300000 --threads 1 --gripper-commit
#       .venv/bin/oxygen-sim-dataset on-policy --out $D/dagger/s53r5_place1 --checkpoint $D/r22/checkpoint --place 200 --seed 9400000 --threads 1 --gripper-commit
#       .venv/bin/oxygen-sim-dataset demos --out $D/r5/demos_touch3 --touch 600 --place 0 --touch-seed 1004000 --touch-settle-s 1.0
# ($D/r22/checkpoint: docs/benchmarks/place_stages/dagger_restart4_checkpoint)
exec .venv/bin/oxygen-train --dataset $D/r5/demos_clean --dataset $D/r5/demos_dart --dataset $D/r5/demos_touch2 \
  --dataset $D/r5/demos_touch3 \
  --dataset $D/dagger/s51a --dataset $D/dagger/s51b --dataset $D/dagger/s51r2_0 --dataset $D/dagger/s51r2_1 \
  --dataset $D/dagger/s52r3_0 --dataset $D/dagger/s52r3_1 --dataset $D/dagger/s52r4_0 --dataset $D/dagger/s52r4_1 \
  --dataset $D/dagger/s52r4_touch --dataset $D/dagger/s52r4_touch2 \
  --dataset $D/dagger/s53r5_touch0 --dataset $D/dagger/s53r5_touch1 --dataset $D/dagger/s53r5_place0 \
  --dataset $D/dagger/s53r5_place1 --dataset $D/two_step/demos \
  --out $D/r24/checkpoint --init-from docs/benchmarks/place_stages/dagger_restart4_checkpoint --tokenizer models/sim_so101/tokenizer.model \
  --preset sim --grounding-heldout $D/r5/grounding_heldout.npz --probe-every 3000 --probe-scenes 200 \
  --image-positions sincos --seed 12 --data-seed 12 --rtc-training-max-delay 4 \
  --flat-fraction 0.1 --no-augment --no-knowledge-insulation --start-share 0.2 --start-frames 3 \
  --threads 1 --log-every 50 --resume-every-min 5 --stage dagger_restart5_gentle --question-weight where_pad=0.25 \
  --grounding $D/r5/grounding_start.npz --grounding $D/r5/grounding_moved.npz --grounding-batch-size 24 \
  --batch-size 12 --steps 5000 --lr 1e-4 --ema-decay 0.99 --warmup-steps 100 --time-budget-min 26
