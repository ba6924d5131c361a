"""Slurm: ``areal-fast submit`` runs an experiment config as a batch job (config, batch
script, submission and status)."""
