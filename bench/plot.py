"""Plots of a gpuhealth benchmark run: python3 bench/plot.py RESULTS.json

Writes <label>-quarantine.png (time to quarantine: gpuhealth against the
floor), <label>-memory.png (operator RSS against node count,
with the large fleet's where it was built) and, where the
peer ran, <label>-peer.png (time from the node condition to the first
action against fleet size, gpuhealth and Medik8s Node Healthcheck) and,
where it was measured, <label>-detection.png (from the Xid reaching a real
agent to the cordon, kernel log and NVML paths) next to the JSON.
"""

import json
import pathlib
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib import ticker  # noqa: E402


def plain_log_ticks(axis):
    """Log scale, its labels as plain numbers at 1, 2 and 5 of each decade
    (matplotlib's own labels every minor tick overlap)."""
    axis.set_major_locator(ticker.LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    axis.set_major_formatter(ticker.FuncFormatter(lambda v, _: "%g" % v))
    axis.set_minor_formatter(ticker.NullFormatter())


def cdf(ax, seconds, label):
    xs = sorted(seconds)
    ys = [(i + 1) / len(xs) for i in range(len(xs))]
    ax.step([x * 1000 for x in xs], ys, where="post", label=label)


def main(path):
    path = pathlib.Path(path)
    r = json.loads(path.read_text())
    out = path.parent
    label = r["label"]

    ttq = r["time_to_quarantine"]
    fig, ax = plt.subplots(figsize=(7, 4))
    cdf(ax, ttq["gpuhealth_seconds"], "gpuhealth (p99 %.0f ms)" % (ttq["gpuhealth"]["p99"] * 1000))
    cdf(ax, ttq["floor_seconds"], "floor: a bare watcher (p99 %.0f ms)" % (ttq["floor"]["p99"] * 1000))
    ax.set_xlabel("GPU report written to cordon seen (ms)")
    ax.set_ylabel("fraction of faults")
    ax.set_title("Time to quarantine, %d faults each, %d nodes" % (ttq["gpuhealth"]["n"], r["nodes"]))
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(out / ("%s-quarantine.png" % label), dpi=100)

    fig, ax = plt.subplots(figsize=(7, 4))
    points = r["memory"]
    idle = [p for p in points[:2]]
    ax.plot([p["nodes"] for p in idle], [p["rss_mib"] for p in idle], "o-", label="idle")
    for p in points[2:]:
        ax.plot([p["nodes"]], [p["rss_mib"]], "s", label="idle, %d pods" % p["pods"])
    large = r.get("large", {}).get("memory", [])
    if large:
        ax.plot(
            [p["nodes"] for p in large],
            [p["rss_mib"] for p in large],
            "D-",
            label="idle, a fresh operator, nodes added with no pods",
        )
    ax.axhline(64, color="grey", linestyle="--", linewidth=1, label="target")
    ax.plot([r["nodes"]], [r["storm"]["peak_rss_mib"]], "^", label="peak in the storm")
    ax.set_xlabel("nodes")
    ax.set_ylabel("operator RSS (MiB)")
    ax.set_ylim(bottom=0)
    ax.set_title("Operator memory against fleet size")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(out / ("%s-memory.png" % label), dpi=100)
    wrote = ["%s-quarantine.png" % label, "%s-memory.png" % label]
    if peer_plot(r, out):
        wrote.append("%s-peer.png" % label)
    if detection_plot(r, out):
        wrote.append("%s-detection.png" % label)
    print("wrote %s in %s" % (", ".join(wrote), out))


def peer_plot(r, out):
    """Time to first action against fleet size, p50 and p99, for both."""
    sizes = sorted(r.get("peer", {}).get("sizes", []), key=lambda s: s["nodes"])
    if not sizes:
        return False
    fig, ax = plt.subplots(figsize=(7, 4))
    nodes = [s["nodes"] for s in sizes]
    for key, name, colour in [("gpuhealth", "gpuhealth (cordon)", "C0"),
                              ("nhc", "Medik8s NHC (remediation object)", "C1")]:
        for q, style in [("p50", "o-"), ("p99", "s--")]:
            ys = [s[key]["first_action"][q] * 1000 for s in sizes]
            ax.plot(nodes, ys, style, color=colour, label="%s, %s" % (name, q))
    ax.set_xscale("log")
    ax.set_yscale("log")
    plain_log_ticks(ax.xaxis)
    plain_log_ticks(ax.yaxis)
    ax.set_xlabel("nodes in the fleet")
    ax.set_ylabel("GpuHealthy=False seen to first action seen (ms)")
    ax.set_title("Time to first action against fleet size, same signal, same API server")
    ax.grid(alpha=0.3, which="both")
    ax.legend(loc="upper left", fontsize="small")
    fig.tight_layout()
    fig.savefig(out / ("%s-peer.png" % r["label"]), dpi=100)
    return True


def detection_plot(r, out):
    """From the Xid's write to the cordon, per path, beside the time to
    quarantine from the report alone."""
    d = r.get("detection") or {}
    paths = [(d.get(key) or {}, name) for key, name in
             [("kernel_log", "kernel log"), ("nvml", "NVML event")]]
    if not any(p.get("seconds") for p, _ in paths):
        return False
    fig, ax = plt.subplots(figsize=(7, 4))
    for p, name in paths:
        if p.get("seconds"):
            cdf(ax, p["seconds"], "Xid in the %s to cordon (p99 %.0f ms)"
                % (name, p["to_cordon"]["p99"] * 1000))
    ttq = r["time_to_quarantine"]
    if ttq["gpuhealth_seconds"]:
        cdf(ax, ttq["gpuhealth_seconds"], "report written to cordon (p99 %.0f ms)"
            % (ttq["gpuhealth"]["p99"] * 1000))
    ax.set_xscale("log")
    plain_log_ticks(ax.xaxis)
    ax.set_xlabel("time to cordon seen (ms)")
    ax.set_ylabel("fraction of faults")
    ax.set_title("From the Xid to the cordon, %d real agents, %d nodes"
                 % (d["agents"], r["nodes"]))
    ax.grid(alpha=0.3, which="both")
    ax.legend(loc="upper left", fontsize="small")
    fig.tight_layout()
    fig.savefig(out / ("%s-detection.png" % r["label"]), dpi=100)
    return True


if __name__ == "__main__":
    main(sys.argv[1])
