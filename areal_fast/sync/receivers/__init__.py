"""Per-engine receivers of bucketed weight updates."""
