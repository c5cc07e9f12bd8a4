"""Run a plan for real: stage construction (split), the per-rank loop (worker), torchrun launching
(launch), measurement (measure, report) and checkpoints. Entry point: `pipeplan run` (cli/run_cmd.py)."""
