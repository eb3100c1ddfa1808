"""The ``featstore`` command line (``featstore --help``)."""

from featstore.cli._main import exit_code, main

__all__ = ["exit_code", "main"]
