"""A simulated table-top robot for closed-loop tests: an SO-101-like arm in MuJoCo as a ROS 2 node.

The robot knows nothing about any policy. Modules, one job each (lowest first):

* ``scene``       the MJCF (primitives only), the arm's dimensions and the objects' sizes;
* ``tasks``       task texts, seeded random layouts, geometric success;
* ``world``       physics, PD servos, the grasp assist and headless rendering (no ROS);
* ``controller``  joint_trajectory_controller semantics: acceptance, replace-and-interpolate;
* ``language``    the current subtask and narration sentences made from the sim's state;
* ``episode``     one running episode: world + controllers + task + status (no ROS node);
* ``kinematics``  analytic inverse kinematics of the arm;
* ``expert``      the scripted expert (privileged state -> JointTrajectory) and its node;
* ``headless``    expert episodes without ROS, for measuring the expert's success rate;
* ``node``        the rclpy node: simulation clock, topics, the reset service.
"""
