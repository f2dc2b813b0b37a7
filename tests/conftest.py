import os
import shutil
import tempfile

import torch

# The suite's own cache (converted models, CPU kernel timings, compiled steps), made by the
# process that starts the run and shared with the processes it starts: never the user's
# ~/.cache/roseinfer, whose timings and builds from earlier runs would give a test another
# engine than a fresh machine's. Set before roseinfer is imported (loader.CACHE_DIR).
_OWN_CACHE = "ROSEINFER_TEST_CACHE" not in os.environ
if _OWN_CACHE:
    os.environ["ROSEINFER_TEST_CACHE"] = tempfile.mkdtemp(prefix="roseinfer-tests-")
os.environ["ROSEINFER_CACHE"] = os.environ["ROSEINFER_TEST_CACHE"]

# Triton kernels run interpreted on machines without a GPU; this must be set
# before any kernel module is imported.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# An engine on the CPU starts building its compiled step in the background where none is
# built (core/cpu_step.py): the suite's engines must not, but the tests of it.
os.environ.setdefault("ROSEINFER_BACKGROUND_BUILDS", "0")

import pytest  # noqa: E402

from tests.models import tiny_gpt2, tiny_llama  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def pytest_unconfigure(config):
    if _OWN_CACHE:
        shutil.rmtree(os.environ["ROSEINFER_TEST_CACHE"], ignore_errors=True)


@pytest.fixture(scope="session")
def gpt2_model():
    return tiny_gpt2()


@pytest.fixture(scope="session")
def llama_model():
    return tiny_llama()
