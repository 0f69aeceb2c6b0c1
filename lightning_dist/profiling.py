"""``AllThreadsProfiler``: Lightning's PyTorch profiler set to record every thread of a rank.

torch's profiler records ``record_function`` ranges only on the threads it was started on, unless Kineto is
told to profile all threads. RingDDPStrategy reduces gradient buckets on its communication worker thread,
so with the stock ``PyTorchProfiler`` (``Trainer(profiler="pytorch")``) a Chrome trace shows no
``lightning_dist.*`` stage at all. This profiler adds Kineto's ``profile_all_threads`` switch when it
builds the torch profiler, so each rank's trace has the worker's ``weight``, ``compress``,
``transport.<algorithm>`` and ``decompress`` ranges on a row of their own beside the main thread's
forward and backward. The switch is made when profiling starts, inside the rank, so the profiler itself
stays picklable for the spawn launcher.
"""

from __future__ import annotations

from typing import Any

from typing_extensions import override

from lightning_dist.upstream import ProfilerBase, all_threads_profiler_config


class AllThreadsProfiler(ProfilerBase):
    """A :class:`~lightning.pytorch.profilers.PyTorchProfiler` whose traces include every thread.

    Takes PyTorchProfiler's arguments (``dirpath``, ``filename``, ``export_to_chrome``, ...). On a torch
    without the switch it records the main thread only, as the stock profiler does (run with
    ``RingDDPStrategy(overlap=False)`` to see the stages there).
    """

    @override
    def make_profiler(self, profiler: type) -> Any:
        kwargs = self.profiler_kwargs
        config = None if "experimental_config" in kwargs else all_threads_profiler_config()
        if config is None:  # the user's own experimental config, or a torch without the switch
            return super().make_profiler(profiler)
        kwargs["experimental_config"] = config
        try:
            return super().make_profiler(profiler)
        finally:
            del kwargs["experimental_config"]  # not kept: it does not pickle
