"""The decode lanes behind one interface (`lane.Lane`): the plain lane (our prefill and compiled
decode step), the MTP lane (speculative decoding with the checkpoint's MTP head) and the library
lane (mlx-vlm's `BatchGenerator`), with the state and steps each runs (GPU thread only). Imports
nothing on its own (its modules are imported by name)."""
