"""Does the checkpoint's training-time RTC look at the scene or continue its prefix? On held-out
touch layouts (closed-loop's rounds of SEED), at two moments: the start pose, and the first frame
the plain oracle policy brings the tip within NEAR_M of the cube ("near"). At each, one noise draw
and four chunks, the oracle subtask in the prompt:

* plain: no prefix;
* own: the plain chunk's first d steps as the frozen prefix (a consistent prefix);
* still: the arm held where it is for d steps (the prefix a stalled arm gives);
* mirrored: the plain chunk's first d steps with the pan's motion mirrored (a wrong heading).

Per variant, over layouts: the continuation's travel (largest arm-joint move from step d-1 to the
last step, rad; the plain chunk's own is the reference) and, at the start pose, the correlation of
the chunk's last pan with the cube's azimuth (the plain chunk's about 0.98).

    .venv/bin/python docs/benchmarks/rtc_stall/prefix_probe.py CHECKPOINT LAYOUTS SEED D OUT.json
"""

import json
import sys

import numpy as np
import torch

from oxygen_ros.engine.frames import frame_noise
from oxygen_ros.engine.runtime import ModelSpec, load_policy
from oxygen_ros.model.rtc import TrainedPrefix
from oxygen_ros.policy_io.prompts import resolve_format
from oxygen_ros.sim.episode import RUNNING, Simulation
from oxygen_ros.tools.benches.closed_loop import round_task
from oxygen_ros.tools.benches.sim_policy import observe, send
from oxygen_ros.tools.benches.subtask_modes import PromptedChunks

ARM = 5
NEAR_M = 0.06
MAX_FRAMES = 60

checkpoint, layouts, seed0, d, out = (
    sys.argv[1],
    int(sys.argv[2]),
    int(sys.argv[3]),
    int(sys.argv[4]),
    sys.argv[5],
)
torch.set_num_threads(1)
policy = load_policy(ModelSpec(checkpoint_dir=checkpoint, torch_threads=1))
source = PromptedChunks(policy, resolve_format("openpi_subtask"), "oracle", 10)
H = policy.config.action_horizon
frozen = torch.arange(H) < d


def chunks(sim, frame: int, seed: int) -> dict[str, np.ndarray]:
    """The four variants' chunks (robot units) from the present frame, one noise draw."""
    observation = observe(sim)
    state = observation.state
    prompt = source.frame_prompt(observation, sim.phase.subtask)
    inputs = policy.encode(observation.images, observation.state, observation.prompt, prompt)
    noise = frame_noise(policy.config, seed, frame, policy.device)
    model = policy.model
    with torch.inference_mode():
        prefix = model.prefill(
            inputs.images, inputs.image_masks, inputs.tokens, inputs.token_masks,
            inputs.token_causal,
        )  # fmt: skip
        plain = policy.robot_actions(model.sample_actions(prefix, noise, 10)[0], state)
        still = np.repeat(state[None, : plain.shape[1]], H, axis=0)
        mirrored = plain.copy()
        mirrored[:, 0] = 2 * state[0] - plain[:, 0]
        result = {"plain": plain}
        for name, target in (("own", plain), ("still", still), ("mirrored", mirrored)):
            model_target = torch.from_numpy(policy.model_actions(target, state))[None]
            guidance = TrainedPrefix(model_target.float(), frozen)
            sampled = model.sample_actions(prefix, noise, 10, guidance)[0]
            result[name] = policy.robot_actions(sampled, state)
    return result


def travel(chunk: np.ndarray) -> float:
    return float(np.abs(chunk[-1, :ARM] - chunk[d - 1, :ARM]).max())


records = []
sim = Simulation(episode_timeout_s=8.0)
try:
    for index in range(layouts):
        task, seed = round_task(index, seed0, "touch")
        sim.reset(task, seed)
        cube = sim.world.cube_position(task.cube)
        record = {"seed": seed, "cube_azimuth_rad": float(np.arctan2(cube[1], cube[0]))}
        start = chunks(sim, 1, seed)
        record["start"] = {k: {"travel": travel(v), "last_pan": float(v[-1, 0])}
                           for k, v in start.items()}  # fmt: skip
        steps_per_frame = max(1, round(0.1 / sim.control_dt))
        near = None
        for frame in range(1, MAX_FRAMES):
            if sim.status != RUNNING:
                break
            if sim.facts().tip_to_cube < NEAR_M:
                near = chunks(sim, frame + 1000, seed)
                record["near_tip_to_cube_m"] = float(sim.facts().tip_to_cube)
                break
            send(sim, source.chunk(sim, observe(sim)).actions, 0.1)
            for _ in range(steps_per_frame):
                sim.control_step()
        if near is not None:
            record["near"] = {k: {"travel": travel(v)} for k, v in near.items()}
        records.append(record)
        print(json.dumps(record))
finally:
    sim.world.close()


def corr(name: str) -> float:
    pans = [r["start"][name]["last_pan"] for r in records]
    return float(np.corrcoef(pans, [r["cube_azimuth_rad"] for r in records])[0, 1])


summary = {"checkpoint": checkpoint, "d": d, "layouts": layouts, "seed": seed0}
for moment in ("start", "near"):
    have = [r for r in records if moment in r]
    summary[moment] = {
        name: {"travel_median": float(np.median([r[moment][name]["travel"] for r in have]))}
        for name in ("plain", "own", "still", "mirrored")
    }
    summary[moment]["layouts"] = len(have)
for name in ("plain", "own", "still", "mirrored"):
    summary["start"][name]["heading_corr"] = corr(name)
print(json.dumps(summary, indent=1))
json.dump({"summary": summary, "records": records}, open(out, "w"), indent=1)
