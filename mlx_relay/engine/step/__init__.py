"""The engine step (GPU thread): `core.EngineCore` runs schedule -> execute -> update; the scheduler,
decode priority (`interleave.py`), the rows, the output stage (detokenizing, stops, endings) and
each row's logits-processor chain (`logits.py`; the processors and sampler in `engine/sampling/`,
the token budget in `engine/scheduling/`, which the lanes share). It drives the lanes; the lanes
import nothing of it. Imports nothing on its own (its modules are imported by name)."""
