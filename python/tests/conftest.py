"""The tests import the package of this source tree (python/ringattn), installed or not, and use
a fresh random seed per run: RINGATTN_TEST_SEED replays one (failures print it)."""
import os
import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

SEED = int(os.environ.get("RINGATTN_TEST_SEED", random.SystemRandom().randrange(2**31)))


def pytest_report_header(config):
    return f"ringattn tests: seed {SEED} (RINGATTN_TEST_SEED={SEED} replays it)"


@pytest.fixture
def gen(request):
    """A torch generator seeded from the run's seed and the test's id."""
    import torch
    g = torch.Generator()
    g.manual_seed((SEED * 1000003 + hash_text(request.node.nodeid)) % 2**63)
    return g


def hash_text(text):
    # Python's hash() of a str changes per process; this one does not.
    h = 0
    for c in text.encode():
        h = (h * 131 + c) % 2**61
    return h
