"""Agent-side components (sessions, trajectory store)."""
