"""The torch device a model is asked to run on, checked against the torch that is installed.

torch's own answer to ``device: cuda`` on a build without CUDA is a bare "Torch not compiled with
CUDA enabled" from deep inside the first tensor move. :func:`resolve_device` says instead what was
asked for, what this torch has (``torch.__version__``, whether CUDA is available, how many
devices) and the fix.
"""

from __future__ import annotations

import torch


class DeviceUnavailable(ValueError):
    """A device this torch build or this machine cannot provide (the message says why and the
    fix)."""


def resolve_device(name: str | torch.device) -> torch.device:
    """The torch device ``name`` (``cpu``, ``cuda``, ``cuda:N``, ...) once it is known to exist.

    Raises:
        DeviceUnavailable: not a device name torch knows, CUDA asked for where this torch cannot
            use it (built without CUDA, or no GPU visible), or a CUDA index beyond the devices seen.
    """
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError) as exc:
        raise DeviceUnavailable(
            f"device {str(name)!r} is not a torch device ({exc}); use cpu, cuda or cuda:N"
        ) from exc
    if device.type != "cuda":
        return device
    if not torch.cuda.is_available():
        built = torch.version.cuda
        if built is None:
            why, fix = "this build has no CUDA support", "install a CUDA build of torch"
        else:
            why = f"this build is for CUDA {built} but sees no usable GPU"
            fix = "make a GPU visible to this process (NVIDIA driver, CUDA_VISIBLE_DEVICES)"
        raise DeviceUnavailable(
            f"device {str(name)!r} was asked for, but torch {torch.__version__} cannot use CUDA "
            f"here: torch.cuda.is_available() is False ({why}). Fix: run on the CPU "
            f"(device:=cpu, or --device cpu), or {fix}"
        )
    count = torch.cuda.device_count()
    if device.index is not None and device.index >= count:
        raise DeviceUnavailable(
            f"device {str(name)!r} was asked for, but torch {torch.__version__} sees {count} CUDA "
            f"device(s) (cuda:0 to cuda:{count - 1}); pick one of those or device:=cpu"
        )
    return device
