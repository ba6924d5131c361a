"""RL math: advantages, loss configuration, GRPO-family objectives, packed batches."""
