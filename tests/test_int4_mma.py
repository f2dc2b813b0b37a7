"""The project's 4-bit tensor-core kernel (layers/int4_mma.py): its layout on the CPU
(packing, panels; de-quantizing it: tests/test_int4_linear.py), and on a GPU every block config and split against the float64 product of the de-quantized
weight."""
import pytest
import torch

from roseinfer.layers import int4_mma
from roseinfer.layers.int4_linear import quantize
from tests.test_int4_linear import needs_cuda


def test_a_word_holds_its_eight_inputs_in_sigma_order():
    levels = torch.arange(64, dtype=torch.int32).remainder(16).view(1, 64).repeat(32, 1)
    words = int4_mma.pack(levels)
    assert words.shape == (1, 8, 32)
    nibbles = [(int(words[0, 0, 0]) >> (4 * j)) & 15 for j in range(8)]
    assert nibbles == list(int4_mma.SIGMA)  # input SIGMA[j] (= its level here) in nibble j
    # one mask takes two neighbouring inputs: (word >> 4i) & 0x000F000F holds 2i, 2i + 1
    for i in range(4):
        pair = (int(words[0, 0, 0]) >> (4 * i)) & 0x000F000F
        assert (pair & 15, pair >> 16) == (2 * i, 2 * i + 1)


def test_packing_round_trips_and_panels_hold_32_columns():
    gen = torch.Generator().manual_seed(0)
    levels = torch.randint(0, 16, (96, 384), generator=gen, dtype=torch.int32)
    words = int4_mma.pack(levels)
    assert words.shape == (3, 48, 32)
    assert torch.equal(int4_mma.levels_of(words), levels)
    rows = torch.randn(3, 96, generator=gen)
    assert torch.equal(int4_mma.panels(rows)[1], rows[:, 32:64])


def test_configs_tile_only_whole_blocks_and_stages():
    assert int4_mma.fits(0, 1, 4096, 4096) and int4_mma.fits(0, 16, 4096, 4096)
    assert not int4_mma.fits(0, 32, 4096, 4096)        # 16 splits of 2 chunks is all
    assert not int4_mma.fits(0, 1, 4096 + 32, 4096)    # 128 columns a block
    assert int4_mma.fits(4, 1, 4096 + 32, 4096 + 128)  # 32 columns, one chunk a stage
    assert all(s * 64 * 28672 <= int4_mma.PARTIALS
               for _, s in int4_mma.candidates(64, 28672, 4096))


@needs_cuda
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("rows", [1, 7, 16, 17, 40, 64])
def test_every_config_and_split_is_the_product(group, rows):
    """Up to 16 rows the groups' sums are scaled in float32 after the tensor cores; from
    17 the weights are made in bf16 first: both within a bf16 product's rounding of the
    float64 one, and the same sums on a second call (the split counters reset)."""
    n, k = 512, 2048
    gen = torch.Generator().manual_seed(rows + group)
    levels, scales = quantize(torch.randn(n, k, generator=gen) / k ** 0.5, group)
    zeros = torch.randint(4, 12, scales.shape, generator=gen).float()
    s = scales.bfloat16()
    shift = (-zeros * s.float()).bfloat16()
    words, s_p, z_p = (t.cuda() for t in (int4_mma.pack(levels), int4_mma.panels(s.t()),
                                          int4_mma.panels(shift.t())))
    x = torch.randn(rows, k, generator=gen).bfloat16()
    w = levels.float() * s.float().repeat_interleave(group, 1) + \
        shift.float().repeat_interleave(group, 1)
    want = x.double() @ w.double().t()
    for config, splits in int4_mma.candidates(rows, n, k):
        got = int4_mma.mm(x.cuda(), words, s_p, z_p, config, splits)
        err = (got.double().cpu() - want).abs().max() / want.abs().max()
        assert err < 2 ** -7, (config, splits, err.item())
        assert torch.equal(got, int4_mma.mm(x.cuda(), words, s_p, z_p, config, splits))


@needs_cuda
def test_tuning_picks_a_fitting_config_for_every_bucket():
    n, k = 1024, 4096
    levels = torch.randint(0, 16, (n, k), dtype=torch.int32)
    meta = int4_mma.panels(torch.rand(k // 128, n).bfloat16()).cuda()
    words = int4_mma.pack(levels).cuda()
    int4_mma.tune(words, meta, meta)
    for m in (1, 8, 9, 33, 64):
        assert int4_mma.choose(m, n, k, words.device) in int4_mma.candidates(m, n, k)
