"""Deprecated import path, kept for one release: this module moved to ``kvtier.tools.testing.faults``
(test support lives in one package, ``kvtier.tools.testing``, like ``trio.testing``)."""

from kvtier.tools.testing.faults import *  # noqa: F401,F403
from kvtier.tools.testing.faults import __all__  # noqa: F401
