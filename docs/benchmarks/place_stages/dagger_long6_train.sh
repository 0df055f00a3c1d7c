#!/usr/bin/env bash
cd "$(dirname "$0")/../../.."
D=${DATA:-/work/data}
# Round 6, long and gentle: round 5's data (dagger_restart5_train.sh's header) with every touch set drawn twice as
# often (each listed twice: the touch share of the frames goes from ~0.29 to ~0.45), from round 4's weights, lr 1e-4
# decaying over 16,000 steps (three rounds' worth) and the weights' moving average (decay 0.999) as the checkpoint.
# Asks whether a longer, decaying run on the same on-policy mix keeps round 4's place while touch gets back to the
# shipped weights' (every round since round 3 touches ~10 of 180 fewer).
T="--dataset $D/r5/demos_touch2 --dataset $D/r5/demos_touch3 --dataset $D/dagger/s52r4_touch --dataset $D/dagger/s52r4_touch2 \
  --dataset $D/dagger/s53r5_touch0 --dataset $D/dagger/s53r5_touch1"
exec .venv/bin/oxygen-train --dataset $D/r5/demos_clean --dataset $D/r5/demos_dart $T $T \
  --dataset $D/dagger/s51a --dataset $D/dagger/s51b --dataset $D/dagger/s51r2_0 --dataset $D/dagger/s51r2_1 \
  --dataset $D/dagger/s52r3_0 --dataset $D/dagger/s52r3_1 --dataset $D/dagger/s52r4_0 --dataset $D/dagger/s52r4_1 \
  --dataset $D/dagger/s53r5_place0 --dataset $D/dagger/s53r5_place1 --dataset $D/two_step/demos \
  --out $D/r25/checkpoint --init-from docs/benchmarks/place_stages/dagger_restart4_checkpoint --tokenizer models/sim_so101/tokenizer.model \
  --preset sim --grounding-heldout $D/r5/grounding_heldout.npz --probe-every 4000 --probe-scenes 200 \
  --image-positions sincos --seed 13 --data-seed 13 --rtc-training-max-delay 4 \
  --flat-fraction 0.1 --no-augment --no-knowledge-insulation --start-share 0.2 --start-frames 3 \
  --threads 1 --log-every 50 --resume-every-min 5 --stage dagger_long6 --question-weight where_pad=0.25 \
  --grounding $D/r5/grounding_start.npz --grounding $D/r5/grounding_moved.npz --grounding-batch-size 24 \
  --batch-size 12 --steps 16000 --lr 1e-4 --ema-decay 0.999 --warmup-steps 100 --time-budget-min 92
