"""Test helpers shipped with the package: the kernel conformance kit (:func:`check_kernel`) and the architecture
coverage harness (:mod:`.architectures`)."""

from .conformance import brute_force, check_kernel

__all__ = ["brute_force", "check_kernel"]
