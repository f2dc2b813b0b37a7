"""The recurrent layers' scans on the GPU: flash-linear-attention's kernels against the
torch closed forms. Gated DeltaNet (layers/gated_deltanet.py ``delta_rule``) on
Qwen3-Next's head shapes (16 key heads, 32 value heads of 128, bfloat16 inputs); Mamba2's
SSM (layers/mamba2.py ``ssm_scan``) on Granite 4.0-H's (128 heads of 64, state 128,
float32 inputs); float32 states.

Decode (one token a sequence, B sequences): the call's time against the bytes it must
move, the states read and written (2 MiB a sequence each way for DeltaNet, 4 MiB for
Mamba2) at the copy rate measured first; fla's and torch's kernels on states already
gathered, then over a table of state rows: "fla+rows" gathers the rows, runs fla's kernel
and scatters them back (the engine before), "in_place" is layers/recurrent_decode.py. Prompts (one sequence of T tokens): time and
tokens a second. Median of 20 calls after one, each timed with events. One JSON line per
row to OUT/recurrent_kernels.jsonl.

With MAMBA_SSM_SRC set to an unpacked mamba-ssm source tree (its sdist: the registry has no
wheel, and its CUDA extensions are not needed here), Mamba2's rows also time mamba-ssm's
Triton kernels, as vLLM runs them: "mamba_ssm" decode is ``selective_state_update`` over
the table's rows (in place, by ``state_batch_indices``), a prompt ``mamba_chunk_scan_combined``.

    python3 docs/bench/recurrent_kernels.py [--decode 1,8,64,256] [--prompt 512,4096,32768]
"""
import argparse
import json
import os
import sys
import types

import torch

sys.path.insert(0, os.path.dirname(__file__))
from long_context_attention import copy_rate, seconds  # noqa: E402

from roseinfer.layers import gated_deltanet, mamba2, recurrent_decode  # noqa: E402


def inputs(layer: str, batch: int, tokens: int):
    """The scan's arguments, the states last."""
    gen = torch.Generator(device="cuda").manual_seed(batch * 7 + tokens)
    shape = batch, tokens

    def randn(*dims, scale=1.0):
        return torch.randn(*dims, generator=gen, device="cuda") * scale

    def rand(*dims):
        return torch.rand(*dims, generator=gen, device="cuda")
    if layer == "gated_deltanet":
        return (randn(*shape, 16, 128).bfloat16(), randn(*shape, 16, 128).bfloat16(),
                randn(*shape, 32, 128).bfloat16(), -rand(*shape, 32), rand(*shape, 32),
                randn(batch, 32, 128, 128, scale=0.1))
    dt = rand(*shape, 128) * 0.1
    return (randn(*shape, 128, 64), dt, dt * A_MAMBA, randn(*shape, 128, 128, scale=0.1),
            randn(*shape, 128, 128, scale=0.1), randn(batch, 128, 64, 128, scale=0.1))


# Mamba2's per-head A (each token's log decay is dt A), the same in every call
A_MAMBA = -torch.rand(128, generator=torch.Generator().manual_seed(0)).cuda() \
    if torch.cuda.is_available() else None


def mamba_ssm():
    """(selective_state_update, mamba_chunk_scan_combined) from MAMBA_SSM_SRC, loaded past
    the package's __init__ (which imports its unbuilt CUDA extensions); None without it."""
    src = os.environ.get("MAMBA_SSM_SRC")
    if not src:
        return None
    package = types.ModuleType("mamba_ssm")
    package.__path__ = [os.path.join(src, "mamba_ssm")]
    sys.modules["mamba_ssm"] = package
    from mamba_ssm.ops.triton.selective_state_update import selective_state_update
    from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined
    return selective_state_update, mamba_chunk_scan_combined


def mamba_ssm_decode(update, args, table, rows) -> float:
    """One token a sequence, each state stepped in its table row; dt and A tied over the
    head dim (stride 0), as vLLM passes them; B and C a group a head."""
    x, dt, _, b, c = (a[:, 0] for a in args[:5])
    heads, p, n = table.shape[1:]
    a = A_MAMBA[:, None, None].expand(heads, p, n)
    dt = dt[..., None].expand(-1, -1, p)
    # zeros for D (the skip the layer adds itself) and the dt bias: its wrapper needs both
    zeros = torch.zeros(heads, device="cuda")[:, None].expand(heads, p)
    return seconds(lambda: update(table, x, dt, a, b, c, D=zeros, dt_bias=zeros,
                                  state_batch_indices=rows.int()), reps=20)


