"""Kopf handlers; importing this package registers them. Each feature adds its module here."""

from sparsegate.handlers import fleetindex  # noqa: F401
from sparsegate.handlers import gatebinding, sparsemodel  # noqa: F401
from sparsegate.handlers import routingpolicy  # noqa: F401
from sparsegate.handlers import gateconfig  # noqa: F401
from sparsegate.handlers import rollout_metrics  # noqa: F401
from sparsegate.handlers import telemetryprobe  # noqa: F401
from sparsegate.handlers import accesssync  # noqa: F401
from sparsegate.handlers import defaultgate  # noqa: F401
from sparsegate.handlers import diffbase  # noqa: F401
