"""Fault tolerance: atomic checkpoints, the progress watchdog, emergency checkpoints, resume."""
