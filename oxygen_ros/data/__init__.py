"""Recorded episodes as training data, without ROS: rosbag2 -> LeRobotDataset v3.

Pure Python on ``rosbags``, numpy, pyarrow and PIL (no rclpy import anywhere below), one job per
module:

* :mod:`.mapping`         the topic -> feature mapping (YAML): kinds, topics, staleness limits;
* :mod:`.bag_episode`     one rosbag2 read into time-stamped messages per topic, on one timeline;
* :mod:`.alignment`       the frame grid at a fixed fps, zero-order hold, staleness drops;
* :mod:`.message_values`  ROS messages -> numpy (images, joint positions, trajectory references);
* :mod:`.stats`           per-episode statistics and their aggregation, in LeRobot's layout;
* :mod:`.lerobot_dataset` writing and reading a LeRobotDataset v3 folder;
* :mod:`.bag_to_lerobot`  the conversion of bags into episodes, driven by the mapping.
"""
