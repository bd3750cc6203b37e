"""The commands of ``hf-kernel-attn``, one module per group, each importing at module level what it needs.

:mod:`hf_kernel_attn.cli` parses the command line without importing torch and names each command's function
here as a lazy ``"module:function"`` entry of its command registry, so ``--help`` and ``list`` stay fast and a
command imports only its own group."""
