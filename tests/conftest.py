import os

import torch

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


@pytest.fixture(scope="session")
def gpt2_model():
    return tiny_gpt2()


@pytest.fixture(scope="session")
def llama_model():
    return tiny_llama()
