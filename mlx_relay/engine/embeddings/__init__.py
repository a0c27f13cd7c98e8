"""Embedding models (issue 47.1): loaded and run through mlx-embeddings, on the engine's thread."""
