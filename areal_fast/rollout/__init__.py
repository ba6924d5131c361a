"""Inference engines that generate trajectories."""
