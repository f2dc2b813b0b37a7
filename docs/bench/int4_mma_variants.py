"""The 4-bit kernel (layers/int4_mma.cu) of this tree against the one of the tree in .base
(`git archive REV roseinfer | tar -x -C .base`), each built under a namespace of its own,
side by side in one process on the Llama-3-8B shapes: each one's best config and split,
and its largest difference from the older build's product. This tree's runs twice:
launched plainly and as programmatic dependents (as a decode step launches it), so that
back-to-back calls overlap their first weight reads with the call before.

Usage: python docs/bench/int4_mma_variants.py [--rows 1,16] [--output-json F]
"""
import argparse
import json
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

import torch

from bandwidth import copy_rate
from int4_mma_sweep import SPLITS, packed
from linear_shapes import COPIES, SHAPES, per_call
from roseinfer.layers import int4_mma
from roseinfer.layers.extensions import build_library

BEFORE = Path(".base/roseinfer/layers/int4_mma.cu")
# name: (source, launched as dependents); an older source takes no such argument
VARIANTS = {"before": (BEFORE, None), "after": (int4_mma.SOURCE, False),
            "after, dependent": (int4_mma.SOURCE, True)}


def build(source: Path) -> str:
    """The source's ops under a namespace of its own (its name)."""
    namespace = "roseinfer_int4_" + ("before" if source == BEFORE else "after")
    folder = Path(tempfile.gettempdir()) / "int4_variants"
    folder.mkdir(exist_ok=True)
    copy = folder / f"{namespace}.cu"
    copy.write_text(source.read_text().replace("roseinfer_int4", namespace))
    arch = "".join(map(str, torch.cuda.get_device_capability()))
    build_library(copy, namespace, ("-O3",), f"sm_{arch}", namespace,
                  ("-O3", f"-gencode=arch=compute_{arch},code=sm_{arch}"))
    return namespace


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--rows", default="1,16")
    p.add_argument("--output-json")
    args = p.parse_args()
    rows = [int(r) for r in args.rows.split(",")]
    start = time.time()
    sources = {source for source, _ in VARIANTS.values()}
    with ProcessPoolExecutor(len(sources), mp_context=get_context("spawn")) as pool:
        list(pool.map(build, sources))
    ops = {name: getattr(torch.ops, build(source)) for name, (source, _) in VARIANTS.items()}
    print(f"built in {time.time() - start:.0f} s", flush=True)
    rate = copy_rate()
    print(f"copy rate {rate / 1e12:.2f} TB/s", flush=True)
    w = int4_mma.workspace(torch.device("cuda"))
    out = {}
    for shape, (n, k) in SHAPES.items():
        gen = torch.Generator("cuda").manual_seed(n + k)
        weights = [packed(n, k, 128, gen)[1] for _ in range(COPIES)]
        floor = (n * k / 2 + 2 * 2 * n * k / 128) / rate * 1e3
        for m in rows:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
            reference = None
            for name, op in ops.items():
                flag = () if VARIANTS[name][1] is None else (VARIANTS[name][1],)
                times = {}
                for config in int4_mma.CONFIGS:
                    for splits in SPLITS:
                        if splits * m * n > int4_mma.PARTIALS or \
                                not int4_mma.fits(config, splits, n, k):
                            continue
                        call = (lambda i, c=config, s=splits:
                                op.mm(x, *weights[i], w.partials, w.counters, c, s, *flag))
                        times[f"c{config}_s{splits}"] = per_call(call)
                best = min(times, key=times.get)
                y = op.mm(x, *weights[0], w.partials, w.counters, 0, 1, *flag).float()
                reference = y if reference is None else reference
                diff = ((y - reference).abs().max() / reference.abs().max()).item()
                out[f"{shape}/m{m}/{name}"] = {"best": best, "ms": times[best],
                                               "floor_ms": floor, "all": times,
                                               "diff_from_before": diff}
                print(f"  {shape} m{m} {name:17s} best {times[best] * 1e3:6.1f} us "
                      f"({best}), {floor / times[best]:.0%} of floor, diff {diff:.2e}",
                      flush=True)
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
