"""One-row fused prologues on CUDA cores (no tl.dot) vs the unfused pair, M = 1."""
import os, sys, time
sys.path.insert(0, os.getcwd())
import torch
import triton, triton.language as tl
from roseinfer.core.triton_support import wait_for_inputs
from roseinfer.layers import skinny_linear as sk
from roseinfer.layers.fused import add_rms_norm, silu_and_mul
from roseinfer.layers.skinny_linear import graph_time


@triton.jit
def _row_kernel(x_ptr, w_ptr, y_ptr, r_ptr, g_ptr, h_ptr, N, K, s_w, eps,
                INPUT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr):
    wait_for_inputs(PDL)
    pid = tl.program_id(0)
    cols = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    sumsq = tl.zeros([BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + ks
        w = tl.load(w_ptr + cols[:, None] * s_w + k[None, :], mask=col_ok[:, None], other=0.0)
        x = tl.load(x_ptr + k).to(tl.float32)
        if INPUT == "silu":
            up = tl.load(x_ptr + K + k).to(tl.float32)
            x = (x / (1.0 + tl.exp(-x)) * up).to(x_ptr.dtype.element_ty).to(tl.float32)
        if INPUT == "rms_norm":
            r = tl.load(r_ptr + k).to(tl.float32)
            x = (x + r).to(x_ptr.dtype.element_ty)
            tl.store(h_ptr + k, x, mask=(k < K) & (pid == 0))
            x = x.to(tl.float32)
            sumsq += x * x
            x = x * tl.load(g_ptr + k).to(tl.float32)
        acc += w.to(tl.float32) * x[None, :]
    y = tl.sum(acc, axis=1)
    if INPUT == "rms_norm":
        y = y * tl.rsqrt(tl.sum(sumsq, axis=0) / K + eps)
    tl.store(y_ptr + cols, y.to(y_ptr.dtype.element_ty), mask=col_ok)


def row_linear(x, w, cfg, inputs="plain", r=None, g=None, eps=1e-5):
    bn, bk, warps, stages = cfg
    n, k = w.shape
    y = torch.empty(1, n, dtype=x.dtype, device=x.device)
    h = torch.empty(1, k, dtype=x.dtype, device=x.device) if r is not None else x
    _row_kernel[(triton.cdiv(n, bn),)](x, w, y, r if r is not None else x, g if g is not None else w, h,
                                       n, k, w.stride(0), eps, INPUT=inputs, BLOCK_N=bn, BLOCK_K=bk,
                                       PDL=True, num_warps=warps, num_stages=stages, launch_pdl=True)
    return y, h


torch.manual_seed(0)
dev, dt = "cuda", torch.bfloat16
SHAPES = [("8b qkv", 6144, 4096, "rms_norm"), ("8b gate_up", 28672, 4096, "rms_norm"),
          ("8b down", 4096, 14336, "silu"), ("8b o", 4096, 4096, "plain"), ("1b qkv", 3072, 2048, "rms_norm"),
          ("1b gate_up", 16384, 2048, "rms_norm"), ("1b down", 2048, 8192, "silu"), ("1b o", 2048, 2048, "plain")]
CONFIGS = [(bn, bk, w, s) for bn in (16, 32) for bk in (128, 256, 512) for w in (4, 8) for s in (2, 3, 4)]
out = open(os.environ.get("OUT", ".") + "/gemv.txt", "w")
def say(*a):
    print(*a, flush=True); print(*a, file=out, flush=True)
# correctness first, one shape
x = torch.randn(1, 2 * 2048, device=dev, dtype=dt); w = torch.randn(512, 2048, device=dev, dtype=dt) / 45
r = torch.randn(1, 2048, device=dev, dtype=dt); g = torch.randn(2048, device=dev, dtype=dt) * 0.1 + 1
ref = sk.skinny_linear(silu_and_mul(x), w); got = row_linear(x, w, (16, 256, 4, 3), "silu")[0]
say("silu max err", (ref.float() - got.float()).abs().max().item(), "ref scale", ref.float().abs().max().item())
xn = x[:, :2048].contiguous()
hn, res = add_rms_norm(xn, r, g, 1e-5); ref = sk.skinny_linear(hn, w)
got, h = row_linear(xn, w, (16, 256, 4, 3), "rms_norm", r, g)
say("norm max err", (ref.float() - got.float()).abs().max().item(), "h equal", torch.equal(h, res))
t0 = time.time()
for name, n, k, kind in SHAPES:
    copies = max(2, (400 << 20) // (n * k * 2))
    ws = [torch.randn(n, k, device=dev, dtype=dt) / k ** 0.5 for _ in range(copies)]
    g = torch.randn(k, device=dev, dtype=dt) * 0.1 + 1
    x = torch.randn(1, (2 if kind == "silu" else 1) * k, device=dev, dtype=dt)
    r = torch.randn(1, k, device=dev, dtype=dt)
    if kind == "silu":
        pair = lambda: [sk.skinny_linear(silu_and_mul(x), w) for w in ws]
    elif kind == "rms_norm":
        pair = lambda: [sk.skinny_linear(add_rms_norm(x, r, g, 1e-5)[0], w) for w in ws]
    else:
        pair = lambda: [sk.skinny_linear(x, w) for w in ws]
    plain = lambda: [sk.skinny_linear(x if kind != "silu" else x[:, :k], w) for w in ws]
    base, alone = graph_time(pair, 5) / copies * 1e3, graph_time(plain, 5) / copies * 1e3
    res = []
    for c in CONFIGS:
        try:
            res.append((graph_time(lambda: [row_linear(x, w, c, kind, r, g) for w in ws], 5) / copies * 1e3, c))
        except Exception as e:
            res.append((float("inf"), c))
    res.sort()
    floor = n * k * 2 / 3.0e12 * 1e6
    say(f"{name:10s}: pair {base:7.2f} us, skinny alone {alone:7.2f}, floor {floor:6.2f} | row best {res[0][0]:7.2f} {res[0][1]} | "
        + " ".join(f"{t:.1f}{c}" for t, c in res[1:5]))
    del ws
    torch.cuda.empty_cache()
say(f"{time.time() - t0:.0f} s")
