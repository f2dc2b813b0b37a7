"""Where a CPU decode step's time goes: the linears against everything else.

    python3 docs/bench/cpu_anatomy.py [--model smollm2-random|gpt2-random|...] [--kernels]

Prints, for the default model's shape at batch 1 (or GPT-2 at 16 rows):
- ms a step as it is, and with every linear stubbed (no weights streamed);
- a few small ops hot and right after a 14 MB copy (the weights of one layer going
  through the caches), which is what they cost between two linears in a step;
- with ``--kernels``: a 512 MB read's bandwidth, and each weight shape's linear kernels
  (plain ``F.linear``, oneDNN packed, MKL packed, oneDNN packed bfloat16) over weights
  streamed from memory, 1 and 16 rows.
Token ids are given, so random-weight aliases without a tokenizer work.
"""
import argparse
import time

import torch
import torch.nn.functional as F

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576),
          (2304, 768), (768, 768), (3072, 768), (768, 3072), (50257, 768)]


def best_of(fn, reps=5) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def kernels() -> None:
    xs = [torch.randn(64 << 18) for _ in range(8)]
    print(f"sum over 512 MB: {512 * 2**20 / best_of(lambda: [x.sum() for x in xs]) / 1e9:.1f} GB/s")
    del xs
    for n, k in SHAPES:
        count = max(2, min(256, (256 << 20) // (n * k * 4)))
        ws = [torch.randn(n, k) * 0.02 for _ in range(count)]
        row = []
        for m in (1, 16):
            x = torch.randn(m, k)
            packed = [torch.ops.mkldnn._reorder_linear_weight(w, 16) for w in ws]
            mkl = [torch.ops.mkl._mkl_reorder_linear_weight(w, m) for w in ws]
            bf16 = [torch.ops.mkldnn._reorder_linear_weight(w.bfloat16(), 16) for w in ws]
            xb = x.bfloat16()
            runs = {"plain": lambda: [F.linear(x, w) for w in ws],
                    "packed": lambda: [torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
                                       for w in packed],
                    "mkl": lambda: [torch.ops.mkl._mkl_linear(x, p, w, None, m) for p, w in zip(mkl, ws)],
                    "bf16 packed": lambda: [torch.ops.mkldnn._linear_pointwise(xb, w, None, "none", [], "")
                                            for w in bf16]}
            row.append(f"{m} row(s): " + " ".join(
                f"{name} {best_of(run, 2) / count * 1e6:.0f}" for name, run in runs.items()))
        print(f"{n}x{k} ({n * k * 4 / 2**20:.1f} MB, {count} in turn), us a call | " + " | ".join(row))


def step_ms(llm, prompts, params) -> list[float]:
    llm.generate(prompts, params)
    times = []
    for _ in range(3):
        t = time.perf_counter()
        llm.generate(prompts, params)
        times.append((time.perf_counter() - t) * 1000 / params.max_tokens)
    return times


def anatomy(model: str) -> None:
    from roseinfer import LLM, SamplingParams
    from roseinfer.layers import cpu_linear

    rows = 16 if model.startswith("gpt2") else 1
    prompts = ([[15496] * (1 if i % 2 == 0 else 4) for i in range(rows)] if rows > 1
               else [list(range(1000, 1037))])
    llm = LLM(model, device="cpu", dtype="float32", enable_prefix_cache=False)
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    show = lambda ts: " ".join(f"{t:.2f}" for t in ts)  # noqa: E731
    print(f"{model}, {rows} row(s): ms a step {show(step_ms(llm, prompts, params))}")
    zeros = {}

    def stub(self, x, gelu=None):
        key = (x.shape[0], self.out_features)
        return zeros.setdefault(key, torch.zeros(key))
    real, cpu_linear.CpuLinear.forward = cpu_linear.CpuLinear.forward, stub
    print(f"  linears stubbed: ms a step {show(step_ms(llm, prompts, params))}")
    cpu_linear.CpuLinear.forward = real


def small_ops() -> None:
    x, w = torch.randn(1, 576), torch.ones(576)
    big = torch.randn(14 << 18)
    dst = torch.empty_like(big)
    ops = {"add": lambda: x + x, "rms_norm": lambda: F.rms_norm(x, (576,), w, 1e-5),
           "slice": lambda: x[:, :100], "silu": lambda: F.silu(x)}
    for name, op in ops.items():
        hot = best_of(lambda: [op() for _ in range(2000)]) / 2000
        cold = 0.0
        for _ in range(50):
            dst.copy_(big)
            t = time.perf_counter()
            op()
            cold += time.perf_counter() - t
        print(f"  {name}: hot {hot * 1e6:.1f} us, after a 14 MB copy {cold / 50 * 1e6:.1f} us")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-random")
    ap.add_argument("--kernels", action="store_true")
    args = ap.parse_args()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"{torch.backends.cpu.get_cpu_capability()}")
    if args.kernels:
        kernels()
    anatomy(args.model)
    small_ops()


if __name__ == "__main__":
    main()
