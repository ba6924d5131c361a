"""The driver process: the async loop, the rollout-group ledger, staleness, acceptance,
recovery, evaluations during training, step records, checkpoints and metrics."""
