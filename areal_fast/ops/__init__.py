"""Fast paths with torch fallbacks: log-probs, packing, segmented sums."""
