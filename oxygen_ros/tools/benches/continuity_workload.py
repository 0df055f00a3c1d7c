"""The continuity workload of ``oxygen-bench continuity``: a moving synthetic scene replanned at
``rate_hz`` the way the node does, and what a trajectory controller then executes.

The node publishes a new chunk every tick; the controller runs the newest chunk it has, action
``i`` due at ``stamp + (i + 1) * action_dt`` after the chunk's observation stamp. A chunk therefore
takes over at the first controller step after it arrives (stamp + action-path latency), and the
executed command stream is the newest chunk sampled at the controller's time since its stamp.
"""

from __future__ import annotations

import dataclasses
import math
import time

import numpy as np

from oxygen_ros.engine import OxygenEngine
from oxygen_ros.engine.metrics import percentile
from oxygen_ros.engine.types import Observation
from oxygen_ros.model.config import IMAGE_SLOTS


def moving_scene(
    t: float, cameras: int, state_dim: int = 7, size: int = 224, seed: int = 0
) -> Observation:
    """The scene at time ``t`` s: a red square gliding over a fixed noise background (period 4 s)
    in each camera, and a joint state moving on slow sinusoids; stamped ``t``."""
    if not 1 <= cameras <= len(IMAGE_SLOTS):
        raise ValueError(f"cameras must be 1..{len(IMAGE_SLOTS)}, got {cameras}")
    rng = np.random.default_rng(seed)
    images = {}
    for c, slot in enumerate(IMAGE_SLOTS[:cameras]):
        image = rng.integers(0, 64, (size, size, 3), dtype=np.uint8)
        x = int(round((size - 40) * (0.5 + 0.5 * math.sin(2 * math.pi * (t / 4.0 + c / 3.0)))))
        image[60:100, x : x + 40] = (255, 40 * c, 0)
        images[slot] = image
    phases = np.arange(state_dim) / state_dim
    state = 0.8 * np.sin(2 * np.pi * (t / 3.0 + phases))
    return Observation(images, state, "pick up the red cup", stamp=t)


@dataclasses.dataclass
class TimedChunk:
    stamp: float  # observation time on the simulated clock
    arrival: float  # stamp + the measured action-path latency
    actions: np.ndarray  # [horizon, joints], robot units


def sample_chunk(actions: np.ndarray, stamp: float, t: float, action_dt: float) -> np.ndarray:
    """The chunk's command at controller time ``t``: step ``(t - stamp) / dt - 1``, linearly
    interpolated, held at the ends."""
    position = min(max((t - stamp) / action_dt - 1.0, 0.0), actions.shape[0] - 1.0)
    low = int(math.floor(position))
    high = min(low + 1, actions.shape[0] - 1)
    frac = position - low
    return actions[low] * (1.0 - frac) + actions[high] * frac


def takeover_time(arrival: float, action_dt: float) -> float:
    """When the controller switches to a chunk that arrived at ``arrival``: its first step after."""
    return math.ceil(arrival / action_dt - 1e-9) * action_dt


class Replanner:
    """The node's loop on a simulated clock: a tick every 1/rate_hz s (a tick that cannot start on
    time starts when the previous chunk is done), each a fresh observation of the scene and a new
    chunk; each chunk arrives after its measured action-path time, and the delay the simulated
    robot sees (the stamp to the controller's takeover) is reported to the engine as the node
    reports its publishing delay (`OxygenEngine.chunk_published`). `run` continues where the last
    call stopped, so a bench can interleave engines block by block (a machine whose speed drifts
    then slows every engine alike); ``chunks``, ``action_ms`` (the action-path times) and
    ``action_cpu_ms`` (the process's CPU time in them, every thread: the cost without the waits
    of a CPU shared with other work) grow."""

    def __init__(
        self, engine: OxygenEngine, rate_hz: float, cameras: int, state_dim: int, action_dt: float
    ) -> None:
        self.engine, self.period, self.action_dt = engine, 1.0 / rate_hz, action_dt
        self.cameras, self.state_dim = cameras, state_dim
        self.chunks: list[TimedChunk] = []
        self.action_ms: list[float] = []
        self.action_cpu_ms: list[float] = []
        self._busy_until = 0.0

    def run(self, frames: int) -> None:
        """Replan ``frames`` more ticks."""
        for _ in range(frames):
            stamp = max(len(self.chunks) * self.period, self._busy_until)
            observation = moving_scene(stamp, self.cameras, self.state_dim)
            started, cpu = time.perf_counter(), time.process_time()
            chunk = self.engine.act(observation)
            latency = time.perf_counter() - started
            self.action_ms.append(latency * 1e3)
            self.action_cpu_ms.append((time.process_time() - cpu) * 1e3)
            self._busy_until = stamp + latency
            delay = takeover_time(stamp + latency, self.action_dt) - stamp
            self.engine.chunk_published(chunk.frame_id, chunk.actions, delay)
            self.chunks.append(
                TimedChunk(stamp, stamp + latency, np.asarray(chunk.actions, dtype=np.float64))
            )


def continuity_metrics(
    chunks: list[TimedChunk], action_dt: float, skip: int = 0
) -> dict[str, float]:
    """Switch discontinuities and jerk of the executed command stream.

    switch_discontinuity: |new - previous chunk| per joint at the first controller step after each
    switch (chunks after the first ``skip`` + 1), p50/p99 over joints and switches, and how many
    switches came after the previous chunk's last action (latency beyond the chunk: no continuity
    is possible there, with or without RTC). jerk_rms: RMS over joints and steps of the third
    difference of the executed stream / dt^3, from the first counted switch to the last chunk's
    arrival.
    """
    jumps: list[np.ndarray] = []
    past_end = 0  # switches after the previous chunk's last action: nothing left to continue
    for previous, new in zip(chunks[skip:], chunks[skip + 1 :], strict=False):
        t = takeover_time(new.arrival, action_dt)
        past_end += t > previous.stamp + previous.actions.shape[0] * action_dt
        jumps.append(
            np.abs(
                sample_chunk(new.actions, new.stamp, t, action_dt)
                - sample_chunk(previous.actions, previous.stamp, t, action_dt)
            )
        )
    start = math.ceil(chunks[skip].arrival / action_dt)
    stop = math.ceil(chunks[-1].arrival / action_dt)
    stream = []
    newest = skip
    for n in range(start, stop + 1):
        t = n * action_dt
        while newest + 1 < len(chunks) and chunks[newest + 1].arrival <= t:
            newest += 1
        chunk = chunks[newest]
        stream.append(sample_chunk(chunk.actions, chunk.stamp, t, action_dt))
    jerk = np.diff(np.asarray(stream), n=3, axis=0) / action_dt**3
    flat = np.concatenate(jumps) if jumps else np.zeros(1)
    return {
        "switch_discontinuity_p50": percentile(flat.tolist(), 50),
        "switch_discontinuity_p99": percentile(flat.tolist(), 99),
        "jerk_rms": float(np.sqrt(np.mean(jerk**2))) if jerk.size else float("nan"),
        "switches": len(jumps),
        "switches_past_previous_end": past_end,
        "controller_steps": len(stream),
    }
