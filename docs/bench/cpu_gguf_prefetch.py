"""The interleaved Q4_1 kernel (kind 102) at one row of x, two threads, its weights streamed
through 200 MB of copies, built with each prefetch distance given (bytes ahead; the
source's default is 2048; each distance is its own build, -DGGUF_PREFETCH=N).

Usage: python3 docs/bench/cpu_gguf_prefetch.py 1024 2048 4096
"""
import sys
import time

import gguf
import numpy as np
import torch

from roseinfer.layers import gguf_linear as g
Q = gguf.GGMLQuantizationType
for pf in sys.argv[1:]:
    ops = g.build((*g.NATIVE, f"-DGGUF_PREFETCH={pf}"), f"pf{pf}")
    torch.set_num_threads(2)
    for n,k in ((960,576),(3072,576),(576,1536)):
        w = np.random.default_rng(0).standard_normal((n, k)).astype(np.float32)
        b = g.interleave(3, torch.from_numpy(gguf.quants.quantize(w, Q.Q4_1).view(np.uint8).reshape(n, -1).copy()))
        copies=[b.clone() for _ in range(max(1,(200<<20)//b.numel()))]
        x=torch.randn(1,k)
        for c in copies[:5]: ops.mm(x,c,102)
        t=time.perf_counter(); i=0
        while time.perf_counter()-t<0.5: ops.mm(x,copies[i%len(copies)],102); i+=1
        us=(time.perf_counter()-t)/i*1e6
        print(f"pf {pf} {n}x{k}: {us:.1f} us streamed, {b.numel()/us/1e3:.1f} GB/s", flush=True)
