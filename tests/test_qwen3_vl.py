"""Qwen3-VL (models/qwen3_vl.py) against transformers' own model on a tiny random config:
greedy ids equal with one image, with two of different sizes and with text only, loaded
from the model and from a saved checkpoint directory; DeepStack's features change the
output (so the equality checks them); the interleaved M-RoPE components are
transformers'."""
import pytest
import torch

from roseinfer import LLM, SamplingParams
from roseinfer.layers.rotary import interleaved
from tests.conftest import DEVICE
from tests.vision_models import picture, reference

IMAGE, START, END = 300, 301, 302
GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
ONE = [5, 6, 7, START, IMAGE, END, 8, 9, 10, 11]
TWO = [5, START, IMAGE, END, 11, 12, START, IMAGE, END, 13]


@pytest.fixture(scope="module")
def hf():
    """Three decoder layers (4 heads of 16, M-RoPE sections 2/3/3, interleaved), a
    three-block tower of 16-pixel patches whose first two blocks feed DeepStack."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    torch.manual_seed(0)
    config = Qwen3VLConfig(
        text_config=dict(vocab_size=512, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=16, rope_parameters={
                             "rope_type": "default", "mrope_section": [2, 3, 3],
                             "mrope_interleaved": True, "rope_theta": 10000.0},
                         max_position_embeddings=1024, initializer_range=0.1),
        vision_config=dict(depth=3, hidden_size=32, intermediate_size=64, num_heads=2,
                           out_hidden_size=64, patch_size=16, spatial_merge_size=2,
                           temporal_patch_size=2, num_position_embeddings=16,
                           deepstack_visual_indexes=[0, 1], initializer_range=0.1),
        image_token_id=IMAGE, vision_start_token_id=START, vision_end_token_id=END,
        tie_word_embeddings=False)
    return Qwen3VLForConditionalGeneration(config).eval()


def run(llm, prompts):
    outs = llm.generate([{"prompt_token_ids": ids, "multi_modal_data": {"image": images}}
                         if images else ids for ids, images in prompts], GREEDY)
    return [(o.prompt_token_ids, o.token_ids) for o in outs]


def test_greedy_equals_transformers_from_the_model_and_a_checkpoint(hf, tmp_path):
    a, b, c = picture(64, 96, 0), picture(64, 64, 1), picture(96, 128, 2)
    prompts = [(ONE, [a]), (TWO, [b, c]), ([5, 6, 7, 8, 9], None)]
    hf.save_pretrained(tmp_path)
    for source in (hf, str(tmp_path)):
        with LLM(source, device=DEVICE, dtype="float32", block_size=4,
                 num_kv_blocks=256) as llm:
            (one, out1), (two, out2), (text, out3) = run(llm, prompts)
            model = llm.engine.model
            assert len(one) == len(ONE) - 1 + 6 and len(two) == len(TWO) - 2 + 4 + 12
            assert out1 == reference(hf, model, one, [a])
            assert out2 == reference(hf, model, two, [b, c])
            assert out3 == reference(hf, model, text, None)


def test_deepstack_changes_the_output(hf):
    """Without DeepStack's additions the same prompt decodes otherwise: the equality above
    holds only with them."""
    image = picture(64, 96, 3)
    with LLM(hf, device=DEVICE, dtype="float32", block_size=4, num_kv_blocks=256,
             enable_prefix_cache=False) as llm:
        ((ids, with_deepstack),) = run(llm, [(ONE, [image])])
        assert with_deepstack == reference(hf, llm.engine.model, ids, [image])
        llm.engine.model.deepstack = 0
        ((_, without),) = run(llm, [(ONE, [image])])
    assert without != with_deepstack


def test_interleaved_components_are_transformers(hf):
    """Each frequency turned by the component transformers' rotary gives it."""
    rotary = hf.model.language_model.rotary_emb
    freq = torch.arange(3)[:, None, None, None].expand(3, 1, 1, 8).float()  # [3, B, N, F]
    theirs = rotary.recomposition_frequencies(freq.clone())[0, 0, :8]
    assert theirs.long().tolist() == interleaved(rotary.mrope_section)
