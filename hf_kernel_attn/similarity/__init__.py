"""Is attention a similarity? Kernel geometry, real attention maps and association benchmarks.

* ``geometry``: κ(x₀, x) of each kernel family over a plane, and kernel values / attention maps of real
  queries and keys (computed through the package's own kernel modules).
* ``plots``: ``hf-kernel-attn plot-kernels`` (PNGs + JSON).
* ``synthetic``: MQAR and ListOps-style generators, a tiny Llama trained from scratch per kernel,
  ``hf-kernel-attn synthetic``; results are leaderboard records (``results.jsonl`` schema).
* ``report``: the mean ± std table over seeds from those records.
"""
