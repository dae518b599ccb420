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


def seeded_generator(seed, nodeid):
    """A torch generator of `seed` and a test's id: the same numbers in every process."""
    import torch
    g = torch.Generator()
    g.manual_seed((seed * 1000003 + hash_text(nodeid)) % 2**63)
    return g


def cuda_devices():
    """The CUDA GPUs a CUDA-built library sees; 0 without torch CUDA or a CUDA build."""
    import torch
    import ringattn
    if not torch.cuda.is_available():
        return 0
    try:
        return ringattn.library().cuda_device_count()
    except ringattn.RingattnError:
        return 0


@pytest.fixture
def gen(request):
    """A torch generator seeded from the run's seed and the test's id."""
    return seeded_generator(SEED, request.node.nodeid)


def hash_text(text):
    # Python's hash() of a str changes per process; this one does not.
    h = 0
    for c in text.encode():
        h = (h * 131 + c) % 2**61
    return h
