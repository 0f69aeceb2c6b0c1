"""The sync benchmark's issue-32 scenarios, what needs no rank: the link sampler, the CPU-time slowdown, and the pure
summaries, verdicts, tables and plots of **streaming** (Streaming DiLoCo, Douillard et al. 2025: F fragments, delay
tau, against part 1's DiLoCo at the same H) and **hetero** (one host at half speed). :mod:`~.sync` runs them; method
and results: docs/benchmarks.md (``sync``).
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Optional, Sequence

import numpy as np
from lightning.pytorch.callbacks import Callback

from lightning_dist.benchmarks import _common as bench

# -- streaming's targets -------------------------------------------------------------------------------------------
STREAM_CODEC = "int4"  # the pseudo-gradient's codec of every streaming configuration
STREAM_HOSTS, STREAM_RATE = 4, 10.0  # flat: 4 hosts of 1 rank; Mbit/s
PEAK_WINDOW_S = 1.0  # the sliding window of the peak bytes per second
SAMPLE_EVERY_S = 0.02  # how often the link's counter is read during the timed cycles
PEAK_FACTOR = 20.0  # streaming's peak bytes/s at most 1/20 of the reference's
QUALITY_BOUND = 0.01  # final validation loss at most 1% above the reference's, at equal samples
EXPOSED_BOUND = 0.05  # the loop's wait for the exchange at most 5% of the step time, with tau >= 1
JUDGED_FRAGMENTS, JUDGED_DELAY = 4, 1  # the peak and quality targets: F >= 4 and tau >= 1

# -- the heterogeneous scenario ------------------------------------------------------------------------------------
HETERO_MODES = ("equal", "batches", "steps")  # equal batches (baseline), batches that follow speed, balance="steps"
# and, reported only: batches sized once from the measured speeds (HeteroBatching(speeds=...)), with no exchange of
# measurements on every step as rebalancing has: what that per-step meeting of every worker costs
FIXED_MODE = "fixed"
JUDGED_MODES = ("batches", "steps")
HETERO_BOUND = 1.10  # wall time per epoch at most 10% above the ideal
SLOW_HOST, SLOW_FACTOR = 3, 2.0  # the last host at half the others' speed
# Every host's compute stretched 2x, the slow host's 4x: 4 hosts in 1.75 of the 2 cores (unpaced, the "half-speed"
# host measured barely 10% slower: a sleeping host leaves its core to the others)
PACE = 2.0


def slowdowns(hosts: int) -> dict[int, float]:
    """:class:`CpuSlowdown`'s factors: :data:`PACE` for every host, ``PACE x SLOW_FACTOR`` for :data:`SLOW_HOST`."""
    return {h: PACE * (SLOW_FACTOR if h == SLOW_HOST else 1.0) for h in range(hosts)}


class CpuSlowdown(Callback):
    """:class:`~lightning_dist.testing.Slowdown` in CPU time: ``CpuSlowdown({3: 4.0})`` makes rank 3 take 4x its own
    compute (sleeping before each backward). Wall time would count the waits for other hosts too: under
    ``balance="steps"`` the sleeps grew without bound; CPU time is the host's own work."""

    def __init__(self, factors: dict[int, float]) -> None:
        bad = {r: f for r, f in factors.items() if not (isinstance(f, (int, float)) and f >= 1)}
        if bad:
            raise ValueError(f"CpuSlowdown factors {bad}: each must be >= 1 (2.0: twice as slow)")
        self.factors = dict(factors)
        self._since = 0.0  # the training thread's CPU seconds when the current forward window began
        self._backward: Optional[float] = None  # the previous backward pass's CPU seconds

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        self._since = time.thread_time()

    def on_before_backward(self, trainer: Any, pl_module: Any, loss: Any) -> None:
        forward = time.thread_time() - self._since
        factor = self.factors.get(trainer.global_rank, 1.0)
        if factor > 1.0:
            time.sleep((factor - 1.0) * (forward + (self._backward if self._backward is not None else 2 * forward)))
        self._since = time.thread_time()

    def on_after_backward(self, trainer: Any, pl_module: Any) -> None:
        now = time.thread_time()
        self._backward, self._since = now - self._since, now  # an inner step's forward window starts now


