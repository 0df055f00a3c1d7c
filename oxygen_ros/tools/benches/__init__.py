"""``oxygen-bench``'s benches, one module each (``add_arguments``, ``run``), their shared
arguments and helpers (``common``) and the workloads they drive."""
