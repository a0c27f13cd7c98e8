"""The engine step (GPU thread): `core.EngineCore` runs schedule -> execute -> update; the scheduler,
the step's token budget, the rows, the output stage (detokenizing, stops, endings) and each row's
logits-processor chain and sampler. Imports nothing on its own (its modules are imported by name)."""
