"""The compressor interface that the comm hook calls between weighting and transport.

Shaped after Horovod's ``compress(tensor) -> (payload, ctx)`` / ``decompress(payload, ctx)``, with explicit
state for the compressors that need it (error-feedback residuals, PowerSGD factors): ``state_dict`` and
``load_state_dict`` put it into Lightning checkpoints. ``summable`` says whether payloads from different
ranks can be added on the way (a cast can; a top-k index list cannot and needs an all-gather path).
"""

from __future__ import annotations

from typing import Any

import torch


class Compressor:
    """Base class: identity behaviour, no state. Subclasses override what they change."""

    name = "none"
    summable = True  # payloads can be all-reduced by sum; False means they must be all-gathered
    # compress/decompress cost little next to the transport (a cast, nothing at all): the hook may run them
    # on the autograd thread when the transport is asynchronous anyway; heavy compressors set False and
    # always run on the communication worker
    light = True

    def compress(self, tensor: torch.Tensor, key: str) -> tuple[torch.Tensor, Any]:
        """Return the payload to send and a context for :meth:`decompress`.

        ``key`` names the gradient bucket by its parameters (stable across DDP's bucket rebuilds), for
        compressors that keep per-parameter state.
        """
        return tensor, None

    def decompress(self, payload: torch.Tensor, ctx: Any, out: torch.Tensor) -> torch.Tensor:
        """Write the reduced payload back into ``out`` (the bucket's buffer) and return it."""
        if payload.data_ptr() != out.data_ptr():
            out.copy_(payload)
        return out

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state:
            raise ValueError(f"{type(self).__name__} keeps no state but got keys {sorted(state)}")


class NoCompressor(Compressor):
    """Sends the gradient as it is: the default."""
