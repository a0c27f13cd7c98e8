"""How the process's log lines look (`--log-format text|json`), set once by the CLI on the root
logger so that every line shares it: the request log's (`http/request_log.py`), uvicorn's (the
server leaves uvicorn's loggers to propagate here) and every module's.

A record may carry structured fields (`logging`'s `extra={"fields": {...}}`): the text format
appends them as `key=value` (a value with spaces, quotes or `=` JSON-quoted, None as `-`), so a
line stays one line whatever the values hold; the json format writes one JSON object per line,
the fields beside `time`, `level`, `logger` and `message`. With a name (`--log-name`; the cluster
names its replicas `replica-1`, `replica-2`, ...) every line carries it: first on a text line, as
`server` in a JSON one, so that the lines of processes sharing one stream can be told apart.
"""

from __future__ import annotations

import json
import logging
from datetime import UTC, datetime
from typing import Any, Literal

LogFormat = Literal["text", "json"]
TEXT = "%(levelname)s %(name)s: %(message)s"


def fields_of(record: logging.LogRecord) -> dict[str, Any]:
    fields = getattr(record, "fields", None)
    return fields if isinstance(fields, dict) else {}


class TextFormatter(logging.Formatter):
    def __init__(self, name: str | None = None) -> None:
        super().__init__(TEXT if name is None else f"{name} {TEXT}")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        fields = fields_of(record)
        if not fields:
            return line
        return line + " " + " ".join(f"{key}={_text_value(value)}" for key, value in fields.items())


class JsonFormatter(logging.Formatter):
    def __init__(self, name: str | None = None) -> None:
        super().__init__()
        self.name = name

    def format(self, record: logging.LogRecord) -> str:
        obj: dict[str, Any] = {
            **({"server": self.name} if self.name is not None else {}),
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            **fields_of(record),
        }
        if record.exc_info:
            obj["exception"] = self.formatException(record.exc_info)
        return json.dumps(obj, ensure_ascii=False, default=str)


def formatter(fmt: LogFormat, name: str | None = None) -> logging.Formatter:
    return JsonFormatter(name) if fmt == "json" else TextFormatter(name)


def configure_logging(level: str, fmt: LogFormat, name: str | None = None) -> None:
    """The root logger: `level`, one handler on stderr in format `fmt`, each line carrying `name`."""
    handler = logging.StreamHandler()
    handler.setFormatter(formatter(fmt, name))
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)


def _text_value(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return str(value)
    text = value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, separators=(",", ":"),
                                                           default=str)
    if text and text.isprintable() and not any(c in text for c in ' "=') and text != "-":
        return text
    return json.dumps(text, ensure_ascii=False)
