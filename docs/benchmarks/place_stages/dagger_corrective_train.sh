cd "$(dirname "$0")/../../.."
D=${DATA:-/work/data}
# data: .venv/bin/oxygen-sim-dataset on-policy --out $D/dagger/corrective --checkpoint models/sim_so101 --touch 150 --place 150 --threads 1
#   (labelled by the corrective expert before its descent cone: commit 13d9716)
exec .venv/bin/oxygen-train --dataset $D/r5/demos_clean --dataset $D/r5/demos_dart --dataset $D/dagger/corrective --out $D/r11/checkpoint \
  --init-from models/sim_so101 --tokenizer models/sim_so101/tokenizer.model \
  --preset sim --grounding-heldout $D/r5/grounding_heldout.npz --probe-every 2500 --probe-scenes 200 \
  --image-positions sincos --seed 2 --data-seed 2 --rtc-training-max-delay 4 \
  --flat-fraction 0.1 --no-augment --no-knowledge-insulation --start-share 0.2 --start-frames 3 \
  --threads 1 --log-every 50 --resume-every-min 5 --stage dagger_corrective --question-weight where_pad=0.25 \
  --grounding $D/r5/grounding_start.npz --grounding $D/r5/grounding_moved.npz --grounding-batch-size 24 \
  --batch-size 12 --steps 5000 --lr 3e-4 --warmup-steps 100 --time-budget-min 24
