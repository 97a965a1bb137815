"""The former name of ``flax_tp.data_parallel`` (data parallelism and FSDP over
``"data"``), kept so that ``import flax_tp.fsdp`` and its names keep working."""

from flax_tp.data_parallel import *  # noqa: F403
from flax_tp.data_parallel import __all__  # noqa: F401
