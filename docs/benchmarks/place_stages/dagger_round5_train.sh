#!/usr/bin/env bash
cd "$(dirname "$0")/../../.."
D=${DATA:-/work/data}
# DAgger's fifth round: round 3's weights ($D/r15) on the demonstrations and every place takeover so far (the
# takeover and round-3 sets filtered to their place episodes, round 4's commitment-driven set whole), no on-policy
# touch: round 4 showed the on-policy touch takeovers cost touch, and that leaving out the earlier place takeovers
# cost place.
exec .venv/bin/oxygen-train --dataset $D/r5/demos_clean --dataset $D/r5/demos_dart \
  --dataset $D/dagger/takeover --dataset $D/dagger/takeover2 --dataset $D/dagger/takeover3 \
  --dataset $D/dagger/round3a --dataset $D/dagger/round3b --dataset $D/dagger/round4a --dataset $D/dagger/round4b \
  --task-filter "$D/dagger/takeover=^put " --task-filter "$D/dagger/takeover2=^put " --task-filter "$D/dagger/takeover3=^put " \
  --task-filter "$D/dagger/round3a=^put " --task-filter "$D/dagger/round3b=^put " \
  --out $D/r17/checkpoint --init-from $D/r15/checkpoint --tokenizer models/sim_so101/tokenizer.model \
  --preset sim --grounding-heldout $D/r5/grounding_heldout.npz --probe-every 2500 --probe-scenes 200 \
  --image-positions sincos --seed 5 --data-seed 5 --rtc-training-max-delay 4 \
  --flat-fraction 0.1 --no-augment --no-knowledge-insulation --start-share 0.2 --start-frames 3 \
  --threads 1 --log-every 50 --resume-every-min 5 --stage dagger_round5 --question-weight where_pad=0.25 \
  --grounding $D/r5/grounding_start.npz --grounding $D/r5/grounding_moved.npz --grounding-batch-size 24 \
  --batch-size 12 --steps 5000 --lr 3e-4 --warmup-steps 100 --time-budget-min 24
