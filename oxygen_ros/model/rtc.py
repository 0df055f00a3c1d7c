"""Real-time chunking (RTC): denoise a new action chunk as an inpainting of the previous one.

Black, Galliker & Levine 2025, "Real-Time Execution of Action Chunking Flow Policies"
(arXiv 2506.07339). While the controller still executes the previous chunk, the next one is
sampled so that it agrees with the actions the controller will execute before the new chunk
arrives (the first ``d`` steps, frozen), agrees less and less over the rest of the overlap (a
soft mask), and is free after it. Only the sampler changes; the model and its weights do not.

Derivation in openpi's time convention
--------------------------------------
The paper's time runs from 0 (noise) to 1 (data): ``x_tau = tau*A + (1-tau)*eps``,
``v_paper = A - eps``, and its guided velocity (eq. 2-4) is

    v_paper + min(beta, (1-tau) / (tau * r^2)) * (Y - A_hat)^T diag(W) dA_hat/dx,
    A_hat = x_tau + (1-tau) * v_paper,   r^2 = (1-tau)^2 / (tau^2 + (1-tau)^2).

openpi's time runs the other way, ``t = 1 - tau``: ``x_t = t*eps + (1-t)*A``, ``v = eps - A =
-v_paper``, Euler from t=1 with ``dt = -1/N``. Substituting:

* denoised estimate: ``A_hat = x_t - t * v(x_t, t)``;
* its Jacobian: ``J = dA_hat/dx_t = I - t * dv/dx_t``, so the guidance direction is the
  vector-Jacobian product ``g = J^T e = e - t * (dv/dx_t)^T e`` with ``e = W * (Y - A_hat)``:
  one backward pass through the action expert per denoising step;
* weight: ``(1-tau)/(tau r^2) = t/(1-t) * (t^2 + (1-t)^2)/t^2 = (t^2 + (1-t)^2) / (t (1-t))``,
  infinite at t=1 (the first step) and clipped at ``beta`` (``max_guidance_weight``);
* sign: ``v_paper`` gains ``+w*g``, so openpi's ``v`` loses it: ``v_guided = v - w*g``. The Euler
  step ``x += dt * v_guided`` with ``dt < 0`` then moves ``x`` by ``+|dt| w g``, toward ``Y``.

With ``v`` independent of ``x`` (J = I) one guided step shrinks ``Y - A_hat`` on a frozen step by
the factor ``1 - |dt| w``: ``beta = N`` projects onto the target exactly at the first step, and
``beta > 2N`` would overshoot, which is why the weight is clipped.

Soft mask (eq. 5), over the new chunk's steps ``i`` with ``d`` frozen steps and the previous
chunk overlapping the first ``end`` steps:

    W_i = 1                                  for i < d
    W_i = c_i * (e^c_i - 1) / (e - 1)        for d <= i < end  ("exp"; "linear": W_i = c_i)
    W_i = 0                                  for i >= end,     c_i = (end - i) / (end - d + 1).

The prefix KV is only read: guidance differentiates with respect to ``x_t`` alone, so no gradient
flows into the KV (it holds none), and RTC costs action-expert work only.

Identity guidance (``jacobian="identity"``)
-------------------------------------------
LeRobot's guided RTC, as its code runs, computes ``v`` before it turns on gradients, so its
autograd "VJP" sees the identity: the correction is the weighted error itself,
``v_guided = v - w * e``, the ``J = I`` case above (velocity held constant in ``x``). It costs a
plain step plus a few element-wise operations, has no backward pass, and is free of host syncs, so
the fixed-shape path (CUDA graphs) runs it. ``vjp`` keeps the paper's full pseudoinverse guidance
(eager only).

Training-time RTC (`TrainedPrefix`)
-----------------------------------
Black et al. (arXiv 2512.05964), LeRobot ``mode="trained"``: a checkpoint trained with a clean
action prefix (``rtc_training_max_delay`` > 0: a random prefix of at most that many steps kept at
time 0 and left out of the loss) needs no guidance. At inference the first ``d`` steps of the new
chunk are overwritten with the previous chunk before and after every Euler step, and the action
expert sees a time per token: 0 on that frozen prefix, ``t`` elsewhere. A delay above the
checkpoint's maximum is outside what it was trained for: LeRobot raises; the engine falls back to
guided RTC for that chunk (``engine.continuity``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import torch
from torch import Tensor

SCHEDULES = ("exp", "linear")
CONTINUITY_MODES = ("none", "rtc")
GUIDANCE = ("identity", "vjp")  # how guided RTC corrects the velocity (see the module docstring)
# which RTC continues a chunk: the checkpoint's training-time RTC when it declares one (auto),
# always that (trained: refused for a checkpoint without it), or guided RTC on any checkpoint
RTC_MODES = ("auto", "trained", "guided")


def prefix_weights(horizon: int, frozen: int, end: int, schedule: str = "exp") -> Tensor:
    """Per-step guidance weights [horizon] (float32): 1 on the first ``frozen`` steps, a soft
    decay up to ``end`` (the overlap with the previous chunk), 0 after.

    ``frozen`` and ``end`` are clamped to [0, horizon]; ``frozen`` beyond ``end`` is cut to ``end``
    (a step the previous chunk does not cover cannot be frozen).

    Raises:
        ValueError: an unknown schedule or a negative horizon.
    """
    if schedule not in SCHEDULES:
        raise ValueError(f"RTC schedule must be one of {', '.join(SCHEDULES)}, got {schedule!r}")
    if horizon < 0:
        raise ValueError(f"horizon must be >= 0, got {horizon}")
    end = max(0, min(end, horizon))
    frozen = max(0, min(frozen, end))
    weights = torch.zeros(horizon, dtype=torch.float32)
    weights[:frozen] = 1.0
    steps = torch.arange(frozen, end, dtype=torch.float64)
    c = (end - steps) / (end - frozen + 1)
    if schedule == "exp":
        c = c * torch.expm1(c) / math.expm1(1.0)
    weights[frozen:end] = c.float()
    return weights


def guidance_weight(t: float, max_weight: float) -> float:
    """The pseudoinverse guidance weight at openpi time ``t``: (t^2 + (1-t)^2) / (t (1-t)),
    clipped at ``max_weight`` (infinite at t = 0 and t = 1)."""
    denominator = t * (1.0 - t)
    if denominator <= 0.0:
        return float(max_weight)
    return float(min(max_weight, (t * t + (1.0 - t) ** 2) / denominator))


def guidance_weights(times: Tensor, max_weight: float) -> Tensor:
    """`guidance_weight` of every time in ``times`` [steps], float32 on their device, without a
    host sync; made once per schedule and beta (`pi05.StepSchedule.guidance_weights`)."""
    t = times.double()
    denominator = t * (1.0 - t)
    weight = (t * t + (1.0 - t) ** 2) / denominator
    clipped = torch.clamp(weight, max=float(max_weight))
    return torch.where(denominator > 0, clipped, torch.full_like(t, float(max_weight))).float()


@dataclasses.dataclass
class RTCGuidance:
    """What a guided sampler inpaints towards.

    target: [B or 1, horizon, action_dim] model-space actions the new chunk should agree with
        (any values where ``weights`` is 0).
    weights: broadcastable to the target, e.g. [horizon, action_dim]: the soft mask (per step)
        times which action dims count (the robot's, not the model's padding).
    max_guidance_weight: beta, the clip of the guidance weight.
    jacobian: ``vjp`` (the paper's pseudoinverse guidance, one vector-Jacobian product per step)
        or ``identity`` (the weighted error itself, as LeRobot's code runs; see the module
        docstring).
    """

    target: Tensor
    weights: Tensor
    max_guidance_weight: float = 5.0
    jacobian: str = "vjp"

    def __post_init__(self) -> None:
        if self.jacobian not in GUIDANCE:
            raise ValueError(
                f"RTC guidance must be one of {', '.join(GUIDANCE)}, got {self.jacobian!r}"
            )
        if not (math.isfinite(self.max_guidance_weight) and self.max_guidance_weight >= 0):
            raise ValueError(
                f"max_guidance_weight must be a finite number >= 0, got {self.max_guidance_weight}"
            )
        if not torch.isfinite(self.target).all():
            raise ValueError("RTC guidance target holds NaN or Inf values")

    @property
    def active(self) -> bool:
        """False when nothing is guided (no overlap, or beta 0): the plain sampler is exact then."""
        return self.max_guidance_weight > 0 and bool((self.weights != 0).any())

    @property
    def static(self) -> bool:
        """Whether the fixed-shape path can run it (identity: no backward pass, no host sync)."""
        return self.jacobian == "identity"

    def settle(self, actions: Tensor) -> Tensor:
        """The denoised ``actions`` with the frozen steps (weight 1) set to the target: those steps
        fall due before the chunk takes over, so, as in the paper's executor, the robot runs the
        executed chunk's there and the switch lands on it exactly; guidance shapes the rest."""
        return torch.where(self.weights >= 1.0, self.target, actions)

    def velocity(
        self,
        velocity_fn: Callable[[Tensor], Tensor],
        x_t: Tensor,
        t: float | Tensor,
        weight: float | Tensor | None = None,
    ) -> Tensor:
        """Guided openpi velocity ``v - w * J^T (W * (Y - A_hat))`` at ``x_t`` (see the module
        docstring). vjp: one forward and one vector-Jacobian product of ``velocity_fn`` w.r.t.
        x_t; identity (J = I): one forward. ``weight`` defaults to `guidance_weight` of ``t``
        (tensors for both keep the identity step free of host syncs)."""
        if weight is None:
            weight = guidance_weight(float(t), self.max_guidance_weight)
        if self.jacobian == "identity":
            v = velocity_fn(x_t)
            error = self.weights * (self.target - (x_t - t * v))
            return v - weight * error
        with torch.enable_grad():
            x = x_t.detach().requires_grad_(True)
            v = velocity_fn(x)
            estimate = x.detach() - t * v.detach()  # A_hat
            error = self.weights * (self.target - estimate)
            (dv_error,) = torch.autograd.grad(v, x, grad_outputs=error)  # (dv/dx)^T e
        correction = error - t * dv_error
        return v.detach() - weight * correction


@dataclasses.dataclass
class TrainedPrefix:
    """Training-time RTC for a checkpoint trained with a clean action prefix (module docstring).

    target: [1, horizon, action_dim] model-space actions; the frozen steps hold the previous chunk
        (the model's padding dims 0, as LeRobot pads), the rest any finite values.
    frozen: bool [horizon], True on the first ``d`` steps (the delay as data, not as a shape).
    """

    target: Tensor
    frozen: Tensor

    def __post_init__(self) -> None:
        if self.frozen.dtype != torch.bool or self.frozen.dim() != 1:
            raise ValueError("TrainedPrefix.frozen must be a bool vector [horizon]")
        if not torch.isfinite(self.target).all():
            raise ValueError("RTC trained prefix holds NaN or Inf values")

    def clamp(self, x_t: Tensor) -> Tensor:
        """``x_t`` with the frozen steps overwritten by the target."""
        return torch.where(self.frozen[:, None], self.target, x_t)
