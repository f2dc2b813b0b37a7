"""The mixture-of-experts layer (layers/moe.py) against transformers' own Qwen3-MoE block
(its router and its experts, float32), the router on near-ties, the block alignment's
invariants, and, on CUDA, the fused kernel in bf16 against a float64 loop over experts at
a real shape."""
import random

import pytest
import torch
from transformers.models.qwen3_moe.configuration_qwen3_moe import Qwen3MoeConfig
from transformers.models.qwen3_moe.modeling_qwen3_moe import (Qwen3MoeSparseMoeBlock,
                                                              Qwen3MoeTopKRouter)

from roseinfer.layers.moe import align_blocks, fused_experts
from roseinfer.layers.moe_routing import route, select_experts

from tests.conftest import DEVICE


def block(renormalize: bool, experts: int = 8, top_k: int = 2) -> Qwen3MoeSparseMoeBlock:
    cfg = Qwen3MoeConfig(hidden_size=64, moe_intermediate_size=32, num_experts=experts,
                         num_experts_per_tok=top_k, norm_topk_prob=renormalize)
    torch.manual_seed(0)
    moe = Qwen3MoeSparseMoeBlock(cfg)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.2)
    return moe


@pytest.mark.parametrize("tokens", [1, 2, 7, 64])
@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("use_triton", [True, False], ids=["triton", "torch"])
def test_the_layer_equals_transformers_qwen3_moe_block(tokens, renormalize, use_triton):
    moe = block(renormalize).to(DEVICE)
    x = torch.randn(tokens, 64, generator=torch.Generator().manual_seed(tokens)).to(DEVICE)
    with torch.no_grad():
        want = moe(x[None])[0]
        weights, ids = select_experts(x @ moe.gate.weight.T, 2, renormalize)
        got = fused_experts(x, moe.experts.gate_up_proj, moe.experts.down_proj, weights, ids,
                            use_triton=use_triton)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_the_router_picks_transformers_experts_on_near_ties():
    """Logits a float32 ulp apart, and exact ties: the same experts, in the same order."""
    experts, top_k = 8, 3
    cfg = Qwen3MoeConfig(hidden_size=experts, num_experts=experts, num_experts_per_tok=top_k,
                         norm_topk_prob=True)
    router = Qwen3MoeTopKRouter(cfg)
    with torch.no_grad():
        router.weight.copy_(torch.eye(experts))  # the hidden rows are the logits
        base = torch.tensor([1.0, 2.0, 2.0, 0.5, 2.0, -1.0, 0.0, 1.0])
        logits = torch.stack([base, base + torch.arange(8) * 1e-7,
                              torch.nextafter(base, base + 1), torch.zeros(8)])
        _, want_weights, want_ids = router(logits)
    weights, ids = select_experts(logits, top_k, renormalize=True, use_triton=False)
    assert ids.tolist() == want_ids.tolist()
    torch.testing.assert_close(weights, want_weights)


@pytest.mark.parametrize("tokens, experts, top_k", [(1, 8, 2), (33, 128, 8), (5, 60, 4)])
@pytest.mark.parametrize("renormalize", [True, False])
def test_the_routing_kernel_equals_torch(tokens, experts, top_k, renormalize):
    """float32 logits, with no ties: the same experts in the same order, the same weights."""
    logits = torch.randn(tokens, experts, generator=torch.Generator().manual_seed(tokens))
    want = select_experts(logits.to(DEVICE), top_k, renormalize, use_triton=False)
    got = select_experts(logits.to(DEVICE), top_k, renormalize, use_triton=True)
    assert got[1].tolist() == want[1].tolist()
    torch.testing.assert_close(got[0], want[0], rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("tokens", [1, 5, 16, 17])
@pytest.mark.parametrize("hidden, experts, bias", [(64, 8, False), (200, 60, True),
                                                   (128, 160, False)],
                         ids=["qwen3", "bias-odd-hidden", "two-expert-blocks"])
def test_route_splits_the_router_and_equals_the_unfused_one(tokens, hidden, experts, bias):
    """The router's GEMV split over hidden slices, its partials summed (with the bias) by
    the routing kernel, against the linear then the routing: the same experts and weights.
    17 tokens take the unfused way."""
    gen = torch.Generator().manual_seed(tokens + experts)
    gate = torch.nn.Linear(hidden, experts, bias=bias)
    with torch.no_grad():
        for p in gate.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    gate = gate.to(DEVICE)
    x = torch.randn(tokens, hidden, generator=gen).to(DEVICE)
    with torch.no_grad():
        want = select_experts(gate(x), 4, True, use_triton=False)
        got = route(x, gate, 4, True, use_triton=True)
    assert got[1].tolist() == want[1].tolist()
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)


