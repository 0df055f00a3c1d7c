"""`oxygen-bench sim-policy` with guided RTC over at most $RTC_H steps of each new chunk (the node's
`rtc_execution_horizon`; the bench guides the whole overlap).

    RTC_H=3 python docs/benchmarks/place_stages/rtc_horizon.py --continuity guided ARGS...
"""

import os
import sys

from patched_bench import run

from oxygen_ros.tools.benches import subtask_modes

HORIZON = int(os.environ["RTC_H"])
_settings = subtask_modes.continuity_settings


def continuity_settings(continuity: str, guidance_weight: float = 5.0) -> dict[str, object]:
    settings = dict(_settings(continuity, guidance_weight))
    if continuity == "guided":
        settings["rtc_execution_horizon"] = HORIZON
    return settings


if __name__ == "__main__":
    subtask_modes.continuity_settings = continuity_settings
    run(sys.argv[1:])
