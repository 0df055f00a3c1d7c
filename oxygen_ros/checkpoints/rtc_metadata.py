"""What a checkpoint declares about training-time real-time chunking.

A checkpoint trained with a clean action prefix (Black et al., arXiv 2512.05964; LeRobot's
``PI05Config.rtc_training_max_delay``, written to its ``config.json``) can continue the previous
chunk without guidance, for delays up to that maximum (``model.rtc.TrainedPrefix``). openpi's
converter config has no such field; any ``config.json`` that holds it (an openpi-layout export
included) is read the same way. Absent: 0, the checkpoint knows nothing of it.
"""

from __future__ import annotations

import json
from pathlib import Path

from .core import CheckpointError, PathLike
from .openpi import OPENPI_CONFIG_FILENAME

FIELD = "rtc_training_max_delay"


def declared_rtc_training_max_delay(ckpt_dir: PathLike, horizon: int) -> int:
    """The checkpoint's ``rtc_training_max_delay`` from its ``config.json``; 0 when absent.

    Raises:
        CheckpointError: an unreadable file, or a value that is not an integer in
            [0, ``horizon``) (LeRobot needs it below the chunk size).
    """
    path = Path(ckpt_dir) / OPENPI_CONFIG_FILENAME
    if not path.is_file():
        return 0
    try:
        written = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path} is not readable JSON: {exc}") from exc
    value = written.get(FIELD) if isinstance(written, dict) else None
    if value is None:
        return 0
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < horizon:
        raise CheckpointError(
            f"{path}: {FIELD} must be an integer in [0, {horizon}) (the action horizon), got "
            f"{value!r}"
        )
    return value
