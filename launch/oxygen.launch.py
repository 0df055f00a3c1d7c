"""Launch oxygen_node, the managed node that serves pi0.5 actions and language over ROS 2.

    ros2 launch oxygen_ros oxygen.launch.py checkpoint_dir:=/tmp/tiny_ckpt  # oxygen-make-checkpoint
    ros2 launch oxygen_ros oxygen.launch.py robot:=droid checkpoint_dir:=/data/pi05_droid_pytorch
    ros2 launch oxygen_ros oxygen.launch.py robot:=lerobot checkpoint_dir:=.../pretrained_model
    ros2 launch oxygen_ros oxygen.launch.py config_file:=/path/to/my_robot.yaml \
        checkpoint_dir:=/data/pi05_droid_pytorch namespace:=robot1

Arguments:
    robot           picks the package's params file for an openpi robot:
                    droid -> config/pi05_droid.yaml, aloha -> config/pi05_aloha.yaml,
                    libero -> config/pi05_libero.yaml; or for a LeRobot pi05 checkpoint
                    (a pretrained_model/ folder): lerobot -> config/lerobot_pi05.yaml
    config_file     params file; wins over robot (default: the robot's file, else the package's
                    config/oxygen.yaml, the tiny demo)
    checkpoint_dir  overrides the file's checkpoint_dir when given
    namespace       namespace of the node and its ~/ topics (e.g. one per robot)

The node configures and activates itself (``autostart: true`` in the shipped configs); set
``autostart: false`` to drive it through its lifecycle services instead.

Without launch_ros (e.g. on a machine with only the PyPI ROS wheels) the equivalent command is::

    oxygen_node --ros-args --params-file config/oxygen.yaml \
        -p checkpoint_dir:=/data/pi05_droid_pytorch -r __ns:=/robot1
"""

from __future__ import annotations

import os

PACKAGE = "oxygen_ros"
OVERRIDABLE = ("checkpoint_dir",)
DEFAULT_CONFIG = "oxygen.yaml"
# robot:=NAME -> the package's params file for that openpi pi0.5 checkpoint.
ROBOT_CONFIGS = {
    "droid": "pi05_droid.yaml",
    "aloha": "pi05_aloha.yaml",
    "libero": "pi05_libero.yaml",
    "lerobot": "lerobot_pi05.yaml",  # a LeRobot pi05 folder (lerobot-train's pretrained_model/)
}


def config_path(config_file: str, robot: str, config_dir: str) -> str:
    """The params file to load: ``config_file`` if given, else the robot's, else the default.

    Plain Python (no launch imports), so it can be tested where launch_ros is not installed.

    Raises:
        ValueError: an unknown robot, or a robot whose params file is not in ``config_dir``.
    """
    if config_file:
        return config_file
    if not robot:
        return os.path.join(config_dir, DEFAULT_CONFIG)
    if robot not in ROBOT_CONFIGS:
        known = ", ".join(sorted(ROBOT_CONFIGS))
        raise ValueError(
            f"robot:={robot} is not known; use one of {known} or give config_file:=PATH"
        )
    path = os.path.join(config_dir, ROBOT_CONFIGS[robot])
    if not os.path.isfile(path):
        raise ValueError(f"robot:={robot} needs {path}, which is not installed")
    return path


def _config_dir() -> str:
    from ament_index_python.packages import get_package_share_directory

    return os.path.join(get_package_share_directory(PACKAGE), "config")


def _node(context, *args, **kwargs):
    """The node action, built once the arguments are known (only given overrides are passed)."""
    from launch.substitutions import LaunchConfiguration
    from launch_ros.actions import LifecycleNode

    config = config_path(
        LaunchConfiguration("config_file").perform(context),
        LaunchConfiguration("robot").perform(context),
        _config_dir(),
    )
    overrides = {}
    for name in OVERRIDABLE:
        value = LaunchConfiguration(name).perform(context)
        if value:
            overrides[name] = value
    # The configs use the `/**` key, so a later parameter source (the overrides) wins.
    parameters = [config, overrides] if overrides else [config]
    return [
        LifecycleNode(
            package=PACKAGE,
            executable="oxygen_node",
            name="oxygen_node",
            namespace=LaunchConfiguration("namespace"),
            parameters=parameters,
            output="screen",
            emulate_tty=True,
        )
    ]


def generate_launch_description():
    from launch.actions import DeclareLaunchArgument, OpaqueFunction

    from launch import LaunchDescription

    return LaunchDescription(
        [
            DeclareLaunchArgument(
                "robot",
                default_value="",
                description="openpi robot whose params file to use: "
                + " | ".join(sorted(ROBOT_CONFIGS))
                + "; empty: config_file or the package's config/oxygen.yaml",
            ),
            DeclareLaunchArgument(
                "config_file",
                default_value="",
                description="params file (wins over robot); empty: the robot's file or "
                "config/oxygen.yaml",
            ),
            DeclareLaunchArgument(
                "checkpoint_dir",
                default_value="",
                description="openpi-layout checkpoint directory; empty: keep the file's value",
            ),
            DeclareLaunchArgument(
                "namespace", default_value="", description="namespace of the node (one per robot)"
            ),
            OpaqueFunction(function=_node),
        ]
    )
