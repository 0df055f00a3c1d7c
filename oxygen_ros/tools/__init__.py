"""Command-line entry points of oxygen_ros."""
