"""The version every entry point reports: the installed ``sparsegate`` distribution's.

Read from the distribution's metadata (``importlib.metadata``), i.e. what the build that is
installed says (``pyproject.toml``'s ``version`` at build time), not a constant in the code.
"""

from __future__ import annotations

from importlib import metadata

DISTRIBUTION = "sparsegate"
UNKNOWN = "0+unknown"  # running from a source tree that is not installed


def installed_version(distribution: str = DISTRIBUTION) -> str:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return UNKNOWN


def version_line(program: str) -> str:
    """``<program> <version>``: what ``--version`` prints."""
    return f"{program} {installed_version()}"
