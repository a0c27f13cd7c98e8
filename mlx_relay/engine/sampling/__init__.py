"""How a row's next token is chosen (GPU thread): its logits processors (`processors.py`: logprobs,
penalties, grammars, thinking budgets) and its own sampler (`row_sampler.py`), shared by the engine
step (which builds each row's chain) and the lanes (which apply it). Imports nothing on its own
(its modules are imported by name)."""
