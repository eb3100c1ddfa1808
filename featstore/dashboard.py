"""The Dask scheduler preload, by its public name: ``dask scheduler --preload featstore.dashboard``.

Dask imports this module and calls :func:`dask_setup`; the page, its plugin and the ``/metrics``
collector live in :mod:`featstore.monitor`.
"""

from featstore.monitor import FeatstorePlugin, dask_setup, featstore_doc, install, plugin_of, runs_html

__all__ = ["FeatstorePlugin", "dask_setup", "featstore_doc", "install", "plugin_of", "runs_html"]
