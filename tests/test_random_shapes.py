"""The random-weight shapes benchmarks run: each builds (on the meta device, no memory)
with the family the loader picks, at its published size."""
import pytest
import torch

from roseinfer.models.loader import check_shards, model_class
from roseinfer.models.random_shapes import RANDOM

# Parameters as the model cards state them, embeddings and heads included (billions).
PUBLISHED = {"llama3-8b-random": 8.03, "llama3-70b-random": 70.6,
             "qwen3-30b-a3b-random": 30.5, "mixtral-8x7b-random": 46.7,
             "deepseek-v2-lite-random": 15.7, "moonlight-16b-a3b-random": 16.0,
             "glm-4.5-air-random": 106.0, "granite-4.0-h-small-random": 32.2}


@pytest.mark.parametrize("name", sorted(RANDOM))
def test_each_random_shape_builds(name):
    check_shards(name)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_a_random_shape_has_its_published_size(name):
    cfg, _ = RANDOM[name]()
    with torch.device("meta"):
        model = model_class(cfg, None)(cfg)
    billions = sum(p.numel() for p in model.parameters()) / 1e9
    assert billions == pytest.approx(PUBLISHED[name], rel=0.015)
