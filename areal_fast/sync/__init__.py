"""Weight sync from trainers to inference engines."""
