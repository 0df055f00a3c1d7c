# Entry points for people and CI. Every target first runs the (idempotent, ~0.2 s when up to
# date) environment setup, so a fresh clone needs nothing but `make test`.
#
# ROS_DISTRO picks the ROS 2 distribution the venv is built for and tested on: jazzy (the default,
# in .venv) or kilted (in .venv-kilted), e.g. `make test ROS_DISTRO=kilted`. .ci/run tests both.
ROS_DISTRO ?= jazzy
export ROS_DISTRO
VENV ?= $(if $(filter jazzy,$(ROS_DISTRO)),.venv,.venv-$(ROS_DISTRO))
ABS_VENV := $(abspath $(VENV))
ARGS ?=

.PHONY: setup test demo demo-bag bench lint clean

setup:
	OXYGEN_VENV="$(ABS_VENV)" bash scripts/setup_env.sh

# The linter runs first over the whole tree (ruff.toml), then every test.
test: setup
	$(ABS_VENV)/bin/ruff check .
	$(ABS_VENV)/bin/ruff format --check .
	$(ABS_VENV)/bin/python -m pytest -q test $(ARGS)

# The policy trained here (models/sim_so101) drives the simulated arm through the node, narrating;
# demo-bag: the node on a synthetic rosbag2 with a random-weight model (frame rate, tokens/s).
demo: setup
	$(ABS_VENV)/bin/oxygen-demo --sim $(ARGS)

demo-bag: setup
	$(ABS_VENV)/bin/oxygen-demo $(ARGS)

bench: setup
	$(ABS_VENV)/bin/oxygen-bench $(ARGS)

# ruff with ruff.toml; ARGS narrows it, e.g. `make lint ARGS=oxygen_ros/tools`.
lint: setup
	$(ABS_VENV)/bin/ruff check $(or $(ARGS),.)
	$(ABS_VENV)/bin/ruff format --check $(or $(ARGS),.)

# Removes build outputs only; `rm -rf .venv` for a fresh environment.
clean:
	rm -rf build install log