def mamba_ssm_prompt(scan, args) -> float:
    """The SSD chunk scan over one prompt (chunks of 256, as Mamba2 checkpoints set),
    checked once against the layer's closed form before it is timed."""
    x, dt, _, b, c, state = args
    got, end = scan(x, dt, A_MAMBA, b, c, 256, initial_states=state.clone(),
                    return_final_states=True)
    want, want_end = mamba2.ssm_scan(*args[:5], state.clone())
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(end, want_end, atol=2e-2, rtol=2e-2)
    return seconds(lambda: scan(x, dt, A_MAMBA, b, c, 256, initial_states=state.clone(),
                                return_final_states=True), reps=20)


SCANS = {"gated_deltanet": gated_deltanet.delta_rule, "mamba2": mamba2.ssm_scan}
IN_PLACE = {"gated_deltanet": recurrent_decode.delta_decode_in_place,
            "mamba2": recurrent_decode.ssm_decode_in_place}


def decode_rows(layer: str, kind: str, args) -> float:
    """A decode batch over a state table of its rows, in shuffled order: "fla+rows" as the
    engine ran it before (the rows gathered, fla's kernel on the copy, scattered back),
    "in_place" as it runs now (layers/recurrent_decode.py). Gated DeltaNet's gates come
    from in_proj_ba's output in both: in torch before fla's kernel, in the kernel itself."""
    table = args[5].clone()
    batch = table.shape[0]
    rows = torch.randperm(batch, device="cuda")
    fresh = torch.zeros(batch, dtype=torch.bool, device="cuda")
    one = [a[:, 0] for a in args[:5]]
    if layer == "gated_deltanet":
        heads = args[2].shape[2]
        ba = torch.randn(batch, 1, args[0].shape[2], 2 * heads // args[0].shape[2],
                         device="cuda", dtype=torch.bfloat16)
        a_log, dt_bias = torch.rand(heads, device="cuda"), torch.randn(heads, device="cuda")
        one[3:] = ba[:, 0], a_log, dt_bias
    if kind == "in_place":
        return seconds(lambda: IN_PLACE[layer](*one, table, rows, fresh), reps=20)
    if kind == "mamba_ssm":
        return mamba_ssm_decode(mamba_ssm()[0], args, table, rows)

    def gathered():
        scan = list(args[:5])
        if layer == "gated_deltanet":
            scan[3:] = recurrent_decode.delta_gates(ba, a_log, dt_bias)
        _, end = SCANS[layer](*scan, table[rows], "fla")
        table[rows] = end
    return seconds(gathered, reps=20)


def run(layer: str, kind: str, args) -> float:
    return seconds(lambda: SCANS[layer](*args[:5], args[5].clone(), kind), reps=20)


def extra(layer: str) -> tuple[str, ...]:
    return ("mamba_ssm",) if layer == "mamba2" and mamba_ssm() is not None else ()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--decode", default="1,8,64,256")
    ap.add_argument("--prompt", default="512,4096,32768")
    args = ap.parse_args()
    rate = copy_rate()
    print(f"{torch.cuda.get_device_name()}: copy {rate / 1e12:.2f} TB/s", flush=True)
    out = open(os.path.join(os.environ.get("OUT", "."), "recurrent_kernels.jsonl"), "a")
    for layer in SCANS:
        for batch in map(int, args.decode.split(",")):
            x = inputs(layer, batch, 1)
            floor = 2 * x[5].numel() * 4 / rate  # states read and written
            for kind in ("fla", "torch", "fla+rows", "in_place") + extra(layer):
                s = run(layer, kind, x) if kind in ("fla", "torch") else \
                    decode_rows(layer, kind, x)
                row = {"layer": layer, "phase": "decode", "batch": batch, "kernels": kind,
                       "us": s * 1e6, "floor_us": floor * 1e6, "fraction": floor / s}
                out.write(json.dumps(row) + "\n")
                print(f"{layer} decode {batch:4d} seqs {kind:>8}: {s * 1e6:9.1f} us (floor "
                      f"{floor * 1e6:.1f} us: {floor / s:.0%})", flush=True)
        for tokens in map(int, args.prompt.split(",")):
            x = inputs(layer, 1, tokens)
            for kind in ("fla", "torch") + extra(layer):
                s = mamba_ssm_prompt(mamba_ssm()[1], x) if kind == "mamba_ssm" else \
                    run(layer, kind, x)
                row = {"layer": layer, "phase": "prompt", "tokens": tokens, "kernels": kind,
                       "ms": s * 1e3, "tokens_per_s": tokens / s}
                out.write(json.dumps(row) + "\n")
                print(f"{layer} prompt {tokens:6d} tokens {kind:>5}: {s * 1e3:9.2f} ms "
                      f"({tokens / s:,.0f} tokens/s)", flush=True)


if __name__ == "__main__":
    main()
