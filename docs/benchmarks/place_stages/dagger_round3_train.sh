#!/usr/bin/env bash
cd "$(dirname "$0")/../../.."
D=${DATA:-/work/data}
# DAgger's third round: round 2 (dagger_takeover2_train.sh, its checkpoint in $D/r14) drives, labelled by the
# corrective expert that lowers a held cube from wherever it lands on the pad and lets it go there.
# data: .venv/bin/oxygen-sim-dataset on-policy --out $D/dagger/round3a --checkpoint $D/r14/checkpoint --touch 60 --place 170 --seed 7300000 --threads 1
#       .venv/bin/oxygen-sim-dataset on-policy --out $D/dagger/round3b --checkpoint $D/r14/checkpoint --place 230 --seed 7400000 --threads 1
exec .venv/bin/oxygen-train --dataset $D/r5/demos_clean --dataset $D/r5/demos_dart --dataset $D/dagger/takeover --dataset $D/dagger/takeover2 --dataset $D/dagger/takeover3 \
  --dataset $D/dagger/round3a --dataset $D/dagger/round3b --out $D/r15/checkpoint \
  --init-from $D/r14/checkpoint --tokenizer models/sim_so101/tokenizer.model \
  --preset sim --grounding-heldout $D/r5/grounding_heldout.npz --probe-every 2500 --probe-scenes 200 \
  --image-positions sincos --seed 3 --data-seed 3 --rtc-training-max-delay 4 \
  --flat-fraction 0.1 --no-augment --no-knowledge-insulation --start-share 0.2 --start-frames 3 \
  --threads 1 --log-every 50 --resume-every-min 5 --stage dagger_round3 --question-weight where_pad=0.25 \
  --grounding $D/r5/grounding_start.npz --grounding $D/r5/grounding_moved.npz --grounding-batch-size 24 \
  --batch-size 12 --steps 5000 --lr 3e-4 --warmup-steps 100 --time-budget-min 24
