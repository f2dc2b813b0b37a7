"""A mixture-of-experts MLP: the router's top-k, then every chosen expert's SwiGLU MLP,
summed with the router's weights, in two grouped GEMM launches (vLLM's ``fused_moe``
design, in Triton).

- Routing (layers/moe_routing.py): each token's experts and their weights.
- ``align_blocks``: the (token, choice) pairs sorted by expert, each expert's run padded to
  the GEMM's row tile, so that a tile of rows reads one expert's weights. Static shapes
  and no host sync: it runs inside CUDA graphs.
- ``fused_experts``: one launch for gate_up over every tile, with silu(gate) * up (or
  gpt-oss's clamped form) in its epilogue, one launch for down with the routing weights
  applied in the kernel, then one launch summing each token's top-k rows (at one token,
  the down launch's last program of each tile of columns sums them). Each tile
  streams only its own expert's weights, so at decode sizes a step reads the chosen
  experts and no other. FP8 experts (a scale per row) and biases are applied in the
  epilogues too.

Weights are laid out as transformers keeps them: ``w13 = [E, 2I, H]`` (gate rows, then
up), ``w2 = [E, H, I]``. Off CUDA a plain-torch twin loops over the experts that hold
tokens (``use_triton`` as in fused.py).

Under tensor parallelism each rank holds every expert's share of the intermediate
dimension (vLLM's default), so routing is the same on every rank and the layer's output
is a partial sum, as a dense MLP's is: the caller sums the ranks'. Under expert
parallelism (``enable_expert_parallel``) each rank holds 1/size of the experts whole and
computes the pairs routed to them: again a partial sum, with the same sum after it.
"""
from __future__ import annotations  # kernel annotations stay strings without triton

from dataclasses import dataclass
from functools import partial

import torch
from torch import nn

from roseinfer.core import tp
from roseinfer.core.arrivals import counters, last_to_arrive
from roseinfer.core.triton_support import dependent_launch, kernel as _kernel, tl, triton, \
    wait_for_inputs
from roseinfer.layers.fused import _use_triton, silu_and_mul
from roseinfer.layers.moe_routing import route
from roseinfer.models.quantization import FP8, FP8_MAX, absmax_scale


@_kernel
def _larger(a, b):
    return tl.maximum(a, b)


