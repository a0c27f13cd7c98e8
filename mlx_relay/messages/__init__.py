"""The actors' messages, one module per actor (typed `msgspec.Struct`s; no MLX array ever
travels in one: prompts are token ids, pixels are bytes, device state is an integer handle)."""
