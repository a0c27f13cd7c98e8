"""SpecPrefill: which prompt tokens a long prompt's prefill keeps (pure Python, no MLX)."""
