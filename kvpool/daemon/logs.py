"""The daemon's log lines on stderr: `kvpool serve: message` (text, the default) or one JSON object a line.

Every line of the daemon's own (the `kvpool` loggers) goes through one handler installed by `configure`.
A JSON line holds `time` (RFC 3339, UTC, milliseconds), `level`, `message`, `logger`, `pid`, any fields a
call passed with `extra=`, and `traceback` when it logged an exception; a message is never split over lines.
"""

from __future__ import annotations

import datetime
import json
import logging
import sys
from typing import TextIO

LOG_FORMATS = ("text", "json")
PREFIX = "kvpool serve: "
ROOT_LOGGER = "kvpool"

# LogRecord attributes that are the record's own, not fields a call passed with extra=
_RECORD_ATTRIBUTES = frozenset(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime", "taskName"}


def bare(message: str) -> str:
    """The message without the program's prefix (some call sites still write it themselves)."""
    return message.removeprefix(PREFIX)


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        text = PREFIX + bare(record.getMessage())
        if record.exc_info:
            text += "\n" + self.formatException(record.exc_info)
        return text


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, object] = {
            "time": datetime.datetime.fromtimestamp(record.created, datetime.timezone.utc).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "message": bare(record.getMessage()),
            "logger": record.name,
            "pid": record.process,
        }
        line.update({key: value for key, value in vars(record).items() if key not in _RECORD_ATTRIBUTES and key not in line})
        if record.exc_info:
            line["traceback"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str, ensure_ascii=False)


def configure(log_format: str, *, stream: TextIO | None = None) -> logging.Logger:
    """Route the `kvpool` loggers (INFO and above) to `stream` (stderr) in `log_format`; idempotent: a
    second call replaces the first's handler."""
    if log_format not in LOG_FORMATS:
        raise ValueError(f"--log-format must be one of {', '.join(LOG_FORMATS)}")
    logger = logging.getLogger(ROOT_LOGGER)
    for handler in list(logger.handlers):
        if getattr(handler, "kvpool_log", False):
            logger.removeHandler(handler)
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.kvpool_log = True  # type: ignore[attr-defined]
    handler.setFormatter(JsonFormatter() if log_format == "json" else TextFormatter())
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False
    return logger