def test_the_routing_kernel_breaks_ties_toward_the_lower_expert():
    """torch.topk's order among equal values is its own (on the CPU it took experts 6, 5
    and 4 of eight equal logits); the kernel's is the lower expert first."""
    logits = torch.tensor([[1.0, 2.0, 2.0, 0.5, 2.0, -1.0, 0.0, 1.0], [0.0] * 8])
    weights, ids = select_experts(logits.to(DEVICE), 3, renormalize=True, use_triton=True)
    assert ids.tolist() == [[1, 2, 4], [0, 1, 2]]
    torch.testing.assert_close(weights.cpu(), torch.full((2, 3), 1 / 3))


ALIGNMENTS = [(1, 8, 2, 16), (37, 8, 2, 16), (300, 16, 4, 64), (64, 128, 8, 16),
              (3, 60, 4, 16), (64, 512, 10, 16)]  # the last: Qwen3-Next's 512 experts


@pytest.mark.parametrize("tokens, experts, top_k, block_m", ALIGNMENTS)
def test_each_tile_holds_one_experts_pairs_and_every_pair_once(tokens, experts, top_k,
                                                               block_m):
    ids = torch.randint(0, experts, (tokens, top_k), generator=torch.Generator().manual_seed(1))
    sorted_ids, tile_expert, total = align_blocks(ids, experts, block_m, use_triton=False)
    pairs = ids.numel()
    real = sorted_ids[sorted_ids < pairs]
    assert sorted(real.tolist()) == list(range(pairs))
    assert int(total) % block_m == 0 and int(total) >= pairs
    flat = ids.flatten()
    for t, expert in enumerate(tile_expert.tolist()):
        tile = sorted_ids[t * block_m:(t + 1) * block_m]
        tile = tile[tile < pairs]
        if t * block_m >= int(total):
            assert expert == -1 and tile.numel() == 0
        else:
            assert (flat[tile.long()] == expert).all()


@pytest.mark.parametrize("tokens, experts, top_k, block_m", ALIGNMENTS)
def test_the_one_program_alignment_equals_torchs(tokens, experts, top_k, block_m):
    """Same rows, same tiles, same total: pairs of one expert keep their order."""
    ids = torch.randint(0, experts, (tokens, top_k), generator=torch.Generator().manual_seed(2),
                        dtype=torch.int32).to(DEVICE)
    want = align_blocks(ids, experts, block_m, use_triton=False)
    got = align_blocks(ids, experts, block_m, use_triton=True)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and g.tolist() == w.tolist()


@pytest.mark.parametrize("seed", range(8))
def test_the_one_program_alignment_equals_torchs_on_random_shapes(seed):
    """Five random shapes a seed (experts not a power of two among them, and pairs of
    another rank's experts, -1, under expert parallelism): same rows, tiles and total."""
    rng = random.Random(seed)
    for case in range(5):
        experts = rng.choice([2, 8, 60, 128, 257, 512])
        top_k, tokens = rng.choice([1, 2, 8, 10]), rng.choice([1, 3, 16, 33, 100])
        ids = torch.randint(-1 if case % 2 else 0, experts, (tokens, top_k),
                            generator=torch.Generator().manual_seed(seed * 5 + case),
                            dtype=torch.int32).to(DEVICE)
        block_m = rng.choice([16, 32, 64])
        want = align_blocks(ids, experts, block_m, use_triton=False)
        got = align_blocks(ids, experts, block_m, use_triton=True)
        for g, w in zip(got, want):
            assert g.tolist() == w.tolist(), (experts, top_k, tokens, block_m)


