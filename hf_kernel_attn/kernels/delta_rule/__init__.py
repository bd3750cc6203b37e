"""The delta rule (DeltaNet, Gated DeltaNet) in three forms, flash-linear-attention's layout: :mod:`.naive` (the
token recurrence, the reference), :mod:`.chunk` (the chunked WY / UT-transform form for training and prefill) and
:mod:`.recurrent` (the decoding step on a constant-size memory). The kernels using them:
:mod:`hf_kernel_attn.kernels.deltanet`."""

from __future__ import annotations

from .chunk import DEFAULT_CHUNK, delta_rule_chunk
from .naive import delta_rule_naive
from .recurrent import delta_rule_recurrent

__all__ = ["DEFAULT_CHUNK", "delta_rule_chunk", "delta_rule_naive", "delta_rule_recurrent"]
