"""Watching a compute: progress events, run states, and the dashboard preload (public name
:mod:`featstore.dashboard`)."""

