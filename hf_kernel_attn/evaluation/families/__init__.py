"""The built-in evaluation task families, one module each: the family's
:class:`~hf_kernel_attn.evaluation.task.EvalTask` subclass and ``TASKS``, its built-in tasks: ``text``
(perplexity), ``lm_eval`` (lm-evaluation-harness tasks on local files), ``glue`` (GLUE classification),
``embedding`` (STS-B embeddings) and ``long_context`` (the ``evaluation/long_context`` tasks).
:mod:`hf_kernel_attn.evaluation.tasks` registers them all, in that order; this package imports none of them, so
that a family module can be imported on its own."""
