"""Code that runs inside the worker processes: the rollout worker (its groups, weights and
reward pool), the trainer worker, and the cores they share on one node."""
