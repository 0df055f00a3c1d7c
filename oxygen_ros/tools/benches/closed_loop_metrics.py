"""The closed-loop bench's metrics, on recorded data (no ROS): success with a Wilson interval,
jerk of the executed trajectory, the chunk-switch jump, and the judging of the policy's words.

Definitions (also in ``oxygen-bench closed-loop --help``):

* **success**: the sim's own verdict (``sim/episode`` status ``success`` before its timeout);
  the rate over N episodes with the Wilson score 95 % interval (:func:`wilson_interval`).
* **time to success**: the sim seconds from the episode's start to its success (median over the
  successful episodes).
* **jerk**: of the *executed* arm trajectory, from ``joint_states`` (positions of the five arm
  joints at their header stamps): the third difference over three equal steps divided by dt^3, in
  rad/s^3, RMS over every joint and every window of four consecutive samples with no gap
  (:func:`rms_jerk`).
* **chunk-switch jump**: the discontinuity in the *commanded reference* at the moment a new arm
  trajectory takes over: each trajectory is the piecewise-linear plan through its points (at
  ``header.stamp + time_from_start``, held before the first and after the last point); when
  trajectory k+1 reaches the controller at sim time t, the jump is
  max over joints |plan_{k+1}(t) - plan_k(t)| in rad; reported as the mean over the episode's
  switches (:func:`switch_jumps`). Zero when each chunk continues the one it replaces.
* **language**: a text (``~/narration_text`` narration, ``~/subtask``) is right when it names the
  task's cube (its colour and no colour the task does not name; in a place task's carry phase
  the pad as well) and the phase the sim was in when it arrived (within :data:`JUDGE_TOLERANCE_S`
  before, for decoding latency). The text's phase is the sim phase whose own subtask or narration
  text shares the most words with it (:func:`text_phases`, :func:`judge_text`; the texts come
  from the sim's language module).
* **place**: apart from that (a separate share, so that tables before it stay comparable), the
  place words a text ends with (", far left": where the task's cube is, as the sim's texts say
  while reaching; :func:`said_place`) are judged against those of the sim's own subtask in force
  when it arrived (within :data:`JUDGE_TOLERANCE_S` before): right when the sim said that place;
  wrong when the sim said another, or none, or said one and the text none; not judged when neither
  says a place (:func:`judge_place`). An Ask answer is judged on its place only when it says one
  (the trained answer, "the red cube", does not).
* **two-step tasks**: judged against the step the sim was in. Their phases are keyed
  ``"<step>/<phase>"`` ("1/carry", "2/reach"; the first step's ``done`` never shows: the second
  step begins at once), so a text names a phase of the current step and that step's cube (and,
  carrying, its pad); an Ask answer is judged on the cube of the step in force when it came
  (:func:`step_at`).
"""

from __future__ import annotations

import math
import re
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from oxygen_ros.sim.language import Phase, SceneFacts, current_phase, without_place
from oxygen_ros.sim.scene import CUBE_COLORS, PAD_COLORS
from oxygen_ros.sim.tasks import PLACE, TWO_STEP, Task

Z95 = 1.959963984540054  # the standard normal's 97.5 % quantile
JUDGE_TOLERANCE_S = (
    1.0  # a text may name the phase the sim was in up to this long before it arrived
)
GAP_FACTOR = 1.5  # joint_states samples further apart than this many steps break the jerk windows


def wilson_interval(successes: int, n: int, z: float = Z95) -> tuple[float, float]:
    """The Wilson score interval of a binomial rate (95 % by default); (0, 1) for n = 0."""
    if n <= 0:
        return (0.0, 1.0)
    if not 0 <= successes <= n:
        raise ValueError(f"successes must be within 0..{n}, got {successes}")
    p = successes / n
    denominator = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denominator
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denominator
    return (max(0.0, centre - half), min(1.0, centre + half))


def rms_jerk(times: Sequence[float], positions: np.ndarray) -> float:
    """RMS jerk (units/s^3) of ``positions`` [samples, joints] sampled at ``times`` (s).

    The step ``dt`` is the median interval; a window of four samples counts only when its three
    intervals are within ``GAP_FACTOR`` x dt (a lost message does not read as a jerk). NaN with
    no complete window.
    """
    t = np.asarray(times, dtype=np.float64)
    q = np.asarray(positions, dtype=np.float64)
    if q.ndim == 1:
        q = q[:, None]
    if len(t) != len(q):
        raise ValueError(f"{len(t)} times for {len(q)} samples")
    if len(t) < 4:
        return math.nan
    intervals = np.diff(t)
    dt = float(np.median(intervals))
    if not dt > 0:
        return math.nan
    third = q[3:] - 3 * q[2:-1] + 3 * q[1:-2] - q[:-3]
    regular = np.abs(intervals - dt) <= (GAP_FACTOR - 1) * dt
    windows = regular[:-2] & regular[1:-1] & regular[2:]
    if not windows.any():
        return math.nan
    jerk = third[windows] / dt**3
    return float(np.sqrt(np.mean(jerk**2)))


