"""Launch oxygen_node, the managed node that serves pi0.5 actions and language over ROS 2.

    ros2 launch oxygen_ros oxygen.launch.py
    ros2 launch oxygen_ros oxygen.launch.py config_file:=/path/to/pi05_droid.yaml \
        checkpoint_dir:=/data/pi05_droid_pytorch namespace:=robot1

Arguments:
    config_file     params file (default: the package's config/oxygen.yaml, the tiny demo)
    checkpoint_dir  overrides the file's checkpoint_dir when given
    preset          overrides the file's preset when given (tiny | small, used without a checkpoint)
    namespace       namespace of the node and its ~/ topics (e.g. one per robot)

The node configures and activates itself (``autostart: true`` in the shipped configs); set
``autostart: false`` to drive it through its lifecycle services instead.

Without launch_ros (e.g. on a machine with only the PyPI ROS wheels) the equivalent command is::

    oxygen_node --ros-args --params-file config/oxygen.yaml \
        -p checkpoint_dir:=/data/pi05_droid_pytorch -r __ns:=/robot1
"""

import os

from launch import LaunchDescription
from launch.actions import DeclareLaunchArgument, OpaqueFunction
from launch.substitutions import LaunchConfiguration
from launch_ros.actions import LifecycleNode

PACKAGE = 'oxygen_ros'
OVERRIDABLE = ('checkpoint_dir', 'preset')


def _default_config() -> str:
    from ament_index_python.packages import get_package_share_directory

    return os.path.join(get_package_share_directory(PACKAGE), 'config', 'oxygen.yaml')


def _node(context, *args, **kwargs):
    """The node action, built once the arguments are known (only given overrides are passed)."""
    config = LaunchConfiguration('config_file').perform(context) or _default_config()
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
            executable='oxygen_node',
            name='oxygen_node',
            namespace=LaunchConfiguration('namespace'),
            parameters=parameters,
            output='screen',
            emulate_tty=True,
        )
    ]


def generate_launch_description() -> LaunchDescription:
    return LaunchDescription([
        DeclareLaunchArgument(
            'config_file', default_value='',
            description="params file; empty: the package's config/oxygen.yaml"),
        DeclareLaunchArgument(
            'checkpoint_dir', default_value='',
            description="openpi-layout checkpoint directory; empty: keep the file's value"),
        DeclareLaunchArgument(
            'preset', default_value='',
            description="model preset for random weights (tiny | small); empty: keep the file's value"),
        DeclareLaunchArgument(
            'namespace', default_value='',
            description='namespace of the node (one per robot)'),
        OpaqueFunction(function=_node),
    ])
