"""``python -m sparsegate.kubectl_plugin`` = ``kubectl-sparsegate``."""

import sys

from sparsegate.kubectl_plugin import main

sys.exit(main())
