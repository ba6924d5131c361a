"""Trainer engines that update the policy."""
