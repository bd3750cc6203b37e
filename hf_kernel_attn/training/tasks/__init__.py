"""Training tasks behind one registry (``task:`` in a finetune config): causal LM, sequence classification,
sentence embeddings. A task of one's own: a :class:`TrainingTask` subclass with ``@register_task``, in a module
the config's ``imports:`` names."""

from . import causal_lm, sentence_embedding, sequence_classification  # noqa: F401  (register the built-ins)
from .base import TASK_TYPES, TrainingTask, register_task

__all__ = ["TASK_TYPES", "TrainingTask", "register_task"]
