"""What the tests of the node's tick without DDS share: a `TickLoop` on a clock the test sets,
and outputs that keep the commands instead of publishing them."""

from __future__ import annotations

import logging
from collections.abc import Callable

from oxygen_ros.engine.counters import Counters
from oxygen_ros.engine.faults import NO_FAULTS
from oxygen_ros.ros.tick import TickLoop


class KeptOutputs:
    """The node's outputs, keeping each command it would publish."""

    def __init__(self) -> None:
        self.commands = []

    def publish_command(self, settings, chunk, stamp, command, *args) -> list:
        self.commands.append(command)
        return []  # every trajectory sent


def tick_loop(
    rate_hz: float, now_ns: Callable[[], int] = lambda: 0, counters: Counters | None = None
) -> TickLoop:
    """A tick loop at ``rate_hz`` on the clock ``now_ns``, counting into ``counters``."""
    return TickLoop(
        counters if counters is not None else Counters(),
        lambda key, message: None,
        logging.getLogger("test"),
        NO_FAULTS,
        now_ns,
        lambda: None,
        lambda started, period: started + period,
        rate_hz,
    )
