"""Context parallelism's split of the sequence over the ``"context"`` axis.

The sequence of ``S`` tokens is padded to ``2C`` equal chunks and device ``i`` of the
``C`` context devices holds chunks ``i`` and ``2C-1-i`` (torchtitan's head-tail load
balancing): under a causal mask the early chunks see few keys and the late ones many,
so each device gets one of each and the same work. Everything but attention works on
tokens one by one and runs on the device's own ``2 * chunk`` tokens; attention reads
every key (``gather``), masked by the tokens' *global* positions (``positions``), which
rotary uses too.

Padding: the ``2C * chunk - S`` slots past the end hold token 0 at positions ``>= S``.
A real token's query never sees them (they come after it: the causal mask), and the
loss leaves them out (``real``), so they reach no result, loss or gradient.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from flax_tp.collectives import all_gather, axis_is_bound, gather_to_parallel, shard_index
from flax_tp.mesh import CONTEXT_AXIS


def context_size() -> int:
  """Inside a ``shard_map``: the devices of the ``"context"`` axis (1 when the mesh has
  none)."""
  return jax.lax.axis_size(CONTEXT_AXIS) if axis_is_bound(CONTEXT_AXIS) else 1


# How attention reaches the other context devices' keys: every device all-gathers k
# and v over "context" (MaxText's default and its fastest at 32K), or the k/v blocks
# travel around the ring of devices (flax_tp.ring_attention: two blocks in memory
# whatever C, C-1 steps of communication overlapping the work).
STRATEGIES = ("all_gather", "ring")


@dataclasses.dataclass(frozen=True)
class ContextSplit:
  """How a sequence of ``seq_len`` tokens is split over ``parts`` context devices, and
  how attention reaches the others' keys (``strategy``, one of ``STRATEGIES``)."""

  seq_len: int
  parts: int
  strategy: str = "all_gather"

  def __post_init__(self):
    if self.seq_len < 1 or self.parts < 1:
      raise ValueError(f"ContextSplit needs a positive length and part count, got "
                       f"seq_len={self.seq_len}, parts={self.parts}")
    if self.strategy not in STRATEGIES:
      raise ValueError(f"context-parallel strategy must be one of {STRATEGIES}, got "
                       f"{self.strategy!r}")

  @classmethod
  def here(cls, seq_len: int, strategy: str = "all_gather") -> ContextSplit | None:
    """The split inside a ``shard_map`` whose context axis has more than one device;
    None otherwise (the whole sequence on every device)."""
    parts = context_size()
    return cls(seq_len, parts, strategy) if parts > 1 else None

  @property
  def chunk(self) -> int:
    """Tokens per chunk: ``ceil(seq_len / 2C)``."""
    return -(-self.seq_len // (2 * self.parts))

  @property
  def local_len(self) -> int:
    """Tokens each device holds (its two chunks, padding included)."""
    return 2 * self.chunk

  @property
  def padded_len(self) -> int:
    return 2 * self.parts * self.chunk

  @property
  def order(self) -> np.ndarray:
    """``[C, local_len]``: the global position of each device's slots (static)."""
    chunk = np.arange(self.chunk)
    return np.stack([np.concatenate([i * self.chunk + chunk,
                                     (2 * self.parts - 1 - i) * self.chunk + chunk])
                     for i in range(self.parts)])

  def positions(self) -> jax.Array:
    """``[local_len]`` int32: this device's slots' global positions (past ``seq_len``:
    padding)."""
    return jnp.asarray(self.order, jnp.int32)[shard_index(CONTEXT_AXIS)]

  def real(self) -> jax.Array:
    """``[local_len]`` bool: which of this device's slots hold a token."""
    return self.positions() < self.seq_len

  def local(self, whole: jax.Array, axis: int = 1, fill=0) -> jax.Array:
    """This device's slots of ``whole`` (``[..., seq_len, ...]`` on ``axis``, the same
    on every context device), padding slots ``fill``."""
    pad = [(0, 0)] * whole.ndim
    pad[axis] = (0, self.padded_len - self.seq_len)
    padded = jnp.pad(whole, pad, constant_values=fill)
    return jnp.take(padded, self.positions(), axis=axis)

  def gather(self, x: jax.Array, axis: int = 1) -> jax.Array:
    """Every device's slots ``[..., C * local_len, ...]`` (in ``order``'s order) from this
    device's ``x [..., local_len, ...]``: one all-gather over ``"context"``, whose
    backward reduce-scatters the cotangent. The result feeds per-device work."""
    return gather_to_parallel(x, axis=axis, axis_name=CONTEXT_AXIS)

  @property
  def gathered_positions(self) -> np.ndarray:
    """``[C * local_len]``: the global position of each slot ``gather`` returns."""
    return self.order.reshape(-1)

  def whole(self, x: jax.Array, axis: int = 1) -> jax.Array:
    """The sequence ``[..., seq_len, ...]`` in order from every device's slots ``x``
    (the same on every context device): the standalone model's logits."""
    gathered = all_gather(x, axis=axis, axis_name=CONTEXT_AXIS)
    where = np.argsort(self.gathered_positions)[:self.seq_len]
    return jnp.take(gathered, jnp.asarray(where), axis=axis)
