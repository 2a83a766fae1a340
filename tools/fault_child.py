"""Deprecated import path, kept for one release: this module moved to
``kvtier.tools.testing.fault_child`` (``python -m kvtier.tools.fault_child`` still runs it)."""

import sys

from kvtier.tools.testing.fault_child import *  # noqa: F401,F403
from kvtier.tools.testing.fault_child import __all__, main  # noqa: F401

if __name__ == "__main__":
    sys.exit(main())
