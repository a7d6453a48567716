"""ARStream: a realtime server for autoregressive video diffusion world models.

The distribution installs one import namespace: ``arstream.app`` (transport),
``arstream.runner`` (model-neutral AR runtime) and ``arstream.models``
(pipelines). The source folders stay at the top of the repository
(``app/``, ``runner/``, ``models/``, ``static/``); ``arstream/app`` and the
others are symlinks to them, so every tool finds ``arstream.app.x`` by path.
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("arstream")
except PackageNotFoundError:  # running from a checkout that was never installed
    __version__ = "0+unknown"
