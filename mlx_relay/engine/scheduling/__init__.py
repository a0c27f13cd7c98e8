"""What a step may run, as pure arithmetic shared by the engine step and the lanes (no MLX): the
step's token budget and how prefill shares it (`token_budget.py`). Imports nothing on its own (its
modules are imported by name)."""
