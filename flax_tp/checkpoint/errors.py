"""What a checkpoint operation raises."""


class CheckpointError(ValueError):
  """A checkpoint that cannot be read or does not fit the model."""


class CheckpointSaveError(RuntimeError):
  """A save that failed (disk full, unwritable folder); the earlier checkpoints are intact."""
