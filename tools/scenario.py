"""Deprecated import path, kept for one release: this module moved to ``kvtier.tools.testing.scenario``
(test support lives in one package, ``kvtier.tools.testing``, like ``trio.testing``)."""

from kvtier.tools.testing.scenario import *  # noqa: F401,F403
from kvtier.tools.testing.scenario import __all__  # noqa: F401
