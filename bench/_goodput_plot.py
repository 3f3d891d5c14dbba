"""bench/goodput.py --plot: useful steps over time of every fault run, one panel per fault rate, faults marked."""

from __future__ import annotations

from typing import Dict, Tuple

COLORS = {"torchrun": "tab:orange", "elastic-run": "tab:blue", "torchft": "tab:green", "torchft-defaults": "tab:olive"}
LABELS = {"torchft": "TorchFT, example settings", "torchft-defaults": "TorchFT, library defaults"}


def plot(path: str, args, faulty: Dict[Tuple[str, float], object]) -> None:
    """Writes ``path`` from goodput.py's fault runs (RunResult by system and --every): for each --every, the held steps completed by each second of each
    system's fault run (a restore shows as a flat stretch: those steps are done again), and a
    dashed line of that system's colour at each of its SIGKILLs."""
    import matplotlib

    matplotlib.use("Agg")   # no display needed
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(args.every), 1, figsize=(9, 3.2 * len(args.every)), squeeze=False)
    for ax, every in zip(axes[:, 0], args.every):
        for launcher in args.launchers:
            r = faulty[(launcher, every)]
            color = COLORS.get(launcher)
            times = [t - r.t0 for t in r.timeline]
            ax.step([0.0, *times], range(len(times) + 1), where="post", color=color,
                    label=f"{LABELS.get(launcher, launcher)} ({r.final / r.seconds:.2f} useful steps/s)")
            for f in r.faults:
                ax.axvline(f.t - r.t0, color=color, linestyle="--", linewidth=0.8, alpha=0.7)
        sharded = ", FSDP2" if getattr(args, "fsdp", False) else ""
        ax.set_title(f"{args.workers} workers{sharded}, one SIGKILL every {every:g} s (dashed: the faults)")
        ax.set_xlim(0, args.duration)
        ax.set_xlabel("seconds since the run's first step")
        ax.set_ylabel("useful steps")
        ax.legend(loc="upper left", fontsize="small")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
