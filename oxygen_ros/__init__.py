"""oxygen_ros: pi0.5 VLA served as a ROS 2 node with OxyGen scheduling.

Keep this file tiny: no heavy imports (torch, rclpy) so `oxygen_ros.model` / `oxygen_ros.engine`
import without ROS.

`extend_path` lets this source package also see the generated message code (`oxygen_ros.msg`
and the `oxygen_ros_s__rosidl_typesupport_*` modules) when that was installed into another
`oxygen_ros/` folder on sys.path, e.g. the venv's site-packages while the sources are an editable
install (scripts/setup_env.sh). In a colcon install both live in one folder and this is a no-op.
"""

from pkgutil import extend_path

__path__ = extend_path(__path__, __name__)

__version__ = "0.1.0"
