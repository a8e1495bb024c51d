"""The public name of tiermem's error hierarchy (defined in ``tiermem.core.errors``): catch these."""

from tiermem.core.errors import *  # noqa: F403
from tiermem.core.errors import __all__  # noqa: F401  (the same public names)
