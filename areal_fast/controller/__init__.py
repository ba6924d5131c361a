"""The RL loop: rollout, training, weight updates, metrics."""