@dataclass(frozen=True)
class Plan:
    """One commanded trajectory as absolute times (s) and positions [points, joints]."""

    times: np.ndarray
    positions: np.ndarray

    def at(self, t: float) -> np.ndarray:
        """The piecewise-linear reference at ``t``, held outside the points' span."""
        return np.array(
            [np.interp(t, self.times, self.positions[:, j]) for j in range(self.positions.shape[1])]
        )


def switch_jumps(plans: Sequence[Plan], arrivals: Sequence[float]) -> list[float]:
    """The chunk-switch jump of each trajectory after the first: max over joints of
    |plan_k(t_k) - plan_{k-1}(t_k)| at its arrival time t_k (the controller's clock)."""
    if len(plans) != len(arrivals):
        raise ValueError(f"{len(plans)} plans for {len(arrivals)} arrival times")
    return [
        float(np.max(np.abs(plans[k].at(arrivals[k]) - plans[k - 1].at(arrivals[k]))))
        for k in range(1, len(plans))
    ]


# -- language ------------------------------------------------------------------------------------
_WORD = re.compile(r"[a-z]+")


def words(text: str) -> set[str]:
    return set(_WORD.findall(text.lower()))


def task_phases(task: Task) -> dict[str, Phase]:
    """Every phase of ``task`` with the sim's own texts for it (from ``sim.language``); a
    two-step task's keyed by step (:func:`step_phase_key`), less the first step's ``done``."""
    if task.kind == TWO_STEP:
        last = len(task.steps) - 1
        return {
            step_phase_key(index, key): phase
            for index, step in enumerate(task.steps)
            for key, phase in task_phases(step).items()
            if key != "done" or index == last
        }
    far = SceneFacts(False, None, 1.0, math.inf, False)
    facts = {
        "reach": far,
        "done": SceneFacts(True, None, 0.0, 0.0, True),
    }
    if task.kind == PLACE:
        facts |= {
            "grasp": SceneFacts(False, None, 0.0, math.inf, False),
            "carry": SceneFacts(False, task.cube, 0.0, math.inf, False),
            "release": SceneFacts(False, task.cube, 0.0, 0.0, False),
        }
    return {key: current_phase(task, value) for key, value in facts.items()}


def step_phase_key(index: int, key: str) -> str:
    """A two-step task's key of its step ``index``'s (0-based) phase ``key``: "1/reach"."""
    return f"{index + 1}/{key}"


def split_phase_key(task: Task, key: str) -> tuple[Task, str]:
    """The step a phase key of ``task`` is about and the step's own phase key ("1/carry" ->
    the first step, "carry"); ``task`` and ``key`` themselves for a one-step task."""
    if task.kind != TWO_STEP:
        return task, key
    index, _, phase = key.partition("/")
    return task.steps[int(index) - 1], phase


def done_key(task: Task) -> str:
    """The key of the phase ``task`` ends in once it succeeded."""
    if task.kind == TWO_STEP:
        return step_phase_key(len(task.steps) - 1, "done")
    return "done"


def step_at(task: Task, subtasks: Sequence[tuple[float, str]], at: float) -> Task:
    """The step of ``task`` whose subtask was in force at ``at`` in the sim's timeline
    ``subtasks`` (the first step when none was, or ``task`` itself unless two-step)."""
    if task.kind != TWO_STEP:
        return task
    texts = subtasks_in_force(subtasks, at, at)
    keys = phases_of_subtask(task, texts[-1]) if texts else set()
    indices = [int(key.partition("/")[0]) - 1 for key in keys]
    return task.steps[max(indices, default=0)]


def phases_of_subtask(task: Task, subtask: str) -> set[str]:
    """The phases in which the sim publishes ``subtask`` for ``task`` (touch: reach and done
    share one), whatever place words it carries."""
    plain = without_place(subtask)
    return {key for key, phase in task_phases(task).items() if phase.subtask == plain}


