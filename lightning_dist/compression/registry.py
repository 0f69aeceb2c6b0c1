"""``build_compressor(name, **kwargs)``: every compressor by name, as Hydra's ``compression`` group builds it.

=============  =============================================  ========  ==============================
name           what travels                                   summable  error feedback by default
=============  =============================================  ========  ==============================
``none``       the fp32 gradient                              yes       -
``fp16``       float16 cast (divided by N before the sum)     yes       no
``bf16``       bfloat16 cast                                  yes       no
``int8``       stochastic int8 + a scale per chunk, 2-phase   no        yes
``int4``       int8's 2-phase path at 4 bits, 2 codes a byte  no        yes
``topk``       the ``ratio`` largest entries per layer        no        yes
``threshold``  entries with ``|g| >= threshold`` (capped)     no        yes
``powersgd``   rank-``rank`` factors P and Q, warm start      no        yes
``sign``       1 bit + a scale per chunk, 2-phase, server EF  no        yes
=============  =============================================  ========  ==============================

Common keywords: ``error_feedback`` (None: the table's default), ``clip_norm`` (local clipping before error
feedback, DGC), ``start_step`` (uncompressed warm-up steps). The rest are the compressor's own.
"""

from __future__ import annotations

import inspect
from typing import Any, Optional

from lightning_dist.compression.base import Compressor, NoCompressor
from lightning_dist.compression.cast import CastCompressor
from lightning_dist.compression.error_feedback import ErrorFeedback
from lightning_dist.compression.int8 import Int8Compressor
from lightning_dist.compression.powersgd import PowerSGDCompressor
from lightning_dist.compression.sign import SignCompressor
from lightning_dist.compression.threshold import ThresholdCompressor
from lightning_dist.compression.topk import TopKCompressor

_REGISTRY: dict[str, tuple[type[Compressor], dict[str, Any]]] = {
    "none": (NoCompressor, {}),
    "fp16": (CastCompressor, {"name": "fp16"}),
    "bf16": (CastCompressor, {"name": "bf16"}),
    "int8": (Int8Compressor, {}),
    "int4": (Int8Compressor, {"bits": 4}),
    "topk": (TopKCompressor, {}),
    "threshold": (ThresholdCompressor, {}),
    "powersgd": (PowerSGDCompressor, {}),
    "sign": (SignCompressor, {}),
}
COMPRESSORS = tuple(_REGISTRY)


def compressor_options(name: str) -> list[str]:
    """The compressor's own keywords (besides error_feedback, clip_norm and start_step; those its name fixes, as
    ``int4`` fixes ``bits``, are not its to set)."""
    cls, fixed = _REGISTRY[name]
    params = inspect.signature(cls.__init__).parameters
    return [p for p in params if p not in ("self", "name", "start_step") and p not in fixed]


def error_feedback_default(name: str) -> bool:
    """Whether ``build_compressor(name)`` adds error feedback when ``error_feedback`` is None (the table's column)."""
    if name not in COMPRESSORS:
        raise ValueError(f"compressor={name!r} is unknown; use one of {sorted(COMPRESSORS)}")
    return bool(getattr(_REGISTRY[name][0], "wants_error_feedback", False))


def build_compressor(name: str = "none", *, error_feedback: Optional[bool] = None, clip_norm: Optional[float] = None,
                     start_step: int = 0, **kwargs: Any) -> Compressor:
    """A compressor by name; raises ``ValueError`` naming the bad value and the accepted ones."""
    if name not in COMPRESSORS:
        raise ValueError(f"compressor={name!r} is unknown; use one of {sorted(COMPRESSORS)} "
                         "(e.g. compression=topk compression.ratio=0.01)")
    cls, fixed = _REGISTRY[name]
    overridden = sorted(set(kwargs) & set(fixed) - {"name"})
    if overridden:
        raise ValueError(f"compressor {name!r} is {cls.__name__} with {fixed}: drop {overridden}, or name the variant "
                         f"you want (e.g. compressor='int8' for bits=8)")
    unknown = sorted(set(kwargs) - set(compressor_options(name)))
    if unknown:
        raise ValueError(f"compressor {name!r} takes no option {unknown}; its options are "
                         f"{compressor_options(name) + ['error_feedback', 'clip_norm', 'start_step']}")
    if error_feedback is not None and not isinstance(error_feedback, bool):
        raise ValueError(f"error_feedback={error_feedback!r} must be true, false or null (the compressor's default)")
    if isinstance(start_step, bool) or not isinstance(start_step, int) or start_step < 0:
        raise ValueError(f"start_step={start_step!r} must be an int >= 0 (uncompressed warm-up steps)")
    inner = cls(**fixed, **kwargs)
    wants = getattr(inner, "wants_error_feedback", False) if error_feedback is None else error_feedback
    if name == "none" and error_feedback:
        raise ValueError("error_feedback=true with compressor 'none': nothing is lost, so nothing to feed back")
    if clip_norm is not None and not wants:
        raise ValueError(f"clip_norm={clip_norm!r} clips the local gradient before error feedback, which is off for "
                         f"{name!r}; add error_feedback=true or drop clip_norm")
    compressor = ErrorFeedback(inner, clip_norm=clip_norm) if wants else inner
    compressor.start_step = start_step
    return compressor


def as_compressor(compressor: Any) -> Compressor:
    """What ``RingDDPStrategy(compressor=...)`` accepts: a Compressor, a name, a dict (as Hydra gives it) or None."""
    if compressor is None:
        return NoCompressor()
    if isinstance(compressor, Compressor):
        return compressor
    if isinstance(compressor, str):
        return build_compressor(compressor)
    if isinstance(compressor, dict):
        return build_compressor(**{k: v for k, v in compressor.items() if k != "_target_"})
    raise ValueError(f"compressor={compressor!r}: pass a lightning_dist.compression.Compressor, a name "
                     f"({sorted(COMPRESSORS)}), a dict of build_compressor's arguments, or None")
