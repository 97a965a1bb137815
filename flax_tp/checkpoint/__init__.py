"""Sharded checkpoints of the logical (unpadded) state: each process writes and
reads only the shards it holds, and a checkpoint restores on any mesh and any
process count.

On disk, one folder per step::

    DIR/10/meta.json          the caller's metadata, the array table, the process count
    DIR/10/index.P.json       process P's pieces: key, logical start and shape, byte
                              offset, CRC-32 of the bytes
    DIR/10/shards.P.bin       process P's pieces, raw bytes one after another

A *piece* is the logical (padding stripped) part of one device shard: a box of
the logical array given by its start and shape. Every shard is written once,
by the device that holds replica 0 of it, so a replicated array is written once
and a sharded one once per distinct shard, without any all-gather. Restoring
builds each of this process's device blocks from the pieces that overlap its
logical region (positioned reads of only those bytes),
pads it with zeros and places it: the host holds one device block at a time.

Atomic: everything is written into ``DIR/.tmp-10/``, then (after every process
has written, through JAX's distributed barrier) process 0 writes ``meta.json``
and renames the folder to ``DIR/10``. A save interrupted at any point leaves the
earlier checkpoints as they were and no ``DIR/10``.

Checked: every piece carries the CRC-32 of its bytes and ``meta.json`` those of
the index files, so a flipped byte is refused on restore, never loaded.

Never deletes what it did not write: a step folder is removed (replaced,
rotated out by ``max_to_keep``, cleared by ``delete_all``) only as far as it
holds flax_tp's own files; a save or ``delete_all`` that would remove anything
else (a user's file in ``DIR/2/``, a folder ``DIR/12/`` that is not a
checkpoint) is refused with an error naming it, before anything is deleted.

Asynchronous saves (``Checkpointer(..., asynchronous=True)``) first copy the
arrays on their devices (the step that follows may donate the originals), then
write from a background thread while training goes on; the next ``save``,
``wait`` or ``close`` waits for it and raises its error, if any.

The package, by idea: ``keys`` (names and the format), ``boxes`` (the geometry of
pieces), ``write``, ``read``, ``ownership`` (what in a folder is flax_tp's), ``legacy``
(0.1.0's orbax checkpoints), ``checkpointer`` (``Checkpointer``, which ties them).
"""

from flax_tp.checkpoint.checkpointer import Checkpointer
from flax_tp.checkpoint.errors import CheckpointError, CheckpointSaveError
from flax_tp.checkpoint.keys import FORMAT
from flax_tp.checkpoint.ownership import check_step, describe_not_ours
from flax_tp.checkpoint.write import BARRIER_TIMEOUT_S

__all__ = ["BARRIER_TIMEOUT_S", "Checkpointer", "CheckpointError", "CheckpointSaveError",
           "FORMAT", "check_step", "describe_not_ours"]
