#!/usr/bin/env bash
# Build the project's virtual environment for one ROS 2 distribution from nothing, or do nothing if
# it is up to date.
#
#   bash scripts/setup_env.sh                      # Jazzy (the default) in ./.venv
#   ROS_DISTRO=kilted bash scripts/setup_env.sh    # Kilted in ./.venv-kilted
#   OXYGEN_VENV=/path/venv PYTHON=python3.12 bash scripts/setup_env.sh
#
# ROS_DISTRO picks requirements/<distro>.txt (the distribution's ROS wheels, pinned, plus the shared
# requirements.txt); one venv per distribution. A venv built for another distribution (its
# .oxygen_ros_distro says which; venvs from before the choice existed have none) is removed and
# built anew rather than mixed.
#
# Steps (all skipped when the stamp matches):
#   1. python3 -m venv; pip==25.3
#   2. pip install torch==2.13.0 (alone, first: an unpinned torch would pull a CUDA build)
#   3. pip install -r requirements/<distro>.txt (the ROS 2 wheels, numpy, test tools, colcon, ...)
#   4. patch the include paths the ROS wheels baked into their *__rosidl_generator_pyExport.cmake
#   5. cmake-build msg/ and action/ against the wheels and install them into the venv prefix
#      (generated Python lands in site-packages/oxygen_ros/{msg,action,*typesupport*.so}; its empty
#      __init__.py and egg-info are removed so that the editable source package owns the name and
#      reaches the generated part through pkgutil.extend_path in oxygen_ros/__init__.py)
#   6. pip install --no-deps -e . (compat mode: a plain path entry, needed for extend_path)
#   7. smoke-import oxygen_ros.msg and oxygen_ros.action, write the stamp
#
# The stamp is a hash of every input (requirements, messages, actions, build files, this script, the venv
# path and Python version); change any of them and the next run redoes the steps.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DISTRO="${ROS_DISTRO:-jazzy}"
REQUIREMENTS="requirements/$DISTRO.txt"
if [[ "$DISTRO" == jazzy ]]; then DEFAULT_VENV="$ROOT/.venv"; else DEFAULT_VENV="$ROOT/.venv-$DISTRO"; fi
VENV="${OXYGEN_VENV:-$DEFAULT_VENV}"
PYTHON="${PYTHON:-python3}"
BUILD_DIR="$ROOT/build/venv-msgs-$DISTRO"
STAMP="$VENV/.oxygen_setup_stamp"
DISTRO_MARK="$VENV/.oxygen_ros_distro"
PIP_VERSION="25.3"
TORCH_PIN="torch==2.13.0"

# A parent process started by another venv's Python exports this; our venv's Python must run
# its own ROS-wheels bootstrap (sets LD_LIBRARY_PATH for the wheels' libraries).
unset _ROS_WHEELS_BOOTSTRAP_COMPLETE

cd "$ROOT"

log() { printf 'setup_env: %s\n' "$*"; }

# A distribution's file pins its rclpy; requirements/robot.txt (the pip-only list for a robot with a
# system ROS) is not one.
if ! grep -qs '^ros-rclpy==' "$REQUIREMENTS"; then
  known="$(cd requirements && grep -l '^ros-rclpy==' -- *.txt | sed 's/\.txt$//' | paste -sd' ')"
  log "ERROR: ROS_DISTRO=$DISTRO: no $REQUIREMENTS pinning its ROS wheels; tested here: $known (Humble is written for" \
    "but not tested: build it in a colcon workspace against /opt/ros/humble)" >&2
  exit 2
fi