@_kernel
def _align_kernel(ids_ptr, sorted_ptr, tile_expert_ptr, total_ptr, cursor_ptr, pairs, rows,
                  experts, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, CHUNK: tl.constexpr,
                  PDL: tl.constexpr):
    """align_blocks in one program: count each expert's pairs, lay the padded runs out,
    name each tile's expert, then place each pair after its expert's earlier ones. Work
    per chunk of pairs follows the chunk, not the experts (a histogram, a chunk x chunk
    comparison): 512 experts cost what 8 do."""
    wait_for_inputs(PDL)
    everyone = tl.arange(0, BLOCK_E)
    chunk = tl.arange(0, CHUNK)
    counts = tl.zeros([BLOCK_E], dtype=tl.int32)
    for c0 in range(0, pairs, CHUNK):
        e = tl.load(ids_ptr + c0 + chunk, mask=c0 + chunk < pairs, other=-1)
        counts += tl.histogram(e, BLOCK_E, mask=e >= 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    ends = tl.cumsum(padded, 0)
    starts = ends - padded
    total = tl.sum(padded, 0)
    tl.store(total_ptr, total)
    tiles = rows // BLOCK_M
    for r0 in range(0, rows, CHUNK):
        tl.store(sorted_ptr + r0 + chunk, tl.full([CHUNK], 0, tl.int32) + pairs,
                 mask=r0 + chunk < rows)
    for t0 in range(0, tiles, CHUNK):
        tl.store(tile_expert_ptr + t0 + chunk, tl.full([CHUNK], -1, tl.int32),
                 mask=t0 + chunk < tiles)
    tl.debug_barrier()  # the -1s down before each expert marks its first tile
    tl.store(tile_expert_ptr + starts // BLOCK_M, everyone, mask=padded > 0)
    tl.store(cursor_ptr + everyone, starts)
    tl.debug_barrier()
    # A tile between two marks is the earlier mark's expert: a running maximum.
    before = tl.full([], -1, tl.int32)
    for t0 in range(0, tiles, CHUNK):
        t = t0 + chunk
        mark = tl.load(tile_expert_ptr + t, mask=t < tiles, other=-1)
        expert = tl.maximum(tl.associative_scan(mark, 0, _larger), before)
        tl.store(tile_expert_ptr + t, tl.where(t * BLOCK_M < total, expert, -1), mask=t < tiles)
        before = tl.max(expert, 0)
    cursor = starts  # each expert's next free row, kept in cursor_ptr for the gathers
    for c0 in range(0, pairs, CHUNK):
        e = tl.load(ids_ptr + c0 + chunk, mask=c0 + chunk < pairs, other=-1)
        mine = e >= 0
        earlier = tl.sum(((e[:, None] == e[None, :]) & (chunk[None, :] < chunk[:, None]))
                         .to(tl.int32), 1)
        row = tl.load(cursor_ptr + e, mask=mine, other=0) + earlier
        tl.store(sorted_ptr + row, c0 + chunk, mask=mine)
        cursor += tl.histogram(e, BLOCK_E, mask=mine)
        tl.debug_barrier()  # every pair read its expert's row before the next chunk's
        tl.store(cursor_ptr + everyone, cursor)
        tl.debug_barrier()


ALIGN_IN_ONE_PROGRAM = 1024  # pairs up to which one program aligns faster than torch's sort


def align_blocks(ids: torch.Tensor, num_experts: int, block_m: int,
                 use_triton: bool | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The pairs of ``ids`` ([T, k]) in expert order, each expert's run padded to a
    multiple of ``block_m``. Returns (sorted pair indexes, padded with T*k; the expert
    of each tile of block_m rows, -1 past the last; the padded row count, a 1-element
    tensor). Sized for the worst case: each expert holding pairs adds at most one tile
    that is not full, so ceil(T*k / block_m) + min(E, T*k) tiles (9 for one token's
    top 8, where E*(block_m - 1) rows of padding would launch 121). At decode sizes one
    Triton program does it; torch's way takes some 25 launches. A pair whose expert is
    -1 (another rank's, under expert parallelism) gets no row."""
    pairs = ids.numel()
    rows = block_m * (-(-pairs // block_m) + min(num_experts, pairs))
    if _use_triton(use_triton, ids) and pairs <= ALIGN_IN_ONE_PROGRAM:
        sorted_ids = torch.empty(rows, dtype=torch.int32, device=ids.device)
        tile_expert = torch.empty(rows // block_m, dtype=torch.int32, device=ids.device)
        total = torch.empty(1, dtype=torch.int32, device=ids.device)
        block_e = triton.next_power_of_2(num_experts)
        cursor = torch.empty(block_e, dtype=torch.int32, device=ids.device)
        # chunks of pairs no larger than the step's: each is a [chunk, chunk] comparison
        chunk = min(64, max(16, triton.next_power_of_2(pairs)))
        pdl = dependent_launch(ids.device, pairs)
        _align_kernel[(1,)](ids.contiguous(), sorted_ids, tile_expert, total, cursor, pairs,
                            rows, num_experts, BLOCK_M=block_m, BLOCK_E=block_e, CHUNK=chunk,
                            PDL=pdl, num_warps=2 if chunk < 64 else 4, launch_pdl=pdl)
        return sorted_ids, tile_expert, total
    # -1 (another rank's expert) counts in one more bucket, which gets no rows
    flat = ids.flatten().long().remainder(num_experts + 1)
    # not bincount: it reads the largest id back to the host, which a graph cannot
    counts = torch.zeros(num_experts + 1, dtype=torch.long, device=ids.device).scatter_add_(
        0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded[num_experts:].zero_()  # not `= 0`: that copies a host scalar, which a graph cannot
    starts = torch.cumsum(padded, 0) - padded
    order = torch.argsort(flat, stable=True)
    expert = flat[order]
    rank = torch.arange(pairs, device=ids.device) - (torch.cumsum(counts, 0) - counts)[expert]
    # the last bucket's pairs write past the rows, into a slot that is dropped
    sorted_ids = torch.full((rows + 1,), pairs, dtype=torch.int32, device=ids.device)
    place = torch.where(expert < num_experts, starts[expert] + rank, rows)
    sorted_ids[place] = order.to(torch.int32)
    sorted_ids = sorted_ids[:rows]
    padded = padded[:num_experts]
    tile_starts = torch.arange(0, rows, block_m, device=ids.device)
    tile_expert = torch.searchsorted(torch.cumsum(padded, 0), tile_starts, right=True)
    total = padded.sum().reshape(1)
    tile_expert = torch.where(tile_starts < total, tile_expert, -1).to(torch.int32)
    return sorted_ids, tile_expert, total.to(torch.int32)


@_kernel
def _of_rows(ptr, cols, N):
    """[1, cols] of a vector with a value per output row (a scale, a bias), as float32."""
    return tl.load(ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]


@_kernel
def _glu(gate, up, alpha, limit, CLAMPED: tl.constexpr):
    """silu(gate) * up, or gpt-oss's form: both clamped to ``limit`` (the gate from above
    only), then (up + 1) * gate * sigmoid(alpha * gate)."""
    if CLAMPED:
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit) + 1.0
    else:
        alpha = 1.0
    return gate / (1.0 + tl.exp(-alpha * gate)) * up


@_kernel
def _grouped_gemm_kernel(a_ptr, w_ptr, scale_ptr, bias_ptr, c_ptr, weights_ptr, sorted_ptr,
                         tile_expert_ptr, total_ptr, N, K, pairs, pairs_per_row, s_a, s_we,
                         s_wn, s_se, s_be, s_c, alpha, limit, SCALED: tl.constexpr,
                         BIAS: tl.constexpr, SWIGLU: tl.constexpr, CLAMPED: tl.constexpr,
                         MUL_WEIGHTS: tl.constexpr, PER_PAIR: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         PDL: tl.constexpr, sum_ptr=None, counter_ptr=None,
                         SUM_LAST: tl.constexpr = False, TOP_K: tl.constexpr = 1):
    """C[pair] = A[pair // pairs_per_row] @ W[expert].T (x the pair's routing weight), for the
    BLOCK_M pairs of one tile and BLOCK_N of the N output columns. ``SWIGLU``: W holds 2N
    rows, gate then up, and C is silu(gate) * up, each rounded to C's dtype first as the
    unfused gate_up output would be; ``CLAMPED``: gpt-oss's form (``_glu``).
    ``SCALED``: W is FP8, each of its rows times its float32 scale (``scale_ptr``,
    [E, rows]); A stays in its own dtype (W8A16). ``BIAS``: each row's bias (``bias_ptr``,
    [E, rows]) is added before the activation and the routing weight. ``PER_PAIR``: tile
    t is pair t alone (its first row), ``tile_expert_ptr`` the pairs' expert ids, and
    ``sorted_ptr`` and ``total_ptr`` unused: no sort. ``SUM_LAST`` (a tile per pair):
    the last of a token's ``TOP_K`` pairs to finish a tile of columns sums the token's
    rows into ``sum`` as ``_sum_choices_kernel`` would (core/arrivals.py)."""
    wait_for_inputs(PDL)
    tile = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    if PER_PAIR:
        expert = tl.load(tile_expert_ptr + tile).to(tl.int64)
        if expert < 0:  # another rank's expert: nothing to multiply, but it counts
            if SUM_LAST:
                _sum_if_last(sum_ptr, c_ptr, tile_expert_ptr, counter_ptr, tile // TOP_K, cols,
                             N, TOP_K)
            return
        pair = tl.where(tl.arange(0, BLOCK_M) == 0, tile, pairs)
    else:
        if tile * BLOCK_M >= tl.load(total_ptr):
            return
        expert = tl.load(tile_expert_ptr + tile).to(tl.int64)
        pair = tl.load(sorted_ptr + tile * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = pair < pairs
    token = tl.where(valid, pair // pairs_per_row, 0).to(tl.int64)
    w_rows = w_ptr + expert * s_we + cols[None, :] * s_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        in_k = ks[:, None] < K
        a = tl.load(a_ptr + token[:, None] * s_a + ks[None, :],
                    mask=valid[:, None] & (ks[None, :] < K), other=0.0)
        w = tl.load(w_rows + ks[:, None], mask=(cols[None, :] < N) & in_k, other=0.0)
        acc += tl.dot(a, w.to(a.dtype), input_precision="ieee")
        if SWIGLU:
            w = tl.load(w_rows + N * s_wn + ks[:, None], mask=(cols[None, :] < N) & in_k,
                        other=0.0)
            up += tl.dot(a, w.to(a.dtype), input_precision="ieee")
    if SCALED:  # a row's scale factors out of its sum over K
        acc *= _of_rows(scale_ptr + expert * s_se, cols, N)
        if SWIGLU:
            up *= _of_rows(scale_ptr + expert * s_se + N, cols, N)
    if BIAS:
        acc += _of_rows(bias_ptr + expert * s_be, cols, N)
        if SWIGLU:
            up += _of_rows(bias_ptr + expert * s_be + N, cols, N)
    if SWIGLU:
        acc = _glu(acc.to(c_ptr.dtype.element_ty).to(tl.float32),
                   up.to(c_ptr.dtype.element_ty).to(tl.float32), alpha, limit, CLAMPED)
    if MUL_WEIGHTS:
        acc *= tl.load(weights_ptr + pair, mask=valid, other=0.0)[:, None]
    tl.store(c_ptr + pair.to(tl.int64)[:, None] * s_c + cols[None, :],
             acc.to(c_ptr.dtype.element_ty), mask=valid[:, None] & (cols[None, :] < N))
    if SUM_LAST:
        _sum_if_last(sum_ptr, c_ptr, tile_expert_ptr, counter_ptr, tile // TOP_K, cols, N,
                     TOP_K)


@_kernel
def _sum_if_last(sum_ptr, c_ptr, ids_ptr, counter_ptr, token, cols, hidden,
                 TOP_K: tl.constexpr):
    """A token's pairs arrive at its counter for this tile of columns; the last sums."""
    if last_to_arrive(counter_ptr + token * tl.num_programs(1) + tl.program_id(1), TOP_K):
        _token_sum(c_ptr, ids_ptr, sum_ptr, token, cols, hidden, TOP_K)


# Tokens up to which each (token, choice) pair gets a tile of its own, unsorted: at one
# or two tokens nearly every tile holds one pair anyway, and the sort's launch is saved
# (1.05-1.15x the sorted GEMMs on three MoE shapes, H200, docs/kernels.md).
PER_PAIR_TOKENS = 2
# Tokens up to which the down launch sums each token's rows itself (its last pair to
# finish a tile of columns does, core/arrivals.py): at one token 0.15-0.5 % off three MoE
# shapes' steps, at two 0.9 % slower (H100, docs/kernels.md "The experts' sum").
SUM_IN_DOWN_TOKENS = 1


def _config(pairs: int, fp8: bool = False, per_pair: bool = False,
            elem_bytes: int = 2) -> dict:
    """The GEMM's tiles and launch: small row tiles at decode sizes, where most tiles are
    one expert's few tokens and the time is its weights' bytes. FP8 experts at one or two
    tokens: tiles as deep as a 16-bit tile's bytes, half as wide (32.0 against 37.7 us a
    Qwen3-30B-A3B layer at one token on an H200, docs/benchmarks.md). A tile per pair:
    deeper, the fastest of six in the H200's sweep (docs/kernels.md)."""
    if fp8 and pairs <= 16:
        return dict(BLOCK_M=16, BLOCK_N=32, BLOCK_K=256, num_warps=4, num_stages=3)
    if per_pair:  # float32's tiles at half the depth: the same bytes of shared memory
        return dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=512 // elem_bytes, num_warps=4,
                    num_stages=3)
    if pairs <= 256:
        return dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=4)
    return dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, num_warps=8, num_stages=3)


def _grouped_gemm(a, w, scale, bias, weights, aligned, config: dict, pairs_per_row: int,
                  swiglu: bool, glu: ClampedGlu | None = None,
                  summed: tuple[torch.Tensor, torch.Tensor, int] | None = None) -> torch.Tensor:
    """[pairs, N]: row p is A's row p // pairs_per_row times its expert's W ([E, N, K]),
    FP8 times ``scale`` ([E, N]) where that is not None, plus ``bias`` ([E, N]) where
    that is not; ``swiglu``: W is [E, 2N, K], the gate and the up rows, and the rows
    come out silu(gate) * up (``glu``'s clamped form where given); otherwise each row is
    scaled by its routing weight. ``aligned``: align_blocks' result, or the pairs' expert
    ids ([pairs]) for a tile per pair. ``summed``: (out, counters, top_k), with a tile per
    pair: each token's rows also summed into ``out`` ([tokens, N]) by the launch itself."""
    assert w.stride(-1) == 1, "expert weights must be contiguous in K"
    per_pair = isinstance(aligned, torch.Tensor)
    sorted_ids, tile_expert, total = (aligned,) * 3 if per_pair else aligned
    pairs, n, k = weights.numel(), w.shape[1] // (2 if swiglu else 1), w.shape[2]
    c = torch.empty((pairs, n), dtype=a.dtype, device=a.device)
    grid = (tile_expert.numel(), triton.cdiv(n, config["BLOCK_N"]))
    pdl = dependent_launch(a.device, pairs)
    scaled, biased = scale is not None, bias is not None
    out, count, top_k = summed or (c, c, 1)
    _grouped_gemm_kernel[grid](a, w, scale if scaled else w, bias if biased else w, c, weights,
                               sorted_ids, tile_expert, total, n, k, pairs, pairs_per_row,
                               a.stride(0), w.stride(0), w.stride(1),
                               scale.stride(0) if scaled else 0, bias.stride(0) if biased else 0,
                               c.stride(0), glu.alpha if glu else 1.0, glu.limit if glu else 0.0,
                               SCALED=scaled, BIAS=biased, SWIGLU=swiglu, CLAMPED=glu is not None,
                               MUL_WEIGHTS=not swiglu, PER_PAIR=per_pair, PDL=pdl,
                               launch_pdl=pdl, sum_ptr=out, counter_ptr=count,
                               SUM_LAST=summed is not None, TOP_K=top_k, **config)
    return c


@_kernel
def _sum_choices_kernel(x_ptr, ids_ptr, out_ptr, hidden, TOP_K: tl.constexpr,
                        BLOCK: tl.constexpr, PDL: tl.constexpr):
    """out[t] = the sum of x's TOP_K rows of token t, in float32, rounded once; rows of
    another rank's experts (id -1) were never written and count nothing."""
    wait_for_inputs(PDL)
    _token_sum(x_ptr, ids_ptr, out_ptr, tl.program_id(0).to(tl.int64),
               tl.program_id(1) * BLOCK + tl.arange(0, BLOCK), hidden, TOP_K)


@_kernel
def _token_sum(x_ptr, ids_ptr, out_ptr, token, cols, hidden, TOP_K: tl.constexpr):
    """Columns ``cols`` of ``token``'s TOP_K rows of x summed in float32 in choice order,
    rounded once; read from L2 (``.cg``): other programs of the same launch may have
    written them."""
    acc = tl.zeros(cols.shape, dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        if tl.load(ids_ptr + token * TOP_K + j) >= 0:
            acc += tl.load(x_ptr + (token * TOP_K + j) * hidden + cols, mask=cols < hidden,
                           other=0.0, cache_modifier=".cg").to(tl.float32)
    tl.store(out_ptr + token * hidden + cols, acc.to(out_ptr.dtype.element_ty),
             mask=cols < hidden)


def _sum_choices(down: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """[tokens, H]: each token's top_k rows of ``down`` ([tokens * top_k, H]) summed, those
    of ``ids`` -1 left out, in one launch where torch's float32 sum and cast take two."""
    tokens, top_k = ids.shape
    hidden = down.shape[1]
    out = torch.empty((tokens, hidden), dtype=down.dtype, device=down.device)
    block = min(triton.next_power_of_2(hidden), 1024)
    pdl = dependent_launch(down.device, tokens)
    _sum_choices_kernel[(tokens, triton.cdiv(hidden, block))](
        down, ids.contiguous(), out, hidden, TOP_K=top_k, BLOCK=block, PDL=pdl, num_warps=4,
        launch_pdl=pdl)
    return out


@dataclass(frozen=True)
class ClampedGlu:
    """gpt-oss's gated activation: gate clamped from above and up both ways at ``limit``,
    then (up + 1) * gate * sigmoid(alpha * gate)."""
    alpha: float
    limit: float

    def __call__(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.float().chunk(2, dim=-1)
        gate, up = gate.clamp(max=self.limit), up.clamp(-self.limit, self.limit)
        return ((up + 1) * gate * torch.sigmoid(self.alpha * gate)).to(gate_up.dtype)


def fused_experts(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                  weights: torch.Tensor, ids: torch.Tensor, use_triton: bool | None = None,
                  scales: tuple[torch.Tensor, torch.Tensor] | None = None,
                  biases: tuple[torch.Tensor, torch.Tensor] | None = None,
                  glu: ClampedGlu | None = None) -> torch.Tensor:
    """sum_j weights[t, j] * expert_{ids[t, j]}(x[t]) for every token t of ``x`` ([T, H]),
    each expert ``down(silu(gate(x)) * up(x))``; returns [T, H] in x's dtype. ``scales``:
    w13 and w2 are FP8, their rows times these ([E, 2I] and [E, H], float32); ``biases``:
    added to gate_up's and down's rows ([E, 2I], [E, H]); ``glu``: the activation in place
    of SiLU's."""
    if not _use_triton(use_triton, x):
        if scales is not None:
            w13, w2 = (w.to(x.dtype) * s[..., None].to(x.dtype) for w, s in zip((w13, w2), scales))
        return _experts_torch(x, w13, w2, weights, ids, biases, glu)
    x = x.contiguous()
    tokens, top_k = ids.shape
    per_pair = tokens <= PER_PAIR_TOKENS
    config = _config(ids.numel(), fp8=scales is not None, per_pair=per_pair,
                     elem_bytes=x.element_size())
    aligned = ids.flatten().contiguous() if per_pair else \
        align_blocks(ids, w13.shape[0], config["BLOCK_M"], use_triton=True)
    flat_weights = weights.flatten().float().contiguous()
    (s13, s2), (b13, b2) = scales or (None, None), biases or (None, None)
    act = _grouped_gemm(x, w13, s13, b13, flat_weights, aligned, config, top_k, swiglu=True,
                        glu=glu)
    count = counters(x.device, tokens * triton.cdiv(w2.shape[1], config["BLOCK_N"])) \
        if per_pair and tokens <= SUM_IN_DOWN_TOKENS else None
    if count is None:
        return _sum_choices(_grouped_gemm(act, w2, s2, b2, flat_weights, aligned, config, 1,
                                          swiglu=False), ids)
    out = torch.empty((tokens, w2.shape[1]), dtype=x.dtype, device=x.device)
    _grouped_gemm(act, w2, s2, b2, flat_weights, aligned, config, 1, swiglu=False,
                  summed=(out, count, top_k))
    return out


def _experts_torch(x, w13, w2, weights, ids, biases=None, glu=None) -> torch.Tensor:
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for expert in (e for e in ids.unique().tolist() if e >= 0):
        token, slot = (ids == expert).nonzero(as_tuple=True)
        gate_up = x[token] @ w13[expert].T
        if biases is not None:
            gate_up = gate_up + biases[0][expert]
        h = (glu or partial(silu_and_mul, use_triton=False))(gate_up) @ w2[expert].T
        if biases is not None:
            h = h + biases[1][expert]
        out.index_add_(0, token, h.float() * weights[token, slot, None].float())
    return out.to(x.dtype)


class SparseMoE(nn.Module):
    """A router (``gate``) and ``experts`` SwiGLU experts (``w13``, ``w2``), each token
    through its ``top_k``. Under tensor parallelism this rank's share of each expert's
    ``intermediate`` rows; under expert parallelism (``tp.group().expert_parallel``)
    1/size of the experts, whole, the others' pairs left to their ranks. ``bias``: the
    router and the experts' projections have biases (``b13``, ``b2``: under tensor
    parallelism rank 0's down bias holds it, the others' zeros); ``glu``: the experts'
    activation where it is not SiLU's (gpt-oss); ``routing``: what turns the router's logits
    into (weights, expert ids) where a softmax's top-k does not (DeepSeek-V3's)."""

    def __init__(self, hidden: int, intermediate: int, experts: int, top_k: int,
                 renormalize: bool, bias: bool = False, glu: ClampedGlu | None = None,
                 routing: nn.Module | None = None):
        super().__init__()
        group = tp.group()
        self.expert_parallel = group.expert_parallel and group.size > 1
        if self.expert_parallel:
            local, inter = tp.split(experts, "experts"), intermediate
        else:
            local, inter = experts, tp.split(intermediate, "expert intermediate size")
        self.first_expert = group.rank * local if self.expert_parallel else 0
        self.num_experts, self.top_k, self.renormalize, self.glu = experts, top_k, renormalize, glu
        self.gate = nn.Linear(hidden, experts, bias=bias)
        # it decides the routing: drawn alike on every rank, kept at full precision
        self.gate.router = True
        self.routing = routing  # experts chosen otherwise than by softmax (moe_routing.py)
        self.w13 = nn.Parameter(torch.empty(local, 2 * inter, hidden))
        self.w2 = nn.Parameter(torch.empty(local, hidden, inter))
        if bias:
            self.b13 = nn.Parameter(torch.empty(local, 2 * inter))
            self.b2 = nn.Parameter(torch.empty(local, hidden))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.routing is None:
            weights, ids = route(h, self.gate, self.top_k, self.renormalize)
        else:
            weights, ids = self.routing(h, self.gate)
        if self.expert_parallel:  # this rank's experts by their index here; -1 elsewhere
            local = ids - self.first_expert
            ids = torch.where((local >= 0) & (local < self.w13.shape[0]), local, -1)
        scales = (self.w13_scale, self.w2_scale) if hasattr(self, "w13_scale") else None
        biases = (self.b13, self.b2) if hasattr(self, "b13") else None
        return fused_experts(h, self.w13, self.w2, weights, ids, scales=scales, biases=biases,
                             glu=self.glu)

    def to_fp8(self) -> None:
        """The experts' weights in e4m3 with a float32 scale per output row (the kernel
        de-quantizes tiles as it reads them: half the bytes a step reads), the float
        copies freed."""
        for name in ("w13", "w2"):
            w = getattr(self, name).detach().float()
            scale = absmax_scale(w).squeeze(-1)
            q = (w / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
            setattr(self, name, nn.Parameter(q, requires_grad=False))
            self.register_buffer(f"{name}_scale", scale.float())

    def step_weights(self) -> list[torch.Tensor]:
        """Of its own tensors, those every step reads whatever its routing: none (the
        router is a module of its own; the bytes floor adds the experts a step's tokens
        choose, ``expert_bytes``)."""
        return []

    def expert_bytes(self, tokens: int) -> float:
        """Expert weight bytes a step of ``tokens`` tokens reads, expected under uniform
        routing: each expert is chosen by none of them with (1 - k/E)^tokens."""
        here = self.w13.shape[0]  # this rank's experts
        chosen = here * (1 - (1 - self.top_k / self.num_experts) ** tokens)
        per_expert = (self.w13.numel() + self.w2.numel()) // here * self.w13.element_size()
        if hasattr(self, "w13_scale"):
            per_expert += (self.w13_scale.numel() + self.w2_scale.numel()) // here * 4
        return chosen * per_expert


class SharedExpert(nn.Module):
    """Qwen2-MoE's expert that every token goes through beside its routed ones: a SwiGLU
    MLP (this rank's share of its intermediate rows) scaled by sigmoid(gate(x))."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        inter = tp.split(intermediate, "shared expert intermediate size")
        self.gate_up_proj = nn.Linear(hidden, 2 * inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)
        self.gate = nn.Linear(hidden, 1, bias=False)
        self.gate.router = True

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        out = self.down_proj(silu_and_mul(self.gate_up_proj(h)))
        return torch.sigmoid(self.gate(h)) * out
