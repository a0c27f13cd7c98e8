"""mlx-relay: an inference server for MLX vision-language models."""
