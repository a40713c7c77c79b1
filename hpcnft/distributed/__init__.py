"""Processes: launcher detection, process groups and local spawning, the reward service, preemption."""