@pytest.mark.skipif(DEVICE != "cuda", reason="the compiled kernel needs CUDA")
@pytest.mark.parametrize("tokens", [1, 7, 64, 512])
@pytest.mark.parametrize("experts, top_k, renormalize", [(128, 8, True), (8, 2, True),
                                                         (60, 4, False)],
                         ids=["qwen3-moe", "mixtral", "qwen2-moe"])
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_the_kernel_equals_a_float64_loop_at_real_shapes(tokens, experts, top_k, renormalize,
                                                         fp8):
    """Qwen3-30B-A3B's expert shape (hidden 2048, 768 per expert) in bf16, and with FP8
    weights scaled per row (against the float64 loop on their de-quantized values)."""
    hidden, inter = 2048, 768
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    x = torch.randn(tokens, hidden, device="cuda", generator=gen).bfloat16()
    w13 = (torch.randn(experts, 2 * inter, hidden, device="cuda", generator=gen) * 0.02).bfloat16()
    w2 = (torch.randn(experts, hidden, inter, device="cuda", generator=gen) * 0.02).bfloat16()
    logits = torch.randn(tokens, experts, device="cuda", generator=gen)
    weights, ids = select_experts(logits, top_k, renormalize)
    scales = None
    if fp8:
        (w13, s13), (w2, s2) = (to_fp8_rows(w) for w in (w13, w2))
        scales = (s13, s2)
    got = fused_experts(x, w13, w2, weights, ids, scales=scales)
    if fp8:
        w13, w2 = (w.double() * s[..., None].double() for w, s in zip((w13, w2), scales))
    want = fused_experts(x.double(), w13.double(), w2.double(), weights.double(), ids,
                         use_triton=False)
    # bf16 rounds the gate_up output and the activation, which the float64 loop does not
    torch.testing.assert_close(got.double(), want, rtol=2e-2, atol=5e-3)