def text_phases(task: Task, text: str) -> set[str]:
    """The phases whose sim texts share the most words with ``text`` (colours and "the", "a",
    "cube", "pad" left out); several when they tie (touch's reach and done share a subtask), none
    when no phase shares a word."""
    colours = set(CUBE_COLORS) | set(PAD_COLORS)
    ignored = colours | {"the", "a", "cube", "pad"}
    said = words(text) - ignored
    scores = {
        key: len(said & ((words(phase.subtask) | words(phase.narration)) - ignored))
        for key, phase in task_phases(task).items()
    }
    best = max(scores.values(), default=0)
    return {key for key, score in scores.items() if score == best} if best else set()


def names_object(task: Task, text: str, phase: str | None) -> bool:
    """``text`` names the task's cube and no colour the task does not name; in a place task's
    carry phase (whose sim texts name the pad) it names the task's pad too. A two-step task's:
    those of the step ``phase`` is about (with no phase, of either step)."""
    if task.kind == TWO_STEP:
        if phase is None:
            return any(names_object(step, text, None) for step in task.steps)
        step, step_phase = split_phase_key(task, phase)
        return names_object(step, text, step_phase)
    said = words(text)
    allowed = {task.cube, task.pad} if task.kind == PLACE else {task.cube}
    colours = set(CUBE_COLORS) | (set(PAD_COLORS) if task.kind == PLACE else set())
    if task.cube not in said or (colours - allowed) & said:
        return False
    return not (task.kind == PLACE and phase == "carry" and task.pad not in said)


def judge_text(task: Task, text: str, sim_phases: set[str]) -> bool:
    """Whether ``text`` names the right object and one of the phases in ``sim_phases`` (the
    phases the sim was in when the text arrived)."""
    return any(names_object(task, text, p) for p in text_phases(task, text) & sim_phases)


def sim_phases(
    task: Task,
    subtasks: Sequence[tuple[float, str]],
    success_at: float | None,
    start: float,
    end: float,
) -> set[str]:
    """The phases the sim was in at some time in [start, end]: ``subtasks`` is its timeline of
    (time, sim/subtask), ``success_at`` when it reported success (None: never); "done" only once
    it succeeded (touch publishes one subtask for reach and done)."""
    texts = subtasks_in_force(subtasks, start, end)
    phases = set().union(*(phases_of_subtask(task, text) for text in texts)) if texts else set()
    done = done_key(task)
    if success_at is None or success_at > end:
        phases.discard(done)
    elif success_at <= start:
        phases = {done}
    return phases


def subtasks_in_force(subtasks: Sequence[tuple[float, str]], start: float, end: float) -> list[str]:
    """The sim's subtasks in force at some time in [start, end] of its timeline ``subtasks``
    ((time, text) in order): the one at ``start`` and every later one up to ``end``."""
    current = [text for t, text in subtasks if t <= start][-1:]
    return current + [text for t, text in subtasks if start < t <= end]


def said_place(text: str) -> str:
    """The place words ``text`` ends with, as the sim's texts carry them ("touch the red cube, far
    left" -> "far left"); "" for none. Read with the sim's own rule (``without_place``)."""
    text = " ".join(text.lower().split())
    return text[len(without_place(text)) :].lstrip(", ")


def sim_places(subtasks: Sequence[tuple[float, str]], start: float, end: float) -> set[str]:
    """The places the sim's subtasks in force at some time in [start, end] said."""
    return {said_place(text) for text in subtasks_in_force(subtasks, start, end)} - {""}


def judge_place(text: str, places: set[str]) -> bool | None:
    """Whether ``text`` says the place the sim said (``places``: its places at that moment, from
    :func:`sim_places`); None when neither says one (nothing to judge)."""
    said = said_place(text)
    if not said and not places:
        return None
    return said in places


def strip_kind(text: str) -> tuple[str, str]:
    """``"[narration] reaching for the red cube"`` -> ("narration", "reaching for the red cube");
    a text without a ``[kind]`` prefix has kind ""."""
    match = re.match(r"\s*\[(\w+)\]\s*(.*)", text, re.DOTALL)
    return (match.group(1), match.group(2)) if match else ("", text.strip())


def names_colour(text: str, colour: str) -> bool:
    """An answer names the target colour (and no other cube colour)."""
    said = words(text)
    return colour in said and not (set(CUBE_COLORS) - {colour}) & said


# -- summaries -----------------------------------------------------------------------------------
def median_or_nan(values: Sequence[float]) -> float:
    finite = [v for v in values if v is not None and math.isfinite(v)]
    return float(statistics.median(finite)) if finite else math.nan


def mean_or_nan(values: Sequence[float]) -> float:
    finite = [v for v in values if v is not None and math.isfinite(v)]
    return float(statistics.fmean(finite)) if finite else math.nan


def fraction_or_nan(numerator: int, denominator: int) -> float:
    return numerator / denominator if denominator else math.nan
