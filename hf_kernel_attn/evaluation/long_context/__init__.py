"""Long-context evaluation: does a converted model still use its context?

Tasks (one file each, registered with :func:`register_task`): ``passkey``, ``niah``, ``kv_recall`` and
``position_loss``. Every result record carries ``length`` and ``depth``; :mod:`.runner` scores them and
:mod:`.plots` draws the accuracy heat maps and loss-vs-position curves.
"""

from . import passkey, niah, kv_recall, position_loss  # noqa: F401, I001  (register the tasks, in this order)
from .base import DEFAULT_DEPTHS, DEFAULT_LENGTHS, DEFAULT_SAMPLES, TASKS, LongContextTask, Sample, register_task

__all__ = ["DEFAULT_DEPTHS", "DEFAULT_LENGTHS", "DEFAULT_SAMPLES", "TASKS", "LongContextTask",
           "Sample", "register_task"]
