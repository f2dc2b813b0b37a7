"""Results: the JSON document, the terminal table, and the PNG chart."""
from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
import sys
import textwrap
from typing import Optional

LATENCIES = (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"),
             ("e2e_latency_ms", "E2E latency"), ("queue_wait_ms", "queue wait"))


def machine_info(device) -> dict:
    import torch
    import transformers

    from roseinfer.layers.cpu_linear import cpu_model

    info = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "platform": platform.platform(), "python": platform.python_version(),
            "cpu": cpu_model(), "cpu_count": os.cpu_count(),
            "load_avg_1m_at_start": os.getloadavg()[0],
            "torch": torch.__version__, "transformers": transformers.__version__,
            "device": str(device), "git_commit": _git_commit()}
    if torch.device(device).type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


def _git_commit() -> Optional[str]:
    """Short HEAD commit, with "+dirty" when the work tree has uncommitted changes."""
    def git(*cmd):
        return subprocess.run(["git", *cmd], capture_output=True, text=True, timeout=5,
                              cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    try:
        head = git("rev-parse", "--short", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return None
    return (head + ("+dirty" if dirty else "")) or None


def command_line(argv: Optional[list[str]]) -> str:
    import shlex
    return "roseinfer " + shlex.join(sys.argv[1:] if argv is None else argv)


def write_json(result: dict, path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=2)
        f.write("\n")


def _fmt(v, digits=1) -> str:
    return "–" if v is None else f"{v:,.{digits}f}"


def print_report(result: dict, console=None) -> None:
    """Two compact tables: throughput beside transformers', then our latency percentiles."""
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    ours = result["roseinfer"]["summary"]
    hf = {k: v["summary"] for k, v in result.get("hf", {}).items() if "summary" in v}
    meta = result["meta"]
    title = f"bench {meta['mode']}: {meta['model']}, mean of {ours.get('num_runs', 0):.0f} run(s)"
    tput = Table(title=title)
    for col in ("", "roseinfer", *[f"HF {n}" for n in hf]):
        tput.add_column(col, justify="right" if col else "left")
    for key, label, digits in (("output_throughput", "completion tok/s", 1),
                               ("total_token_throughput", "total tok/s", 1),
                               ("duration_s", "duration s", 3)):
        tput.add_row(label, _fmt(ours.get(key), digits),
                     *[_fmt(s.get(key), digits) for s in hf.values()])
    console.print(tput)
    lat = Table()
    for col in ("roseinfer ms", "mean", "p50", "p95", "p99"):
        lat.add_column(col, justify="right" if col != "roseinfer ms" else "left")
    for key, label in LATENCIES:
        d = ours.get(key) or {}
        lat.add_row(label, *[_fmt(d.get(p), 2) for p in ("mean", "p50", "p95", "p99")])
    steps = ours.get("engine_steps") or {}
    if steps.get("num_steps"):
        lat.add_row(f"engine step ({steps['num_steps']:.0f})", _fmt(steps.get("step_ms_mean"), 2),
                    _fmt(steps.get("step_ms_p50"), 2), "", _fmt(steps.get("step_ms_p99"), 2))
    console.print(lat)
    if "bytes_floor" in result:
        f = result["bytes_floor"]
        console.print(f"decode bytes floor at {f['peak_bytes_per_s'] / 1e12:.2f} TB/s: "
                      f"{f['output_throughput']:,.1f} completion tok/s; roseinfer reaches "
                      f"[bold]{100 * f['fraction']:.1f} %[/] of it")
    if "offline_ratio" in result:
        off = result["offline"]["summary"]["output_throughput"]
        console.print(f"through Redis / engine alone ({off:,.1f} completion tok/s): "
                      f"[bold]{result['offline_ratio']:.2f}x[/]")
    for name, ratio in result.get("ratios", {}).items():
        console.print(f"roseinfer / transformers {name}: [bold]{ratio:.2f}x[/] completion tok/s")
    for name, v in result.get("hf", {}).items():
        if "skipped" in v:
            console.print(f"transformers {name}: skipped ({v['skipped']})")


# --- the chart -------------------------------------------------------------------------

def require_matplotlib() -> None:
    import importlib.util
    if importlib.util.find_spec("matplotlib") is None:
        raise SystemExit("--plot needs matplotlib: pip install -e '.[bench]' (or pip install "
                         "matplotlib); the JSON from --output-json can be plotted later with "
                         "`roseinfer bench plot`")


def plot(results: list[dict], labels: list[str], path: str) -> None:
    """Left: completion tok/s of roseinfer and each transformers variant, per result.
    Right: roseinfer's latency percentiles (p50/p95/p99), per result."""
    require_matplotlib()
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 4.8))
    _throughput_bars(left, results, labels)
    _latency_bars(right, results, labels)
    first = results[0]["meta"]
    fig.suptitle(f"roseinfer bench — {first.get('gpu') or first.get('cpu')} — {first['date'][:10]}")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _series(results: list[dict]) -> dict[str, list]:
    names = ["roseinfer"] + sorted({n for r in results for n, v in r.get("hf", {}).items()
                                    if "summary" in v})
    out = {}
    for name in names:
        out[name] = [(r["roseinfer"]["summary"] if name == "roseinfer" else
                      r.get("hf", {}).get(name, {}).get("summary", {})).get("output_throughput")
                     for r in results]
    return out


def _throughput_bars(ax, results, labels) -> None:
    series = _series(results)
    width = 0.8 / len(series)
    for k, (name, values) in enumerate(series.items()):
        xs = [i + (k - (len(series) - 1) / 2) * width for i in range(len(results))]
        ys = [float("nan") if v is None else v for v in values]
        bars = ax.bar(xs, ys, width, label=name if name == "roseinfer" else f"transformers {name}")
        ax.bar_label(bars, labels=[_fmt(v, 0) for v in values], fontsize=7)
    ax.set_xticks(range(len(results)), [textwrap.fill(x, 18) for x in labels], fontsize=8)
    ax.set_ylabel("completion tokens / s")
    ax.set_title("throughput (prefill included)")
    ax.legend(fontsize=8)


def _latency_bars(ax, results, labels) -> None:
    keys = [(k, name) for k, name in LATENCIES[:4]]
    width = 0.8 / len(results)
    for j, (r, label) in enumerate(zip(results, labels)):
        s = r["roseinfer"]["summary"]
        for p, alpha in (("p99", 0.35), ("p95", 0.6), ("p50", 1.0)):
            xs = [i + (j - (len(results) - 1) / 2) * width for i in range(len(keys))]
            ys = [_or_nan((s.get(k) or {}).get(p)) for k, _ in keys]
            # Workload colours (Dark2) differ from the left panel's engine colours (C0, C1...).
            ax.bar(xs, ys, width, alpha=alpha, color=plt_colors(j),
                   label=f"{label} {p}" if len(results) < 4 or p == "p50" else None)
    ax.set_xticks(range(len(keys)), [name for _, name in keys])
    ax.set_yscale("log")
    ax.set_ylabel("ms (log)")
    ax.set_title("roseinfer latency p50 / p95 / p99")
    ax.legend(fontsize=7)


def _or_nan(v) -> float:
    return float("nan") if v is None else v


def plt_colors(j: int):
    import matplotlib
    return matplotlib.colormaps["Dark2"](j % 8)
