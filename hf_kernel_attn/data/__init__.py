"""Dataset readers for training and evaluation."""

from .glue import GLUE_TASKS, GlueExample, GlueTask, load_glue, read_glue_file

__all__ = ["GLUE_TASKS", "GlueExample", "GlueTask", "load_glue", "read_glue_file"]
