"""The decode lanes behind one interface (`lane.Lane`): the plain lane (our prefill and compiled decode
step), the MTP lane (speculative decoding with the checkpoint's MTP head) and the KV lane (a model
of no family of ours, through its library's forward), with the state and steps each runs (GPU thread
only). Imports nothing on its own (its modules are imported by name)."""
