"""``python -m benchmarks.e2e``: a thin entry point onto ``megakernels_models.bench.e2e`` (flags: ``--help``).

The measurements live in the installed package so that ``megakernels bench`` runs them after ``pip install``.
"""

import sys

from megakernels_models.bench.e2e import main

if __name__ == "__main__":
    sys.exit(main())
