"""transformers (and accelerate) are the ``test`` extra's; without them these tests are skipped, never faked."""

import pytest

pytest.importorskip("transformers")