inputs_hash() {
  {
    printf '%s\n' "$VENV"
    "$PYTHON" -c 'import sys; print(sys.version)'
    printf '%s\n' "$DISTRO"
    cat requirements.txt requirements/robot.txt "$REQUIREMENTS" CMakeLists.txt package.xml setup.py setup.cfg scripts/setup_env.sh
    for f in msg/*.msg action/*.action; do printf '%s\n' "$f"; cat "$f"; done
  } | sha256sum | cut -d' ' -f1
}

HASH="$(inputs_hash)"
if [[ -x "$VENV/bin/python" && -f "$STAMP" && "$(cat "$STAMP")" == "$HASH" ]]; then
  log "up to date ($VENV, ROS 2 $DISTRO)"
  exit 0
fi

START=$SECONDS
rm -f "$STAMP"

# 0. a venv of another distribution is rebuilt, never mixed --------------------------------------
if [[ -e "$VENV" && "$(cat "$DISTRO_MARK" 2>/dev/null)" != "$DISTRO" ]]; then
  if [[ ! -f "$VENV/pyvenv.cfg" ]]; then
    log "ERROR: $VENV exists and is not a virtual environment; remove it or set OXYGEN_VENV" >&2
    exit 1
  fi
  log "$VENV holds ROS 2 '$(cat "$DISTRO_MARK" 2>/dev/null || echo unknown)', not $DISTRO: rebuilding it"
  rm -rf "$VENV"
fi

# 1. venv --------------------------------------------------------------------------------------
if [[ ! -x "$VENV/bin/python" ]]; then
  log "creating venv at $VENV with $("$PYTHON" -V 2>&1)"
  "$PYTHON" -m venv "$VENV"
fi
echo "$DISTRO" >"$DISTRO_MARK"
VPY="$VENV/bin/python"
mkdir -p "$ROOT/build"
PIP_LOG="$ROOT/build/setup_env-pip-$DISTRO.log"
: >"$PIP_LOG"
pip_install() {
  if ! "$VPY" -m pip install --disable-pip-version-check "$@" >>"$PIP_LOG" 2>&1; then
    grep -v "^WARNING: Location 'file:" "$PIP_LOG" | tail -n 30 >&2
    log "ERROR: pip install $* failed, full log: $PIP_LOG" >&2
    exit 1
  fi
}
if [[ "$("$VPY" -m pip --version | cut -d' ' -f2)" != "$PIP_VERSION" ]]; then
  log "pip==$PIP_VERSION"
  pip_install "pip==$PIP_VERSION"
fi

# 2.-3. packages -------------------------------------------------------------------------------
log "installing $TORCH_PIN"
pip_install "$TORCH_PIN"
log "installing $REQUIREMENTS (ROS 2 $DISTRO)"
pip_install -r "$REQUIREMENTS"

SITE="$("$VPY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
PY_INC="$("$VPY" -c 'import sysconfig; print(sysconfig.get_paths()["include"])')"
NP_INC="$("$VPY" -c 'import numpy; print(numpy.get_include())')"
if [[ ! -f "$PY_INC/Python.h" ]]; then
  log "ERROR: Python headers not found in $PY_INC (install the python3-dev package)" >&2
  exit 1
fi

# 4. fix include paths baked into the ROS wheels -------------------------------------------------
log "patching rosidl_generator_py include paths -> $PY_INC, $NP_INC"
mapfile -t EXPORTS < <(find "$VENV/share" -name '*__rosidl_generator_pyExport.cmake')
if ((${#EXPORTS[@]})); then
  sed -i -E \
    -e "s#/opt/python/cp[0-9]+-cp[0-9]+/lib/python3\.[0-9]+/site-packages/numpy/_core/include#${NP_INC}#g" \
    -e "s#/opt/python/cp[0-9]+-cp[0-9]+/include/python3\.[0-9]+#${PY_INC}#g" \
    "${EXPORTS[@]}"
  if grep -l '/opt/python/' "${EXPORTS[@]}" >/dev/null; then
    log "ERROR: unexpected /opt/python path left in:" >&2
    grep -l '/opt/python/' "${EXPORTS[@]}" >&2
    exit 1
  fi
fi

# 5. messages ----------------------------------------------------------------------------------
log "building msg/ and action/ (cmake, ~60 s)"
rm -rf "$BUILD_DIR"
GEN="Unix Makefiles"
if command -v ninja >/dev/null; then GEN="Ninja"; fi
BUILD_LOG="$BUILD_DIR.log"
if ! (
  # (set -e does not apply inside a subshell tested by `if`, hence the &&)
  export CMAKE_PREFIX_PATH="$VENV" AMENT_PREFIX_PATH="$VENV" &&
  cmake -S "$ROOT" -B "$BUILD_DIR" -G "$GEN" \
    -DCMAKE_INSTALL_PREFIX="$VENV" \
    -DPython3_EXECUTABLE="$VENV/bin/python3" \
    -DOXYGEN_ROS_INSTALL_PYTHON_PACKAGE=OFF \
    -DBUILD_TESTING=OFF \
    -DCMAKE_BUILD_TYPE=Release &&
  cmake --build "$BUILD_DIR" -j "$(nproc)" &&
  cmake --install "$BUILD_DIR"
) >"$BUILD_LOG" 2>&1; then
  tail -n 40 "$BUILD_LOG" >&2
  log "ERROR: message build failed, full log: $BUILD_LOG" >&2
  exit 1
fi

GEN_PKG="$SITE/oxygen_ros"
for generated in msg/_action_chunk.py action/_ask.py; do
  if [[ ! -f "$GEN_PKG/$generated" ]]; then
    log "ERROR: generated interface $generated not found in $GEN_PKG" >&2
    exit 1
  fi
done
# The generated package's empty __init__.py would shadow the source package (a regular package
# found first on sys.path wins), and its egg-info would make pip treat site-packages/oxygen_ros
# as an installed "oxygen_ros" distribution and delete it on the next install.
rm -f "$GEN_PKG/__init__.py" "$GEN_PKG"/__pycache__/__init__.*.pyc
rm -rf "$SITE"/oxygen_ros-*.egg-info

# 6. the package itself ------------------------------------------------------------------------
log "pip install -e . (no deps)"
pip_install --no-deps --no-build-isolation -e "$ROOT" --config-settings editable_mode=compat

# 7. check -------------------------------------------------------------------------------------
"$VPY" - "$ROOT" <<'PY'
import os
import sys

import oxygen_ros
from oxygen_ros.action import Ask
from oxygen_ros.msg import ActionChunk, Narration
from rclpy.type_support import check_for_type_support

root = os.path.realpath(sys.argv[1])
assert os.path.realpath(oxygen_ros.__path__[0]) == os.path.join(root, 'oxygen_ros'), oxygen_ros.__path__
for t in (ActionChunk, Narration, Ask):
    check_for_type_support(t)
PY

echo "$HASH" >"$STAMP"
log "done in $((SECONDS - START)) s ($VENV, ROS 2 $DISTRO)"
