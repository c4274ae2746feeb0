"""Model-side helpers: loading, value heads, per-token log-probs (fused where possible)."""
