"""An example third-party kvweave plugin providing the ``norm-tiers`` router."""

from .router import NormTiersRouter

__all__ = ["NormTiersRouter"]
__version__ = "0.1.0"
