"""torch's dynamically quantized int8 linear (quantize_dynamic; engines x86, onednn, fbgemm)
beside float32 at one row on the default model's layer shapes, weights hot in cache, two
threads: whether it is a faster int8 path than the GGUF blocks kernel on the CPU.

    python3 docs/bench/cpu_dynamic_int8.py
"""
import time, torch
torch.set_num_threads(2)
def bench(fn, reps=200):
    for _ in range(20): fn()
    t=time.perf_counter()
    for _ in range(reps): fn()
    return (time.perf_counter()-t)/reps*1e6
for N,K in [(1536,576),(576,1536),(576,576)]:
    lin = torch.nn.Linear(K, N, bias=False)
    x = torch.randn(1, K)
    for engine in ("x86","onednn","fbgemm"):
        try:
            torch.backends.quantized.engine = engine
            q = torch.ao.quantization.quantize_dynamic(torch.nn.Sequential(lin), {torch.nn.Linear}, dtype=torch.qint8)
            print(N,K,engine, f"{bench(lambda: q(x)):.1f} us (hot)")
        except Exception as e:
            print(engine, "fails", str(e)[:80])
    print(N,K,"float32", f"{bench(lambda: lin(x)):.1f} us (hot)")
