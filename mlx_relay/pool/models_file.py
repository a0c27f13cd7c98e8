"""`--models-config FILE` and `--model NAME=PATH`: the models a pool serves, as written by the
operator, before they become `PooledModel`s (`build.py`). Every error names the file's line.

    [models.qwen-big]                  # the first model is the one a request without a model gets
    path = "/models/Qwen3.5-35B-A3B"   # a local checkpoint (relative: to this file) or a Hub repo id
    aliases = ["claude-sonnet-4-5"]    # other names requests may use ("*": any name no model has)
    pinned = true                      # loaded at start, never unloaded to make room or when idle
    idle_ttl_s = 600                   # unloaded after this long without a request
    max_num_seqs = 16                  # and any of the per-model settings of `ModelEntry`
    max_model_len = 32768
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Any

import msgspec

from mlx_relay.config import SpeculationMethod


class ModelsConfigError(ValueError):
    """A models file (or a --model flag) that cannot be served, with where it says so."""


class ModelEntry(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One `[models.NAME]` table: how the pool treats the model, and the settings it is served
    with where they differ from the server's flags."""

    path: str
    aliases: list[str] = []
    pinned: bool = False
    idle_ttl_s: float | None = None
    max_num_seqs: int | None = None
    max_model_len: int | None = None
    mtp: bool | None = None
    speculation: SpeculationMethod | None = None
    max_draft_tokens: int | None = None
    specprefill_draft_model: str | None = None
    prefix_cache: bool | None = None
    prefix_cache_gb: float | None = None
    tool_parser: str | None = None
    warmup: bool | None = None  # the kernel warm-up at each load (a swap's largest part on a GPU)
    embedding_model: str | None = None  # an embedding checkpoint beside it (/v1/embeddings)
    embedding_model_name: str | None = None
    kv_bits: int | None = None  # attention keys and values quantized (8 or 4)

    def overrides(self) -> dict[str, Any]:
        """The settings this entry gives, as `config.build_config` takes them."""
        taken = {name: getattr(self, name) for name in ("max_num_seqs", "max_model_len", "mtp", "speculation",
                                                        "max_draft_tokens", "specprefill_draft_model",
                                                        "prefix_cache", "tool_parser", "warmup",
                                                        "embedding_model", "embedding_model_name", "kv_bits")}
        if self.prefix_cache_gb is not None:
            taken["prefix_cache_bytes"] = int(self.prefix_cache_gb * (1 << 30))
        return {k: v for k, v in taken.items() if v is not None}


class NamedEntry(msgspec.Struct, frozen=True):
    name: str
    entry: ModelEntry
    where: str  # "FILE:LINE" or "--model NAME=PATH", for errors that come later (a setting out of range)
    path_where: str  # the same for its path (the line of `path =`): a path that is no model


def parse_model_flag(text: str) -> NamedEntry:
    """`--model NAME=PATH` (or `--model PATH`: named by the directory's name)."""
    name, sep, path = text.partition("=")
    if not sep:
        name, path = Path(text).name or text, text
    if not name or not path:
        raise ModelsConfigError(f"--model {text}: expected NAME=PATH")
    return NamedEntry(name, ModelEntry(path=path), f"--model {text}", f"--model {text}")


def read_models_file(file: Path) -> list[NamedEntry]:
    """The `[models.NAME]` tables of a TOML file, in order; a relative path is taken from the file's
    directory. `ModelsConfigError` naming the line for anything it cannot serve."""
    try:
        text = file.read_text()
    except OSError as exc:
        raise ModelsConfigError(f"{file}: cannot be read: {exc.strerror}") from None
    try:
        doc = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ModelsConfigError(f"{file}: not valid TOML: {exc}") from None
    unknown = [key for key in doc if key != "models"]
    if unknown:
        raise ModelsConfigError(f"{file}:{_line_of(text, None, unknown[0])}: unknown key '{unknown[0]}' (only "
                                "[models.NAME] tables)")
    tables = doc.get("models", {})
    if not isinstance(tables, dict) or not tables:
        raise ModelsConfigError(f"{file}: no models (write a [models.NAME] table per model, with its path)")
    entries = []
    for name, table in tables.items():
        where = f"{file}:{_line_of(text, name)}"
        if not isinstance(table, dict):
            raise ModelsConfigError(f"{where}: models.{name} must be a table ([models.{name}])")
        try:
            entry = msgspec.convert(table, ModelEntry)
        except msgspec.ValidationError as exc:
            key = _key_of(str(exc))
            line = _line_of(text, name, key) if key else _line_of(text, name)
            raise ModelsConfigError(f"{file}:{line}: models.{name}: {exc}") from None
        path = Path(entry.path).expanduser()
        if not path.is_absolute() and (file.parent / path).exists():
            entry = msgspec.structs.replace(entry, path=str((file.parent / path).resolve()))
        entries.append(NamedEntry(name, entry, where, f"{file}:{_line_of(text, name, 'path')}"))
    return entries


def _key_of(message: str) -> str | None:
    """The key a msgspec validation error is about: `$.key` or "unknown field `key`"."""
    if found := re.search(r"at `\$\.([A-Za-z0-9_]+)", message):
        return found.group(1)
    if found := re.search(r"field `([^`]+)`", message):
        return found.group(1)
    return None


def _line_of(text: str, table: str | None, key: str | None = None) -> int:
    """The 1-based line of `[models.TABLE]` (or of `key` inside it; table None: the top level)."""
    lines = text.splitlines()
    start = 0
    if table is not None:
        header = re.compile(rf"\s*\[\s*models\s*\.\s*(\"{re.escape(table)}\"|'{re.escape(table)}'|"
                            rf"{re.escape(table)})\s*\]")
        start = next((i for i, line in enumerate(lines) if header.match(line)), 0)
        if key is None:
            return start + 1
        start += 1
    for i in range(start, len(lines)):
        if table is not None and re.match(r"\s*\[", lines[i]):
            break
        if re.match(rf"\s*[\"']?{re.escape(key or '')}[\"']?\s*=", lines[i]):
            return i + 1
    return start + (0 if table is not None else 1)
