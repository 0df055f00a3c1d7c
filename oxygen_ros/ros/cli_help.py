"""``oxygen_node --help``: usage and every parameter of :data:`~oxygen_ros.ros.params.PARAMETERS`.

The text is built from the parameter declarations themselves (description, type, range, default,
when a change applies), so it cannot drift from what the node declares. It is printed before
``rclpy.init``: asking for help starts no node and needs no middleware.
"""

from __future__ import annotations

import textwrap
from collections.abc import Sequence
from typing import Any

from rcl_interfaces.msg import ParameterType

from .params import CONFIGURE, PARAMETERS, RUNTIME, STATIC, ParamSpec

PROGRAM = "oxygen_node"
HELP_FLAGS = ("-h", "--help")
WIDTH = 100

_TYPE_NAMES = {
    ParameterType.PARAMETER_BOOL: "bool",
    ParameterType.PARAMETER_INTEGER: "integer",
    ParameterType.PARAMETER_DOUBLE: "double",
    ParameterType.PARAMETER_STRING: "string",
    ParameterType.PARAMETER_BOOL_ARRAY: "bool[]",
    ParameterType.PARAMETER_INTEGER_ARRAY: "integer[]",
    ParameterType.PARAMETER_DOUBLE_ARRAY: "double[]",
    ParameterType.PARAMETER_STRING_ARRAY: "string[]",
}
_WHEN = {
    STATIC: "static: read once at start-up",
    CONFIGURE: "configure: applied by the configure transition",
    RUNTIME: "runtime: can change while running",
}

USAGE = f"""\
usage: {PROGRAM} [-h] [--ros-args [--params-file FILE] [-p NAME:=VALUE ...] [-r __ns:=/NS] ...]

pi0.5 Vision-Language-Action model as a ROS 2 lifecycle node: an action chunk every tick and
streamed language (narration, answers to ~/ask, memory) from one shared KV cache (OxyGen).

options:
  -h, --help    show this help and exit (only before --ros-args; nothing is started)

Example:
  {PROGRAM} --ros-args --params-file config/oxygen.yaml -p rate_hz:=30.0 -r __ns:=/robot1
"""


def help_requested(argv: Sequence[str]) -> bool:
    """True when ``argv`` (program name first) has ``-h``/``--help`` before ``--ros-args``."""
    args = list(argv[1:])
    if "--ros-args" in args:
        args = args[: args.index("--ros-args")]
    return any(arg in HELP_FLAGS for arg in args)


def format_default(value: Any) -> str:
    """A default as a params file writes it (``''``, ``true``, ``['a', 'b']``, ``60.0``)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(format_default(v) for v in value) + "]"
    return repr(value)


def format_parameter(spec: ParamSpec) -> str:
    """The entry of one parameter: name, type, default, range, when it applies, description."""
    facts = [
        _TYPE_NAMES.get(spec.type, f"type {spec.type}"),
        f"default {format_default(spec.default)}",
    ]
    if spec.range is not None:
        low, high = spec.range
        if spec.type == ParameterType.PARAMETER_INTEGER:
            facts.append(f"range [{int(low)}, {int(high)}]")
        else:
            facts.append(f"range [{low:g}, {high:g}]")
    head = f"  {spec.name} ({', '.join(facts)})"
    body = textwrap.fill(
        f"{spec.description}. [{_WHEN[spec.applies]}]",
        width=WIDTH,
        initial_indent=" " * 6,
        subsequent_indent=" " * 6,
    )
    return f"{head}\n{body}"


def help_text() -> str:
    """Usage, then every declared parameter in declaration order."""
    lines = [USAGE, "parameters (set with -p NAME:=VALUE or in a --params-file):"]
    lines.extend(format_parameter(spec) for spec in PARAMETERS)
    return "\n".join(lines)


def print_help() -> int:
    """Print :func:`help_text`; returns the exit status 0 for ``main`` to return."""
    print(help_text())
    return 0
