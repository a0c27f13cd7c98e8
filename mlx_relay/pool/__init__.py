"""Several models in one server (`mlx-relay serve --model NAME=PATH ...`): each model a Relay of
its own (its actors, its engine in a process of its own), loaded on demand and unloaded under a
memory budget. `pool.py` is the pool the HTTP app serves, `views.py` what it shows of its models;
`config.py` its typed configuration, `models_file.py` and `build.py` how it is read and built,
`reservation.py` what a model reserves and which models make room, `slot.py` one model's state,
`metrics.py` its series. Imports nothing here."""
