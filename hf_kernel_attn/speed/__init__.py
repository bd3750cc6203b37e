"""Speed measurements: kernel micro-benchmarks (``kernel_bench``) and decoding (``decoding``)."""
