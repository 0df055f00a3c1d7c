"""pip install path for oxygen_ros (ament_python style metadata).

A ROS workspace builds this repository through CMakeLists.txt (ament_cmake: messages + Python
package + ROS executables). setup.py serves pip installs, e.g. the editable install made by
scripts/setup_env.sh after it has built the messages into the venv.

torch is deliberately NOT in install_requires: an unpinned torch lets pip pick a multi-GB CUDA
build. Install the build you want first (CPU: `pip install torch==2.13.0`), as
scripts/setup_env.sh does; requirements.txt pins everything else.
"""

from glob import glob

from setuptools import find_packages, setup

PACKAGE = "oxygen_ros"

# Keep equal to OXYGEN_ROS_ENTRY_POINTS in CMakeLists.txt (test/test_messages.py checks it).
CONSOLE_SCRIPTS = [
    "oxygen_node=oxygen_ros.ros.node:main",
    "oxygen-make-checkpoint=oxygen_ros.tools.make_checkpoint:main",
    "oxygen-model-info=oxygen_ros.tools.model_info:main",
    "oxygen-bench=oxygen_ros.tools.bench:main",
    "oxygen-make-bag=oxygen_ros.tools.make_bag:main",
    "oxygen-replay=oxygen_ros.tools.replay:main",
    "oxygen-demo=oxygen_ros.tools.demo:main",
    "oxygen-sim=oxygen_ros.tools.sim:main",
    "oxygen-collect=oxygen_ros.tools.collect:main",
    "oxygen-record=oxygen_ros.tools.record:main",
    "oxygen-bag-to-lerobot=oxygen_ros.tools.bag_to_lerobot:main",
    "oxygen-render-episode=oxygen_ros.tools.render_episode:main",
    "oxygen-train=oxygen_ros.tools.train:main",
    "oxygen-sim-dataset=oxygen_ros.tools.sim_dataset:main",
    "oxygen-plot-closed-loop=oxygen_ros.tools.plot_closed_loop:main",
    "oxygen-serve=oxygen_ros.tools.serve:main",
]

setup(
    name=PACKAGE,
    version="0.1.0",
    packages=find_packages(include=[PACKAGE, PACKAGE + ".*"]),
    data_files=[
        ("share/ament_index/resource_index/packages", ["resource/" + PACKAGE]),
        ("share/" + PACKAGE, ["package.xml"]),
        ("share/" + PACKAGE + "/launch", sorted(glob("launch/*.py"))),
        ("share/" + PACKAGE + "/config", sorted(glob("config/*.yaml"))),
        ("share/" + PACKAGE + "/rviz", sorted(glob("rviz/*.rviz"))),
        ("share/" + PACKAGE + "/models/sim_so101", sorted(glob("models/sim_so101/*"))),
    ],
    python_requires=">=3.10",
    install_requires=[
        "numpy>=1.23",
        "safetensors>=0.4",
        "sentencepiece>=0.1.99",
        "pillow>=10",
        "msgpack>=1.0",
        "websockets>=13",
    ],
    extras_require={
        "tools": ["rosbags>=0.11", "matplotlib>=3.7", "mujoco>=3.2", "pyarrow>=14"],
        "test": ["pytest>=7", "pytest-timeout>=2", "hypothesis>=6"],
    },
    zip_safe=False,
    maintainer="oxygen_ros maintainers",
    maintainer_email="maintainers@oxygen-ros.invalid",
    description="pi0.5 VLA as a ROS 2 node with OxyGen KV sharing and continuous batching",
    license="Apache-2.0",
    entry_points={"console_scripts": CONSOLE_SCRIPTS},
)