def to_fp8_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 values, float32 scale per row) of ``w``, as SparseMoE.to_fp8 keeps them."""
    scale = w.float().abs().amax(-1) / 448
    return (w.float() / scale[..., None]).to(torch.float8_e4m3fn), scale


@pytest.mark.parametrize("tokens", [1, 9])
def test_fp8_experts_through_the_kernel_equal_their_values_through_torch(tokens):
    """The kernel de-quantizes FP8 tiles (each row times its scale) as the torch path
    de-quantizes whole experts."""
    moe = block(True)
    w13, w2 = moe.experts.gate_up_proj.detach(), moe.experts.down_proj.detach()
    (q13, s13), (q2, s2) = to_fp8_rows(w13), to_fp8_rows(w2)
    x = torch.randn(tokens, 64, generator=torch.Generator().manual_seed(tokens))
    weights, ids = select_experts(x @ moe.gate.weight.detach().T, 2, True)
    args = [t.to(DEVICE) for t in (x, q13, q2, weights, ids)]
    scales = (s13.to(DEVICE), s2.to(DEVICE))
    got = fused_experts(*args, use_triton=True, scales=scales)
    want = fused_experts(*args, use_triton=False, scales=scales)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tokens", [1, 9])
def test_gpt_oss_experts_through_the_kernel_equal_transformers(tokens):
    """Biases on gate_up and down, the clamped SwiGLU, gate and up columns interleaved in
    transformers' [E, H, 2I] (models/moe.py unpacks them): the kernel's output equals
    transformers' GptOssExperts'."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    from roseinfer.models.moe import _gpt_oss_experts, gpt_oss_glu

    cfg = GptOssConfig(hidden_size=64, intermediate_size=32, num_local_experts=8)
    torch.manual_seed(0)
    experts = GptOssExperts(cfg)
    for p in experts.parameters():
        torch.nn.init.normal_(p, std=0.5)  # large enough that the clamp at 7 bites
    mine = {}
    for name in ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias"):
        mine.update(_gpt_oss_experts("", f"experts.{name}", getattr(experts, name).detach()))
    x = torch.randn(tokens, 64, generator=torch.Generator().manual_seed(tokens))
    logits = torch.randn(tokens, 8, generator=torch.Generator().manual_seed(1))
    weights, ids = select_experts(logits, 2, renormalize=True)
    with torch.no_grad():
        want = experts(x, ids.long(), weights)
    got = fused_experts(*(t.to(DEVICE) for t in (x, mine["w13"], mine["w2"], weights, ids)),
                        use_triton=True, biases=(mine["b13"].to(DEVICE), mine["b2"].to(DEVICE)),
                        glu=gpt_oss_glu(cfg))
    torch.testing.assert_close(got.cpu(), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("tokens", [1, 7, 64])
def test_pairs_of_another_ranks_experts_are_left_out(tokens):
    """Under expert parallelism a rank's ids are -1 where the expert is another rank's:
    both alignments give those pairs no row, and the layer sums only this rank's."""
    moe = block(True)
    x = torch.randn(tokens, 64, generator=torch.Generator().manual_seed(tokens))
    weights, ids = select_experts(x @ moe.gate.weight.detach().T, 2, True)
    w13, w2 = moe.experts.gate_up_proj.detach(), moe.experts.down_proj.detach()
    mine = torch.where(ids < 4, ids, -1)  # this rank holds experts 0..3
    aligned = [align_blocks(mine.to(DEVICE), 4, 16, use_triton=t) for t in (True, False)]
    for got, want in zip(*aligned):
        assert got.tolist() == want.tolist()
    sorted_ids = aligned[0][0].cpu()
    placed = sorted_ids[sorted_ids < ids.numel()].sort().values
    assert placed.tolist() == (mine.flatten() >= 0).nonzero().flatten().tolist()
    args = [t.to(DEVICE) for t in (x, w13[:4], w2[:4], weights, mine)]
    got = fused_experts(*args, use_triton=True)
    want = fused_experts(x, w13, w2, torch.where(ids < 4, weights, 0), ids, use_triton=False)
    torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("tokens", [1, 2])
def test_the_down_launch_sums_a_tokens_rows_as_the_sum_kernel_does(monkeypatch, tokens):
    """The last of a token's pairs to finish a tile of columns sums the token's rows
    (core/arrivals.py; at two tokens too, where the engine keeps the sum kernel): bit for
    bit the separate sum's result, with another rank's pairs left out (the second token
    has none of this rank's), and the counters back at zero for the next launch."""
    pytest.importorskip("triton")
    from roseinfer.core import arrivals
    from roseinfer.layers import moe as moe_layer
    monkeypatch.setattr(moe_layer, "SUM_IN_DOWN_TOKENS", 2)
    sums, sum_choices = [], moe_layer._sum_choices
    monkeypatch.setattr(moe_layer, "_sum_choices", lambda *a: sums.append(a) or sum_choices(*a))
    moe = block(True, experts=8, top_k=4)
    x = torch.randn(tokens, 64, generator=torch.Generator().manual_seed(tokens)).to(DEVICE)
    w13, w2 = (w.detach().to(DEVICE) for w in (moe.experts.gate_up_proj, moe.experts.down_proj))
    weights, ids = select_experts(x @ moe.gate.weight.detach().to(DEVICE).T, 4, True)
    mine = torch.where(ids < 6, ids, -1)
    if tokens == 2:
        mine[1] = -1
    summed = [fused_experts(x, w13, w2, weights, mine, use_triton=True) for _ in range(2)]
    assert not sums, "the down launch summed"
    assert not arrivals.counters(x.device, 1).any()
    monkeypatch.setattr(moe_layer, "counters", lambda *a: None)
    apart = fused_experts(x, w13, w2, weights, mine, use_triton=True)
    assert sums, "the separate sum ran"
    for got in summed:
        assert torch.equal(got, apart)
    if tokens == 2:
        assert not apart[1].any()
