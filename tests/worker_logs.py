"""Capture every log record inside another process (a Dask worker), at DEBUG, for the secrets
test: run ``start`` and later ``stop`` there with ``client.run`` (importable by workers)."""

from __future__ import annotations

import logging

LOGGERS = ("featstore", "s3fs", "fsspec", "botocore", "aiobotocore", "distributed", "zarr", "urllib3")


class Records(logging.Handler):
    """Keeps (logger name, formatted message) of every record."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[tuple[str, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        try:
            self.records.append((record.name, self.format(record)))
        except Exception:  # noqa: BLE001 - a record that cannot format is not a leak
            pass


_state: dict = {}


def start() -> int:
    """Attach a DEBUG handler to the root logger and open every library logger up to it."""
    handler = Records()
    root = logging.getLogger()
    _state["root"] = root.level
    _state["loggers"] = {}
    root.setLevel(logging.DEBUG)
    root.addHandler(handler)
    for name in LOGGERS:
        lg = logging.getLogger(name)
        _state["loggers"][name] = (lg.level, lg.propagate, lg.disabled)
        lg.setLevel(logging.DEBUG)
        lg.propagate, lg.disabled = True, False
    _state["handler"] = handler
    return len(handler.records)


def stop() -> list[tuple[str, str]]:
    """Detach the handler, restore the loggers, return the records."""
    handler = _state.pop("handler", None)
    if handler is None:
        return []
    root = logging.getLogger()
    root.removeHandler(handler)
    root.setLevel(_state["root"])
    for name, (level, prop, dis) in _state["loggers"].items():
        lg = logging.getLogger(name)
        lg.setLevel(level)
        lg.propagate, lg.disabled = prop, dis
    return handler.records