def stream_label(fragments: int, delay: int, codec: str) -> str:
    """A streaming configuration's name: ``F4/tau1/int4``."""
    return f"F{fragments}/tau{delay}/{codec}"


def judged(row: dict[str, Any]) -> bool:
    """Whether the peak-bandwidth and quality targets apply to a configuration: F >= 4 and tau >= 1."""
    return row["fragments"] >= JUDGED_FRAGMENTS and row["delay"] >= JUDGED_DELAY


class LinkSampler:
    """``samples`` of ``(perf_counter seconds, read())`` every ``interval_s`` on a daemon thread, from :meth:`start`
    to :meth:`stop`: a thread rather than the step hooks, because an overlapped exchange sends between steps."""

    def __init__(self, read: Callable[[], int], interval_s: float = SAMPLE_EVERY_S) -> None:
        self.read, self.interval_s = read, interval_s
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def _sample(self) -> None:
        self.samples.append((time.perf_counter(), self.read()))

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    def start(self) -> None:
        self._sample()
        self._thread = threading.Thread(target=self._run, name="link-sampler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
            self._sample()


# -- pure summaries: streaming ---------------------------------------------------------------------------------------
def peak_rate(samples: Sequence[Sequence[float]], window_s: float = PEAK_WINDOW_S
              ) -> tuple[Optional[float], Optional[float]]:
    """The peak bytes per second over sliding windows of ``window_s`` (readings spanning less: one window of their
    span), and the window used; ``(None, None)`` with under two readings or no time between them."""
    if len(samples) < 2:
        return None, None
    t, b = (np.array([s[i] for s in samples], dtype=float) for i in (0, 1))
    span = t[-1] - t[0]
    if span <= 0:
        return None, None
    window = min(window_s, span)
    # from each reading i to the first reading j at or after t_i + window (a hair under: the span ends at t_0 + span)
    j = np.searchsorted(t, t + window * (1 - 1e-9), side="left")
    i = np.nonzero(j < len(t))[0]
    return float(((b[j[i]] - b[i]) / (t[j[i]] - t[i])).max()), float(window)


def hidden_bandwidth(bytes_per_exchange: Optional[float], delay: int, nosync_step_s: Optional[float],
                     sync_step_s: Optional[float]) -> Optional[float]:
    """Bytes per second that hide a fragment's exchange: its bytes over the ``delay`` no-sync steps it overlaps (with
    no delay, over the sync step that carries it)."""
    span = delay * nosync_step_s if delay > 0 and nosync_step_s else sync_step_s if delay == 0 else None
    return bytes_per_exchange / span if bytes_per_exchange is not None and span else None


def nosync_step(ends_per_rank: Sequence[Sequence[float]], warmup: int) -> dict[str, Any]:
    """The step with no sync: per rank the mean step after ``warmup`` (hosts sharing cores run bursts of fast and slow
    steps, which a median splits; the synced step is a mean too, a cycle over H); ``step_s`` the slowest rank's."""
    per_rank = [(ends[-1] - ends[warmup]) / (len(ends) - 1 - warmup) if len(ends) > warmup + 1 else None
                for ends in ends_per_rank]
    known = [s for s in per_rank if s is not None]
    return {"per_rank_s": per_rank, "step_s": max(known) if known else None}


def stream_timing(config: dict[str, Any], cycles: Sequence[dict[str, Any]], ranks: Sequence[dict[str, Any]],
                  warm_cycles: int, nosync_step_s: Optional[float]) -> dict[str, Any]:
    """A configuration's shaped-cluster figures from every rank's :func:`~.sync.cycle_timing` and raw record (``ends``,
    ``trace`` of ``[step, sync/* metrics]``, rank 0's ``link_samples``), and the same cluster's no-sync step."""
    every, fragments, delay = config["every"], config["fragments"], config["delay"]
    first, last = warm_cycles * every, (len(ranks[0]["ends"]) // every) * every  # the timed steps are (first, last]
    timed = last - first
    slowest = int(np.argmax([c["per_step_s"] for c in cycles]))
    per_step = cycles[slowest]["per_step_s"]
    reports = [[m for step, m in r.get("trace", []) if first < step <= last] for r in ranks]
    waited = [sum(rep.get("sync/waited_s", 0.0) for rep in mine) / timed for mine in reports]
    seconds = [rep["sync/seconds"] for mine in reports for rep in mine if "sync/seconds" in rep]
    payload = [rep["sync/bytes_per_sync"] for rep in reports[0] if "sync/bytes_per_sync" in rep]
    exchanges = (timed // every) * fragments  # fragment exchanges started in the timed steps (a steady state)
    link_step = cycles[0]["link_bytes_per_step"]
    link_per_exchange = link_step * timed / exchanges if link_step is not None and exchanges else None
    samples = ranks[0].get("link_samples") or []
    peak, window = peak_rate(samples)
    local_step_s, sync_step_s = (max((c[k] for c in cycles if c[k] is not None), default=None)
                                 for k in ("local_step_s", "sync_step_s"))
    waited_step = max(waited) if waited else None
    exposed = per_step - nosync_step_s if nosync_step_s is not None else None
    return {"every": every, "fragments": fragments, "delay": delay, "timed_steps": timed,
            "timed_cycles": cycles[slowest]["timed_cycles"], "slowest_rank": slowest, "per_step_s": per_step,
            "per_rank_step_s": [c["per_step_s"] for c in cycles], "local_step_s": local_step_s,
            "sync_step_s": sync_step_s, "nosync_step_s": nosync_step_s, "waited_per_step_s": waited_step,
            "waited_fraction": bench.ratio(waited_step, per_step), "exposed_by_time_s": exposed,
            "exposed_by_time_fraction": bench.ratio(exposed, per_step), "exchange_s": bench.median(seconds),
            "reports": len(reports[0]), "exchanges": exchanges, "payload_bytes_per_exchange": bench.median(payload),
            "link_bytes_per_exchange": link_per_exchange, "link_bytes_per_step": link_step, "peak_bytes_per_s": peak,
            "peak_window_s": window, "link_readings": len(samples),
            "hidden_bytes_per_s": hidden_bandwidth(link_per_exchange, delay, nosync_step_s, sync_step_s),
            "error": None}


def stream_rows(curves: Sequence[dict[str, Any]], timings: Sequence[dict[str, Any]], reference: str
                ) -> list[dict[str, Any]]:
    """Per configuration: its final losses and shaped figures, and against the reference's: ``global_vs_ref``
    (``theta_global``'s loss, judged), ``loss_vs_ref`` (rank 0's model's), ``peak_vs_ref`` (peak bytes/s)."""
    timing = {t["label"]: t for t in timings}
    ref = next((c for c in curves if c["label"] == reference and not c.get("error")), {})
    ref_peak = timing.get(reference, {}).get("peak_bytes_per_s")

    def vs_ref(c: dict[str, Any], key: str) -> Optional[float]:
        value = bench.ratio(c.get(key), ref.get(key))
        return None if value is None else value - 1

    rows = []
    for c in curves:
        t = timing.get(c["label"], {"error": "not timed"})
        rows.append({**{k: c.get(k) for k in ("label", "every", "fragments", "delay", "codec", "final_loss",
                                             "global_loss")},
                     **{k: v for k, v in t.items() if k not in ("label", "every", "fragments", "delay")},
                     "curve_error": c.get("error"), "timing_error": t.get("error"),
                     "reference": c["label"] == reference, "loss_vs_ref": vs_ref(c, "final_loss"),
                     "global_vs_ref": vs_ref(c, "global_loss"),
                     "peak_vs_ref": bench.ratio(t.get("peak_bytes_per_s"), ref_peak)})
    return rows


def stream_targets(rows: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Issue 32's targets (docs/benchmarks.md): peak and quality for F >= 4 and tau >= 1, the exposed wait for tau >= 1
    (by ``sync/waited_s`` and by the step less the no-sync step); a target whose measurement is missing is absent."""
    out: dict[str, dict[str, Any]] = {}
    for r in (r for r in rows if not r["reference"]):
        if judged(r) and r["peak_vs_ref"] is not None:
            out[f"peak/{r['label']}"] = bench.target(r["peak_vs_ref"], 1 / PEAK_FACTOR)
        if judged(r) and r["global_vs_ref"] is not None:
            out[f"quality/{r['label']}"] = {**bench.target(r["global_vs_ref"], QUALITY_BOUND),
                                            "worker": r["loss_vs_ref"]}
        if r["delay"] >= 1 and r.get("waited_fraction") is not None:
            by_time = r.get("exposed_by_time_fraction")
            out[f"exposed/{r['label']}"] = {**bench.target(r["waited_fraction"], EXPOSED_BOUND), "by_time": by_time,
                                            "met": r["waited_fraction"] <= EXPOSED_BOUND and by_time is not None
                                            and by_time <= EXPOSED_BOUND}
    return out


def stream_target_lines(targets: dict[str, dict[str, Any]], rows: Sequence[dict[str, Any]], reference: str
                        ) -> list[str]:
    """A verdict per judged configuration and target (``not measured`` where a figure is missing)."""
    lines = []
    for r in (r for r in rows if not r["reference"] and judged(r)):
        codec = r["codec"] + ("" if r["codec"] == STREAM_CODEC else f" (in place of {STREAM_CODEC})")
        what, peak = f"F={r['fragments']}, tau={r['delay']}, {codec}", targets.get(f"peak/{r['label']}")
        lines.append(bench.judged(
            f"{STREAM_HOSTS} hosts @ {STREAM_RATE:g} Mbit/s: {what}: peak bytes/s on host 0's link <= "
            f"1/{PEAK_FACTOR:g} of {reference}'s", peak if peak and peak["value"] else None,
            lambda t: f"1/{1 / t['value']:.1f} of {reference}'s ({bench.cell(r['peak_bytes_per_s'], ',.1f', 1e-3)} "
                      "KB/s)"))
        lines.append(bench.judged(f"{what}: final val loss within {QUALITY_BOUND:.0%} of {reference}'s at equal "
                                  "samples", targets.get(f"quality/{r['label']}"), lambda t: f"theta_global "
                                  f"{t['value']:+.2%}; rank 0's own model {bench.cell(t['worker'], '+.2%')}"))
    for r in (r for r in rows if not r["reference"] and r["delay"] >= 1):
        lines.append(bench.judged(f"{r['label']}: exposed sync time <= {EXPOSED_BOUND:.0%} of the step time, by "
                                  "both measures", targets.get(f"exposed/{r['label']}"),
                                  lambda t: f"sync/waited_s {t['value']:.1%} of the step; the step less the no-sync "
                                            f"step {bench.cell(t['by_time'], '.1%')}"))
    return lines


def stream_table(rows: Sequence[dict[str, Any]]) -> str:
    """The streaming table: quality at equal samples, then the shaped cluster's figures."""
    out = []
    for r in rows:
        ref, ms = r["reference"], {k: bench.cell(r.get(k), ",.1f", 1e3) for k in (
            "per_step_s", "local_step_s", "nosync_step_s", "waited_per_step_s", "exposed_by_time_s", "exchange_s")}
        out.append([r["label"] + " (ref)" * ref, r["fragments"], r["delay"], r["codec"] or "dense",
                    bench.cell(r["global_loss"], ".4f"), "-" if ref else bench.cell(r["global_vs_ref"], "+.2%"),
                    bench.cell(r["final_loss"], ".4f"), "-" if ref else bench.cell(r["loss_vs_ref"], "+.2%"),
                    *list(ms.values())[:4], bench.cell(r.get("waited_fraction"), ".1%"), *list(ms.values())[4:],
                    *(bench.cell(r.get(k), ",.1f", 1e-3) for k in ("link_bytes_per_exchange", "peak_bytes_per_s")),
                    "-" if ref or not r["peak_vs_ref"] else f"1/{1 / r['peak_vs_ref']:.1f}",
                    bench.cell(r.get("hidden_bytes_per_s"), ",.1f", 1e-3),
                    (r["curve_error"] or r["timing_error"] or "")[:40]])
    headers = ["config", "F", "tau", "codec", "val loss (global)", "vs ref", "rank 0's", "vs ref", "step ms",
               "local step ms", "no-sync step ms", "waited ms/step", "waited/step", "step - no-sync ms", "exchange ms",
               "KB/exchange", "peak KB/s", "peak vs ref", "needed KB/s", "error"]
    return ("streaming: final val loss (nats/byte) at equal samples on loopback, of theta_global (the model every "
            "worker agrees on) and of rank 0's own model, after the fit (every exchange landed); on the shaped "
            "cluster the slowest worker's step (median cycle / H), its median local step, the step with no sync, the "
            "loop's wait for the exchanges (sync/waited_s) per step, the exchange's own time (sync/seconds, median), "
            f"host 0's link: bytes per fragment exchange, the peak over {PEAK_WINDOW_S:g} s windows, and the "
            "bandwidth that hides the exchange (bytes / (tau x no-sync step); tau = 0: / the sync step)\n"
            + bench.format_table(headers, out))


def stream_plot(curves: Sequence[dict[str, Any]], rows: Sequence[dict[str, Any]], reference: str) -> Any:
    """Per configuration: peak bytes/s on host 0's link (log; the target drawn across, the bandwidth that hides each
    exchange as a dot), and validation loss against samples."""
    fig, (bars, losses) = bench.figure_row(2, 14.0, 4.8)
    timed = [r for r in rows if r.get("peak_bytes_per_s")]
    xs = range(len(timed))
    bars.bar(xs, [r["peak_bytes_per_s"] / 1e3 for r in timed],
             color=["grey" if r["reference"] else "C0" if judged(r) else "C9" for r in timed])
    bars.bar([], [], color="C0", label=f"judged: F >= {JUDGED_FRAGMENTS}, tau >= {JUDGED_DELAY}")
    hidden = [(x, r["hidden_bytes_per_s"] / 1e3) for x, r in zip(xs, timed) if r.get("hidden_bytes_per_s")]
    if hidden:
        bars.plot(*zip(*hidden), "kD", ms=4, label="bandwidth that hides the exchange")
    for r in (r for r in timed if r["reference"]):
        bars.axhline(r["peak_bytes_per_s"] / 1e3, color="grey", ls=":", lw=1, label=f"{reference}'s peak")
        bars.axhline(r["peak_bytes_per_s"] / 1e3 / PEAK_FACTOR, color="red", ls="--", lw=1,
                     label=f"target: 1/{PEAK_FACTOR:g} of it")
    bars.set_xticks(list(xs), [r["label"] for r in timed], rotation=45, ha="right", fontsize="small")
    bench.style(bars, "y", "x-small", yscale="log", title=f"peak bandwidth, {STREAM_HOSTS} hosts @ {STREAM_RATE:g} "
                f"Mbit/s", ylabel=f"KB/s on host 0's link (peak over {PEAK_WINDOW_S:g} s windows; log)")
    for i, c in enumerate(c for c in curves if not c.get("error") and c.get("curve_steps")):
        style = dict(color="k", lw=2) if c["label"] == reference else dict(color=f"C{i % 10}", lw=1.1)
        losses.plot(np.array(c["curve_steps"]) * c["samples_per_step"], c["curve_loss"], label=c["label"], **style)
        if c.get("global_loss") is not None:
            losses.plot(c["curve_steps"][-1] * c["samples_per_step"], c["global_loss"], "o", ms=5, mfc="none",
                        color=style["color"])
    losses.plot([], [], "ko", mfc="none", label="theta_global at the end")
    bench.style(losses, xlabel="samples (windows, all workers)", ylabel="val loss, nats/byte",
                title="validation loss against samples (loopback; lines: rank 0's model)")
    losses.legend(fontsize="x-small", ncol=2)
    return fig


# -- pure summaries: heterogeneous workers ---------------------------------------------------------------------------
def own_speeds(ranks: Sequence[dict[str, Any]], warmup: int) -> list[Optional[float]]:
    """Every host's own samples per second (median batch / median step; None: no step counted) in a fit where no host
    waits for another, over the steps while every host was past ``warmup`` steps and none had finished."""
    begin = max(r["ends"][min(warmup, len(r["ends"]) - 1)] for r in ranks)
    cutoff = min(r["ends"][-1] for r in ranks)
    speeds: list[Optional[float]] = []
    for ends, samples in ((r["ends"], r["samples"]) for r in ranks):
        kept = [i for i in range(1, len(ends)) if begin <= ends[i - 1] and ends[i] <= cutoff]
        step = bench.median([ends[i] - ends[i - 1] for i in kept])
        speeds.append(bench.median([samples[i] for i in kept]) / step if step else None)
    return speeds


def epoch_figures(ranks: Sequence[dict[str, Any]], epoch: int) -> dict[str, Any]:
    """Epoch ``epoch``'s wall time (first batch's start to last batch's end, on any host), samples, and per host its
    samples and batches."""
    mine = [[i for i, e in enumerate(r["epochs"]) if e == epoch] for r in ranks]
    if not all(mine):
        return {"epoch": epoch, "wall_s": None, "samples": 0, "per_rank_samples": [], "per_rank_batches": []}
    samples = [sum(r["samples"][i] for i in m) for r, m in zip(ranks, mine)]
    return {"epoch": epoch, "wall_s": max(r["ends"][m[-1]] for r, m in zip(ranks, mine))
            - min(r["starts"][m[0]] for r, m in zip(ranks, mine)), "samples": sum(samples),
            "per_rank_samples": samples, "per_rank_batches": [len(m) for m in mine]}


def hetero_row(mode: str, ranks: Sequence[dict[str, Any]], speeds: Sequence[Optional[float]],
               timed_epochs: Sequence[int]) -> dict[str, Any]:
    """A mode's median timed epoch: its wall time and the ideal, its samples at the hosts' summed own speeds."""
    epochs = [epoch_figures(ranks, e) for e in timed_epochs]
    done = [e for e in epochs if e["wall_s"] is not None]
    if not done:
        return {"mode": mode, "error": f"no timed epoch ran (epochs {list(timed_epochs)})"}
    median = sorted(done, key=lambda e: e["wall_s"])[(len(done) - 1) // 2]  # the lower median: an epoch that ran
    ideal = bench.ratio(median["samples"], sum(speeds) if all(s is not None for s in speeds) else None)
    return {"mode": mode, "epochs": epochs, **{k: median[k] for k in ("wall_s", "samples", "per_rank_samples",
                                                                      "per_rank_batches")},
            "ideal_s": ideal, "ratio": bench.ratio(median["wall_s"], ideal), "error": None}


def hetero_targets(rows: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Within 10% of the ideal under batches that follow speed and under ``balance="steps"``."""
    return {f"hetero/{r['mode']}": bench.target(r["ratio"], HETERO_BOUND) for r in rows
            if r["mode"] in JUDGED_MODES and r.get("ratio") is not None}


def hetero_target_lines(targets: dict[str, dict[str, Any]], rows: Sequence[dict[str, Any]]) -> list[str]:
    described = {"batches": "batches that follow speed (HeteroBatching)", "steps": 'DiLoCo(balance="steps")'}
    lines = []
    for mode in JUDGED_MODES:
        t, row = targets.get(f"hetero/{mode}"), next((r for r in rows if r["mode"] == mode), {})
        lines.append(bench.verdict(f"one host at half speed, {described[mode]}: wall time per epoch within "
                                   f"{HETERO_BOUND - 1:.0%} of the ideal", bool(t and t["met"]),
                                   f"{t['value']:.3f}x the ideal" if t else row.get("error") or "not measured"))
    return lines


def hetero_table(rows: Sequence[dict[str, Any]], speeds: Sequence[Optional[float]]) -> str:
    out = [[r["mode"], "not run" if r.get("skipped") else "FAILED", "-", "-", "-", "-", "-", r["error"][:60]]
           if r.get("error") else
           [r["mode"], f"{r['wall_s']:.2f}", r["samples"], bench.cell(r["ideal_s"], ".2f"),
            bench.cell(r["ratio"], ".3f", unit="x"), " / ".join(map(str, r["per_rank_samples"])),
            " / ".join(map(str, r["per_rank_batches"])), ""] for r in rows]
    headers = ["mode", "epoch s", "samples", "ideal s", "vs ideal", "samples per host", "batches per host", "error"]
    own = " / ".join(bench.cell(s, ",.0f") for s in speeds)
    return (f"one host (host {SLOW_HOST}) at 1/{SLOW_FACTOR:g} the others' speed (CpuSlowdown "
            f"{slowdowns(len(speeds))}): wall time per epoch (median of the timed epochs) against the ideal, the "
            f"epoch's samples over the hosts' own throughput ({own} windows/s, measured in a fit where no host waits "
            "for another)\n" + bench.format_table(headers, out))


def hetero_plot(rows: Sequence[dict[str, Any]], speeds: Sequence[Optional[float]]) -> Any:
    """Per mode: the wall time per epoch against its ideal, and each host's samples against the own-speed split."""
    fig, (walls, shares) = bench.figure_row(2, 11.0, 4.4)
    done = [r for r in rows if not r.get("error")]
    xs = range(len(done))
    walls.bar(xs, [r["wall_s"] for r in done], color=["C3" if r["mode"] == "equal" else "C0" for r in done])
    ideal = [(x, r["ideal_s"]) for x, r in zip(xs, done) if r["ideal_s"]]
    if ideal:
        walls.plot(*zip(*ideal), "k_", ms=30, mew=2, label="ideal")
        walls.plot(*zip(*[(x, HETERO_BOUND * v) for x, v in ideal]), "r_", ms=30, mew=1,
                   label=f"target: {HETERO_BOUND:.2f}x ideal")
    walls.set_xticks(list(xs), [r["mode"] for r in done])
    bench.style(walls, "y", "x-small" if ideal else None, ylabel="wall time per epoch, s",
                title="epoch time against the ideal")
    width, hosts = 0.8 / (len(done) + 1), range(len(speeds))
    if all(s is not None for s in speeds) and done:
        shares.bar([h - 0.4 + width / 2 for h in hosts], [s / sum(speeds) * done[0]["samples"] for s in speeds],
                   width, color="k", alpha=0.3, label="by own speed (ideal)")
    for k, r in enumerate(done, start=1):
        shares.bar([h - 0.4 + width / 2 + k * width for h in hosts], r["per_rank_samples"], width, label=r["mode"])
    shares.set_xticks(list(hosts), [f"host {h}" + (" (slow)" if h == SLOW_HOST else "") for h in hosts])
    bench.style(shares, "y", "x-small", ylabel="samples (windows) in the epoch", title="who trained what")
    return fig
