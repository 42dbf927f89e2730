"""``python -m benchmarks.cross_entropy``: a thin entry point onto
``megakernels_models.bench.cross_entropy`` (flags: ``--help``).

The measurements live in the installed package so that ``megakernels bench`` runs them after ``pip install``.
"""

import sys

from megakernels_models.bench.cross_entropy import main

if __name__ == "__main__":
    sys.exit(main())
