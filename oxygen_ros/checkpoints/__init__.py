"""Checkpoint formats: openpi's layout and LeRobot folders, their common core, the one loader."""
