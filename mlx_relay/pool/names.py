"""Which pooled model a request's name means (no MLX; the model pool's, `pool.py`): each model's
name, its checkpoint path and its aliases, "*" the catch-all; and models named at run time by
their checkpoint directory (`POST /v1/models/{name}/load` with a path).
"""

from __future__ import annotations

import logging
from pathlib import Path

import msgspec

from mlx_relay.config import ServerConfig
from mlx_relay.errors import InvalidModelPath, InvalidRequest, ModelNotFound
from mlx_relay.http.types import LoadModelBody
from mlx_relay.pool.build import over_budget, pooled_model
from mlx_relay.pool.config import PooledModel
from mlx_relay.pool.slot import ModelSlot

log = logging.getLogger(__name__)


class ModelNames:
    def __init__(self, slots: dict[str, ModelSlot], budget: int | None) -> None:
        self.slots = slots  # the pool's, by model name (a model added here gets its slot there)
        self.budget = budget  # the pool's memory budget (a model over it is refused)
        self.names: dict[str, str] = {}  # every name a request may use -> the model's name
        self.catch_all: str | None = None  # the model the alias "*" gives any other name

    def __contains__(self, name: str) -> bool:
        return name in self.names

    def add(self, model: PooledModel) -> None:
        """A slot for `model`; ValueError when one of its names is another's or it is over the budget."""
        names = [model.name, model.config.model, *model.config.model_aliases]
        taken = [n for n in names if n != "*" and self.names.get(n, model.name) != model.name]
        if taken or model.name in self.slots:
            raise ValueError(f"the model name '{(taken or [model.name])[0]}' is given to two models")
        if "*" in model.config.model_aliases:
            if self.catch_all is not None:
                raise ValueError(f"the alias '*' is given to two models ('{self.catch_all}', '{model.name}')")
            self.catch_all = model.name
        if (problem := over_budget(model, self.budget)) is not None:
            raise ValueError(problem)
        self.slots[model.name] = ModelSlot(model)
        self.names.update({n: model.name for n in names if n != "*"})

    def resolve(self, model: str | None) -> str:
        """The model `model` names (None: the first); ModelNotFound where none."""
        if model is None:
            return next(iter(self.slots))
        if (name := self.names.get(model)) is not None:
            return name
        if self.catch_all is not None:
            return self.catch_all
        raise ModelNotFound(f"the model '{model}' does not exist; this server serves {', '.join(self.slots)}",
                            model=model, param="model")

    def configured(self, name: str) -> str:
        """The model a load without a path names; ModelNotFound where none is configured."""
        if name not in self.names:
            raise ModelNotFound(f"the model '{name}' is not configured; this server serves "
                                f"{', '.join(self.slots)} (give a \"path\" to load another)", model=name)
        return self.names[name]

    def register(self, name: str, body: LoadModelBody, template: ServerConfig) -> str:
        """A model named at run time by its local checkpoint directory, served with the server's flags
        (`template`); the name it is served under."""
        path = Path(body.path or "").expanduser()
        if not path.is_dir() or not (path / "config.json").is_file() or not any(path.glob("*.safetensors")):
            raise InvalidModelPath(f"'{body.path}' is not a model checkpoint directory (config.json and "
                                   "*.safetensors)", param="path")
        path = path.resolve()
        if name in self.slots:
            if Path(self.slots[name].model.config.engine.model_path) != path:
                raise InvalidRequest(f"the model '{name}' is served from another path", param="path")
            return name
        if name in self.names:
            raise InvalidRequest(f"'{name}' already names the model '{self.names[name]}'", param="model")
        config = msgspec.structs.replace(
            template, model=str(path), served_model_name=name, model_aliases=tuple(body.aliases),
            engine=msgspec.structs.replace(template.engine, model_path=str(path)))
        try:
            self.add(pooled_model(config, pinned=body.pinned, idle_ttl_s=body.idle_ttl_s, budget=self.budget))
        except (ValueError, OSError, KeyError) as exc:
            raise InvalidModelPath(str(exc), param="path") from None
        log.info("model %s registered from %s", name, path)
        return name
