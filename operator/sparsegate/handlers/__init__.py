"""Kopf handlers; importing this package registers them. Each feature adds its module here."""

from sparsegate.handlers import gatebinding, sparsemodel  # noqa: F401
