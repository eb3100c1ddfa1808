"""Capture every log record inside another process (a Dask worker), at DEBUG, for the secrets
test: run ``start`` and later ``stop`` there with ``client.run`` (importable by workers)."""

from __future__ import annotations

import logging

LOGGERS = ("featstore", "s3fs", "fsspec", "botocore", "aiobotocore", "distributed", "zarr", "urllib3")


class Records(logging.Handler):
    """Keeps (logger name, text) of every record: the formatted message, or for a record that
    cannot be formatted (a bad ``%`` format, an argument whose ``__str__`` raises) its message
    and each argument's ``str`` and ``repr``, as far as they go: a record that fails to format
    may still carry a secret, and another handler (a file, a log shipper) may print it."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[tuple[str, str]] = []
        self.unformatted: list[str] = []  # the loggers of records kept unformatted

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = self.format(record)
        except Exception as exc:  # noqa: BLE001 - kept, unformatted, with what it carries
            self.unformatted.append(record.name)
            args = record.args if isinstance(record.args, tuple) else (record.args,)
            text = " ".join([_text(record.msg), *(_text(a) for a in args), _text(record.exc_info), repr(exc)])
        self.records.append((record.name, text))


def _text(value: object) -> str:
    """``str`` and ``repr`` of ``value``, each as far as it goes."""
    out = []
    for show in (str, repr):
        try:
            out.append(show(value))
        except Exception as exc:  # noqa: BLE001 - an argument that cannot show itself
            out.append(f"<{show.__name__} failed: {exc!r}>")
    return " ".join(out)


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
