"""Test helpers shipped with the package: the architecture coverage harness (:mod:`.architectures`)."""
