"""Configuration and launchers."""
