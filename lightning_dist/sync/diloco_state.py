"""DiLoCo's checkpoint state: what a resume needs, what every rank holds alike, each rank's and each worker's part.

The part of :class:`~lightning_dist.sync.diloco.DiLoCoSync` a checkpoint saves and restores; docs/sync.md
("Checkpoints, validation and memory") says what a resumed run continues from.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any, Optional

import torch

from lightning_dist.comm import CommStats
from lightning_dist.comm.stats import CallRecord
from lightning_dist.sync.buckets import host_copy
from lightning_dist.sync.diloco_exchange import Exchange, Exchanges
from lightning_dist.sync.diloco_fragments import Schedule, SyncedModel
from lightning_dist.sync.diloco_outer import OuterStep
from lightning_dist.sync.diloco_settings import DiLoCoSettings


class SyncState:
    """Reads and writes the state of a sync's parts: the schedule's samples counts, the exchanges in flight and the
    outer step's ``theta_global``, momentum and averaged buffers (tensors by name)."""

    def __init__(self, settings: DiLoCoSettings, schedule: Schedule, exchanges: Exchanges, outer: OuterStep) -> None:
        self.settings = settings
        self.schedule = schedule
        self.exchanges = exchanges
        self.outer = outer
        self.model: Optional[SyncedModel] = None  # set at attach

    def state_dict(self) -> dict[str, Any]:
        """What every rank holds alike, the exchanges in flight that are settled with their reduced sums (the others
        are dropped: their samples count towards their fragment's next sync)."""
        model, outer, workers = self.model, self.outer, self.schedule.workers
        momentum = {}
        for name, g in zip(model.names, outer.theta):
            buf = outer.momentum(g)
            if buf is not None:
                momentum[name] = buf.detach().clone()
        samples = [list(f.samples) for f in self.schedule.fragments]
        inflight = []
        for ex in self.exchanges.inflight:
            if not ex.settled:  # dropped, its samples back to its fragment's count
                samples[ex.fragment.index] = [a + b for a, b in zip(samples[ex.fragment.index], ex.samples)]
                continue
            inflight.append({"fragment": ex.fragment.index, "step": ex.step, "lands": ex.lands, "norm": ex.norm,
                             "rate": ex.rate,
                             "samples": list(ex.samples), "seconds": ex.seconds, "waited": ex.waited,
                             "sums": [b.flat.detach().clone() for b in ex.fragment.buckets],
                             "buffers": None if ex.buffers is None else [b.clone() for b in ex.buffers],
                             "records": [asdict(r) for r in (ex.stats.records if ex.stats is not None else [])]})
        return {"settings": self.settings.describe(), "workers": workers.count,
                "outer_steps": outer.steps, "skipped": outer.skipped,
                "samples": samples[0] if len(samples) == 1 else samples, "inflight": inflight,
                # DiLoCo(inner_rate=...): each fragment's inner rates since its last sync, and the outer step's own
                "rates": {"sums": [f.rate_sum for f in self.schedule.fragments],
                          "steps": [f.rate_steps for f in self.schedule.fragments],
                          "last": [outer.rates.get(f.index, 0.0) for f in self.schedule.fragments],
                          "peak": outer.peak_rate},
                "reduced_at": list(self.exchanges.reduced_at),
                "bytes_total": self.exchanges.bytes_total,
                "global": {name: g.detach().clone() for name, g in zip(model.names, outer.theta)},
                "mean": {name: m.detach().clone() for name, m in zip(model.names, outer.mean)},
                "momentum": momentum,
                "buffers": {name: b.detach().clone() for name, b in zip(model.buffer_names, outer.buffers)}}

    def rank_state(self) -> dict[str, Any]:
        """This rank's part: each fragment's compressor state, and whether its contribution to each settled exchange
        in flight was finite."""
        return {"compressors": [f.compressor.state_dict() for f in self.schedule.fragments],
                "finite": [ex.locally_finite for ex in self.exchanges.inflight if ex.settled]}

    def inflight_snapshots(self) -> list[dict[str, torch.Tensor]]:
        """This worker's part: its parameters at the start of each settled exchange in flight, by name."""
        names = self.model.names
        return [{names[i]: t.clone() for i, t in zip(ex.fragment.params, ex.snapshot)}
                for ex in self.exchanges.inflight if ex.settled and ex.snapshot is not None]

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.model is None:
            raise RuntimeError("DiLoCoSync.load_state_dict before attach: the parameters are not known yet")
        if state["settings"] != self.settings.describe():
            raise ValueError(f"the checkpoint was written with sync={state['settings']}, this run has "
                             f"sync={self.settings.describe()}: resume with the same DiLoCo settings")
        model, outer, fragments = self.model, self.outer, self.schedule.fragments
        outer.steps, outer.skipped = int(state["outer_steps"]), int(state["skipped"])
        self.exchanges.bytes_total = int(state.get("bytes_total", 0))
        self.exchanges.reduced_at = [int(r) for r in state.get("reduced_at", [0] * len(fragments))]
        count = self.schedule.workers.count
        same = int(state["workers"]) == count
        samples = state["samples"] if self.settings.fragments > 1 else [state["samples"]]
        if same:
            for fragment, counts in zip(fragments, samples):
                fragment.samples = [float(s) for s in counts]
        rates = state.get("rates")  # (a checkpoint written before inner_rate: none kept)
        if rates is not None:
            for fragment, total, steps, last in zip(fragments, rates["sums"], rates["steps"], rates["last"]):
                fragment.rate_sum, fragment.rate_steps = float(total), int(steps)
                if last > 0:
                    outer.rates[fragment.index] = float(last)
            outer.peak_rate = float(rates["peak"])
        self.exchanges.inflight = []
        with torch.no_grad():
            for name, g in zip(model.names, outer.theta):
                g.copy_(state["global"][name])
                if name in state["momentum"]:
                    outer.sgd.state[g]["momentum_buffer"] = host_copy(state["momentum"][name].to(g.dtype))
            for name, m in zip(model.names, outer.mean):  # a checkpoint of validate="global": theta_global
                m.copy_(state.get("mean", {}).get(name, state["global"][name]))
            for name, b in zip(model.buffer_names, outer.buffers):
                if name in state["buffers"]:
                    b.copy_(state["buffers"][name])
            for saved in state.get("inflight", []):
                fragment = fragments[saved["fragment"]]
                for bucket, total in zip(fragment.buckets, saved["sums"]):
                    bucket.flat.copy_(total)
                stats = CommStats()
                for record in saved["records"]:
                    stats.record(CallRecord(**record))
                self.exchanges.inflight.append(Exchange(
                    fragment, int(saved["step"]), int(saved["lands"]),
                    [float(s) for s in saved["samples"]] if same else [0.0] * count,
                    buffers=None if saved["buffers"] is None else [host_copy(b) for b in saved["buffers"]],
                    stats=stats, seconds=float(saved["seconds"]),
                    waited=float(saved["waited"]), norm=float(saved["norm"]), rate=float(saved.get("rate", 0.0))))

    def load_rank_state(self, state: Optional[dict[str, Any]], shared_only: bool = False) -> None:
        if state is None:
            return
        for fragment, saved in zip(self.schedule.fragments, state["compressors"]):
            fragment.compressor.load_state_dict(saved, shared_only=shared_only)
        if not shared_only:
            for exchange, finite in zip(self.exchanges.inflight, state["finite"]):
                exchange.locally_finite = bool(finite)

    def load_inflight_snapshots(self, snapshots: Optional[list[dict[str, torch.Tensor]]]) -> None:
        model = self.model
        for k, exchange in enumerate(self.exchanges.inflight):
            params = exchange.fragment.params
            if snapshots is not None and k < len(snapshots):  # on the host, wherever the checkpoint was mapped
                exchange.snapshot = [host_copy(snapshots[k][model.names[i]]) for i in params]
            elif self.settings.delay:
                exchange.snapshot = [host_copy(model.params[i]) for i in params]
