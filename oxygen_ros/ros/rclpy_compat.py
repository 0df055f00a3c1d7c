"""Everything that differs between the rclpy releases oxygen_ros runs on, handled in one place.

Tested: rclpy 7.1 (ROS 2 Jazzy, the default environment) and rclpy 9.1 (Kilted); CI runs the whole
suite on both. Written for, not tested here: rclpy 3.x (Humble). The rest of the package imports
what differs from here and never checks a version itself.

Differences found between rclpy 7.1.6 (Jazzy) and 9.1.2 (Kilted), and how each is handled:

* ``ActionServer(result_timeout=...)`` defaults to 900 s on Jazzy (and Humble) and 10 s on Kilted:
  how long a finished goal's result stays available. :func:`create_action_server` always passes
  :data:`ACTION_RESULT_TIMEOUT_S`, so an answer can be fetched for the same time everywhere.
* Shutting a context down destroys the nodes it created on Kilted (``Context`` tracks its nodes);
  on Jazzy the nodes outlive it with invalid publishers. Either way nothing can be published after
  the context is down, so the node's ``main()`` finishes open Ask goals, then destroys the node,
  then shuts the context down (:mod:`.shutdown`), and installs no rclpy signal handler
  (:func:`init_without_signal_handlers`), whose SIGINT would shut the context down first.
* ``rclpy.try_shutdown`` uninstalls rclpy's signal handlers on Kilted, not on Jazzy; and
  ``rclpy.init`` returns a context manager on Kilted, None on Jazzy. Neither matters once rclpy
  installs no handlers; the package never uses ``init``'s return value.
* ``ServerGoalHandle.execute`` (``ActionServer.notify_execute``) raises AttributeError on Jazzy
  when the node is no longer in an executor, and does nothing on Kilted: goals are finished while
  the node is still spun (see :mod:`.shutdown`).
* Executors run pending tasks newest first on Jazzy and oldest first on Kilted: nothing here
  depends on the order in which finished goals send their results.
* Timer callbacks may take a ``TimerInfo`` argument on Kilted only: the node's timer callbacks
  take no argument.
* ``Node.add_post_set_parameters_callback`` exists since Iron (both tested releases; Humble lacks
  it): :func:`has_post_set_parameters_callback` says whether the node can apply accepted parameter
  changes right after they are set, else it applies them at the next tick.
* ``rclpy.executors.ExternalShutdownException`` and ``rclpy.init(signal_handler_options=...)``
  exist in Humble, Jazzy and Kilted (checked in their sources); releases before Humble end
  ``spin()`` with KeyboardInterrupt only, so stand-ins are kept for them.
* Kilted adds ``qos_profile_rosout_default``, ``Executor.create_future``, ``MultiThreadedExecutor
  .shutdown(wait_for_threads=...)``, content-filtered subscriptions and action introspection:
  none of them is used. QoS profiles, lifecycle transitions and publishers, parameter callbacks
  and ``Timer`` behave the same for what the node uses.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from importlib import metadata
from typing import Any

import rclpy
from rclpy.action import ActionServer

try:
    from rclpy.executors import ExternalShutdownException
except ImportError:  # rclpy releases that predate it end spin() with KeyboardInterrupt only

    class ExternalShutdownException(Exception):  # type: ignore[no-redef]
        """Stand-in; never raised."""


try:
    from rclpy.signals import SignalHandlerOptions
except ImportError:  # pragma: no cover - every tested release has it
    SignalHandlerOptions = None  # type: ignore[assignment,misc]

__all__ = [
    "ACTION_RESULT_TIMEOUT_S",
    "DISTRO_BY_RCLPY_MAJOR",
    "ExternalShutdownException",
    "create_action_server",
    "has_post_set_parameters_callback",
    "init_without_signal_handlers",
    "ros_distro",
]

ACTION_RESULT_TIMEOUT_S = 60
"""Seconds a finished Ask goal's result stays available to clients (rclpy's default differs)."""

DISTRO_BY_RCLPY_MAJOR = {3: "humble", 7: "jazzy", 9: "kilted"}
"""The ROS 2 distribution of each rclpy major version this package is written for."""


def ros_distro() -> str:
    """The ROS 2 distribution in use: ``$ROS_DISTRO`` when set (a sourced ROS install, or the
    Makefile), else the one the installed rclpy wheel belongs to, else ``""``."""
    distro = os.environ.get("ROS_DISTRO", "")
    if distro:
        return distro
    try:
        major = int(metadata.version("ros-rclpy").split(".")[0])
    except (metadata.PackageNotFoundError, ValueError):
        return ""
    return DISTRO_BY_RCLPY_MAJOR.get(major, "")


def init_without_signal_handlers(args: Sequence[str] | None = None) -> None:
    """``rclpy.init`` for the default context without rclpy's SIGINT/SIGTERM handlers (which shut
    the context down before the program can finish what is open); the caller installs its own."""
    if SignalHandlerOptions is None:  # pragma: no cover
        rclpy.init(args=list(args) if args is not None else None)
        return
    rclpy.init(
        args=list(args) if args is not None else None,
        signal_handler_options=SignalHandlerOptions.NO,
    )


def has_post_set_parameters_callback(node: Any) -> bool:
    """Whether ``node`` can run a callback after parameters were set (rclpy >= Iron)."""
    return hasattr(node, "add_post_set_parameters_callback")


def create_action_server(
    node: Any,
    action_type: Any,
    name: str,
    execute_callback: Callable[[Any], Any],
    **callbacks: Any,
) -> ActionServer:
    """An ``ActionServer`` that keeps finished results for :data:`ACTION_RESULT_TIMEOUT_S` on
    every release (``callbacks``: goal_callback, handle_accepted_callback, cancel_callback...)."""
    return ActionServer(
        node,
        action_type,
        name,
        execute_callback=execute_callback,
        result_timeout=ACTION_RESULT_TIMEOUT_S,
        **callbacks,
    )
