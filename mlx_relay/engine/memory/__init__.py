"""What the engine holds on the device beside the lanes' rows (GPU thread only): prefix-cache
snapshots (by handle) and their file bytes, row operations on batch caches, image features (by
hash), and the CUDA driver's memory pool. Imports nothing on its own (its modules are imported by
name)."""
