"""``python -m benchmarks.adamw``: a thin entry point onto ``megakernels_models.bench.adamw`` (flags: ``--help``).

The measurements live in the installed package so that ``megakernels bench`` runs them after ``pip install``.
"""

import sys

from megakernels_models.bench.adamw import main

if __name__ == "__main__":
    sys.exit(main())
