"""Fault tolerance's mechanisms, which :class:`~lightning_dist.callbacks.FaultTolerance` drives: atomic checkpoints and
the run's checkpoint directory (:mod:`.checkpoint`), emergency checkpoints and the exit timer (:mod:`.emergency`), stop
signals as a flag (:mod:`.signals`), the progress watchdog (:mod:`.watchdog`), every rank's generators (:mod:`.rng`)
and ``resume=auto`` (:mod:`.resume`)."""
