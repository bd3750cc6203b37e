"""Register the kernels with transformers when transformers' model code loads, not when hf_kernel_attn does.

Why: ``import hf_kernel_attn`` used to import torch and transformers (~4 s of CPU) to register every kernel
name, which made ``hf-kernel-attn --help`` and ``hf-kernel-attn list`` slow. The package root is now lazy
(PEP 562), and the registration waits for the first moment it can matter: the import of
``transformers.modeling_utils`` (which defines ``PreTrainedModel`` and ``AttentionInterface``; every model
class and ``AutoModel*.from_pretrained`` import it).

What :func:`activate` does (once per process):

* ``hf_kernel_attn.integration.attention.register()`` — every kernel name, and the saved-model marker, is
  registered with ``transformers.AttentionInterface`` and ``transformers.masking_utils.AttentionMaskInterface``,
  so ``attn_implementation="<kernel>"`` works in stock transformers calls;
* ``hf_kernel_attn.integration.hooks.install_hooks()`` — wraps ``PreTrainedModel.post_init``,
  ``_initialize_weights``, ``set_attn_implementation``, ``_finalize_model_loading``, ``save_pretrained`` and
  generate's ``_prepare_cache_for_generation`` (the table ``PATCHES`` in that module), so saved kernel checkpoints load.

When it runs (:func:`arm`, called by ``hf_kernel_attn/__init__.py``):

* ``transformers.modeling_utils`` already imported: at once;
* otherwise a :class:`_ModelingUtilsHook` goes first on ``sys.meta_path``. It finds nothing itself: when
  ``transformers.modeling_utils`` is imported it asks the other finders for the module's spec and wraps that
  spec's ``loader.exec_module`` (on this one loader instance), so that right after the module body has run,
  :func:`activate` runs; then the finder takes itself off ``sys.meta_path``;
* in any case, on the first access to a public attribute of ``hf_kernel_attn`` (``patch``,
  ``from_pretrained``, ``register_kernel``, ...; the root's ``__getattr__`` calls :func:`activate`).

If ``transformers.modeling_utils`` is imported while one of the modules :func:`activate` needs is itself half
imported (a cycle), the registration is left for the next public-attribute access or explicit
:func:`activate` call instead of failing the import.

This module imports only the standard library.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import sys
import threading
from collections.abc import Sequence
from types import ModuleType

TARGET = "transformers.modeling_utils"

_lock = threading.RLock()
_active = False
_activating = False  # set (under _lock) while activate() runs: the hook inside it then does nothing


def is_active() -> bool:
    """Whether the kernels are registered with transformers and the hooks installed."""
    return _active


def activate() -> None:
    """Register every kernel with transformers and install the PreTrainedModel hooks (idempotent; imports
    torch and transformers)."""
    if _active:
        return
    with _lock:
        _activate_locked()


def _activate_locked() -> None:
    global _active, _activating
    if _active or _activating:
        return
    _activating = True
    try:
        import transformers.modeling_utils  # noqa: F401  (the hook, if armed, fires here and does nothing)

        from .integration.attention import register  # lazy: `import hf_kernel_attn` stays torch-free until here
        from .integration.hooks import install_hooks  # lazy: as above (runs when transformers' model code loads)

        register()
        install_hooks()
        _active = True
    finally:
        _activating = False
    disarm()


def _activate_from_hook() -> None:
    """:func:`activate` as the hook calls it: never waits for another thread (which may be waiting for the
    import lock this thread holds) and never fails the import of transformers.modeling_utils."""
    if not _lock.acquire(blocking=False):
        return  # another thread is activating
    try:
        _activate_locked()
    except ImportError:  # a module activate() needs is half imported (an import cycle): activate later
        pass
    finally:
        _lock.release()


class _ModelingUtilsHook(importlib.abc.MetaPathFinder):
    """Meta-path finder that runs :func:`activate` right after ``transformers.modeling_utils`` executes."""

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None):
        if fullname != TARGET or _active:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        exec_module = getattr(loader, "exec_module", None)
        if exec_module is None:  # a legacy loader: left alone (the root's __getattr__ still activates)
            return spec

        def exec_then_activate(module: ModuleType) -> None:
            with contextlib.suppress(AttributeError):  # unwrap: a loader may be shared (zipimport)
                del loader.exec_module
            exec_module(module)  # if it raises, nothing is registered and the finder stays for a retry
            disarm()
            _activate_from_hook()

        loader.exec_module = exec_then_activate
        return spec


_hook = _ModelingUtilsHook()


def arm() -> None:
    """Activate now if transformers' model code is loaded, else when it loads (see the module docstring)."""
    if _active:
        return
    if TARGET in sys.modules:
        _activate_from_hook()  # ImportError (modeling_utils itself half imported): at the first API access
    elif _hook not in sys.meta_path:
        sys.meta_path.insert(0, _hook)


def disarm() -> None:
    """Take the finder off ``sys.meta_path`` (no-op when it is not there)."""
    with contextlib.suppress(ValueError):
        sys.meta_path.remove(_hook)


def is_armed() -> bool:
    """Whether the finder is waiting on ``sys.meta_path``."""
    return _hook in sys.meta_path


__all__ = ["TARGET", "activate", "arm", "disarm", "is_active", "is_armed"]
