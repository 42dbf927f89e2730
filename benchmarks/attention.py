"""``python -m benchmarks.attention``: a thin entry point onto ``megakernels_models.bench.attention``
(flags: ``--help``).

The measurements live in the installed package so that ``megakernels bench`` runs them after ``pip install``.
"""

import sys

from megakernels_models.bench.attention import main

if __name__ == "__main__":
    sys.exit(main())
