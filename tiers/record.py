"""Deprecated import path, kept for one release: the on-disk chunk record format moved to
``kvtier.tiers.record_format`` (so that its name says what it is, next to the engine's bookkeeping
records in ``kvtier.engine``)."""

from kvtier.tiers.record_format import *  # noqa: F401,F403
from kvtier.tiers.record_format import __all__  # noqa: F401
