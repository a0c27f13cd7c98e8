"""Speculation's host side: where drafts come from besides the MTP head, and what each source
earns per request (no MLX: the MTP lane calls these on the GPU thread between rounds)."""
