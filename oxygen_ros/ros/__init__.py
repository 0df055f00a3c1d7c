"""ROS 2 layer of oxygen_ros: the only code that imports rclpy."""
