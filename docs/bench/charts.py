"""The real-shape charts of docs/benchmarks.md, from the JSON in docs/bench/h100/:
latency against arrival rate through Redis, and each real-shape run's completion
throughput against its decode bytes floor.

    python3 docs/bench/charts.py
"""
import json
import pathlib

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = pathlib.Path(__file__).parent
RUNS = HERE / "h100"


def load(name):
    return json.loads((RUNS / name).read_text())


def _rates(prefix):
    """{rate: summary} of the runs named ``{prefix}{rate}.json``."""
    runs = {int(p.stem.removeprefix(prefix)): p.name for p in RUNS.glob(f"{prefix}*.json")
            if p.stem.removeprefix(prefix).isdigit()}
    return {r: load(runs[r])["roseinfer"]["summary"] for r in sorted(runs)}


def latency_vs_rate():
    series = [("Llama-1B shape", "rate-", "tab:blue"),
              ("Llama-1B, eager mixed steps (earlier run)", "rate-eager-", "tab:gray"),
              ("SmolLM2 shape", "rate-smollm2-random-", "tab:green")]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, key, title in ((axes[0], "ttft_ms", "TTFT"), (axes[1], "tpot_ms", "TPOT")):
        for label, prefix, color in series:
            runs = _rates(prefix)
            for p, style in (("p50", "o-"), ("p99", "s--")):
                ax.plot(list(runs), [s[key][p] for s in runs.values()], style, color=color,
                        label=f"{label} {p}")
        ax.set(xscale="log", xlabel="arrival rate (requests/s, Poisson)", ylabel="ms",
               title=f"{title}: 512 -> 128 tokens, through Redis, one H100")
        ax.set_xticks([10, 20, 40, 80, 160, 320, 640], ["10", "20", "40", "80", "160", "320", "640"])
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(HERE / "h100-latency-vs-rate.png", dpi=110)


def throughput_vs_floor():
    """Each real-shape row at one commit (final/), against the landed engine before the
    real-shape work where it was run, and transformers in the same process where it runs."""
    rows = [("8B x1", "8b-b1", 90), ("8B x64", "8b-b64", 80), ("8B x128", "8b-b128", 75),
            ("1B x1", "1b-b1", 80), ("1B x256", "1b-b256", 65), ("1B nano T0.6", "nano-t06", 45000)]
    before = {"8B x64": "real-old-8b-b64.json", "1B x1": "real-old-1b-b1.json",
              "1B x256": "real-old-1b-b256.json"}
    fig, ax = plt.subplots(figsize=(10, 4))
    for i, (label, name, target) in enumerate(rows):
        r = load(f"final/{name}.json")
        floor = r["bytes_floor"]["output_throughput"]
        bars = [("now", r["roseinfer"]["summary"], "tab:blue", 0.0)]
        if label in before:
            bars.append(("landed 78e744e (earlier run)", load(before[label])["roseinfer"]["summary"],
                         "tab:gray", -0.27))
        if r.get("hf"):
            bars.append(("transformers generate, same run", r["hf"]["dynamic"]["summary"],
                         "tab:orange", 0.27))
        for key, summary, color, dx in bars:
            ax.bar(i + dx, 100 * summary["output_throughput"] / floor, 0.27, color=color,
                   label=key if key not in ax.get_legend_handles_labels()[1] else None)
        target = target if target <= 100 else 100 * target / floor  # nano's is in tok/s
        ax.plot([i - 0.42, i + 0.42], [target, target], "k--", lw=1,
                label="target" if i == 0 else None)
    ax.set_xticks(range(len(rows)), [label for label, _, _ in rows])
    ax.set(ylabel="% of the decode bytes floor (3.0 TB/s)", ylim=(0, 100),
           title="Completion throughput against the decode bytes floor, one H100 (prefill included)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(HERE / "h100-real-shapes.png", dpi=110)


if __name__ == "__main__":
    latency_vs_rate()
    throughput_vs_floor()
