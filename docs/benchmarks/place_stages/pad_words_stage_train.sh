cd "$(dirname "$0")/../../.."
D=DATA  # where the datasets were rendered (pad_words_stage_train.sh: oxygen-sim-dataset demos as scripts/train_sim_policy.sh renders them, plus place_extra: --touch 0 --place 400 --place-seed 2002400 --perturbed-share 0.5 --perturbation-rad 0.03)
exec .venv/bin/oxygen-train --dataset $D/r5/demos_clean --dataset $D/r5/demos_dart --dataset $D/r5/place_extra --out $D/r5/checkpoint \
  --init-from models/sim_so101 --tokenizer models/sim_so101/tokenizer.model \
  --preset sim --grounding-heldout $D/r2/grounding_heldout.npz --probe-every 2500 --probe-scenes 200 \
  --image-positions sincos --seed 2 --data-seed 2 --rtc-training-max-delay 4 \
  --flat-fraction 0.1 --no-augment --no-knowledge-insulation --start-share 0.2 --start-frames 3 \
  --threads 1 --log-every 50 --resume-every-min 5 --stage place_pad_words \
  --grounding $D/r2/grounding_start.npz --grounding $D/r2/grounding_moved.npz --grounding-batch-size 24 \
  --batch-size 12 --steps 5000 --lr 3e-4 --warmup-steps 100 --time-budget-min 32
