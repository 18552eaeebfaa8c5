"""Former home of the gate document; it is defined once in ``sparsegate_contracts.gate``.

This name stays importable for code written against it: it IS that module (the same object in
``sys.modules``), not a copy. New code imports ``sparsegate_contracts.gate``.
"""

import sys

from sparsegate_contracts import gate

sys.modules[__name__] = gate
