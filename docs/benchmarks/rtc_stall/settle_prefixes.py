"""What follows a still prefix in the training chunks? For every frame of the demonstrations and
each delay d in 1..4 (the prefix training-time RTC keeps clean), the prefix's travel (largest
arm-joint move over its d steps, rad) and the continuation's (steps d..H-1 from the prefix's last
step): how many still prefixes (travel < STILL) there are, how many lie in a touch episode's
settle tail (its last SETTLE frames: recorded 1 s past the touch) and how many are followed by a
still continuation.

    .venv/bin/python docs/benchmarks/rtc_stall/settle_prefixes.py DATASET [DATASET ...]
"""

import json
import sys

import numpy as np

from oxygen_ros.training.dataset import frame_chunk, load_training_frames

H = 10
ARM = 5
STILL = 0.01  # rad over the prefix: a nearly still arm
SETTLE = 10  # frames: the 1 s recorded past a touch, at 10 fps

rows = []
for root in sys.argv[1:]:
    frames = load_training_frames(root)
    subtasks = frames.subtasks
    for d in range(1, 5):
        still = still_then_still = settle = moving_then_still = moving = 0
        for i in range(len(frames)):
            chunk = frame_chunk(frames, i, H)[:, :ARM]
            start = frames.states[i, :ARM]
            prefix = np.abs(chunk[:d] - start).max()
            rest = np.abs(chunk[d:] - chunk[d - 1]).max()
            done = subtasks[i].startswith("touch") and frames.episode_end[i] - i <= SETTLE
            if prefix < STILL:
                still += 1
                still_then_still += rest < STILL
                settle += done
            else:
                moving += 1
                moving_then_still += rest < STILL
        rows.append(
            {
                "dataset": str(root),
                "d": d,
                "chunks": len(frames),
                "still_prefix": still,
                "still_prefix_then_still": still_then_still,
                "still_prefix_in_settle_tail": settle,
                "moving_prefix": moving,
                "moving_prefix_then_still": moving_then_still,
            }
        )
        print(json.dumps(rows[-1], default=int))
