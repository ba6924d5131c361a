"""Model loading and model-level patches (packed attention)."""
