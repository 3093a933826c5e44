"""structlog: JSON lines on stdout for the journal, readable lines in a terminal."""

from __future__ import annotations

import logging
import sys

import structlog

from supervisor.redact import redact_obj


def _redact(logger: object, method: str, event: dict) -> dict:
    return redact_obj(event)


def configure(level: str = "info", json: bool | None = None) -> None:
    if json is None:
        json = not sys.stdout.isatty()
    renderer = structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer(colors=False)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            _redact,  # the journal is read by more people than root: no keys or tokens in it
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level.upper(), logging.INFO)),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stdout),
        cache_logger_on_first_use=False,
    )
    # libraries that use stdlib logging (apscheduler, botocore) go through the same stream
    logging.basicConfig(level=logging.WARNING, stream=sys.stdout, format="%(name)s %(levelname)s %(message)s")
