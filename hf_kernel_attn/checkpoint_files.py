"""Ground floor: whether a checkpoint folder's files are whole, and what a damaged one raised while it loaded,
each as one line naming the file (``PATH is truncated: …``, ``the tensor shapes in PATH do not match …``).

:func:`checkpoint_problem` reads, without loading anything: every JSON file that loading reads parses, every
safetensors file has a readable header and exactly the bytes it describes, a PyTorch ``.bin`` is a whole zip
archive. :func:`is_damaged_file_error` / :func:`is_shape_error` recognise the exceptions a damaged file raises
inside a load (safetensors' ``SafetensorError``, a truncated pickle, JSON that does not parse, tensors of other
shapes than config.json builds). :mod:`.model_paths` turns both into its one-line errors. Standard library only.
"""

from __future__ import annotations

import json
import pickle
import re
import struct
import traceback
import zipfile
from pathlib import Path


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


SAFETENSORS_MAX_HEADER = 100_000_000  # safetensors' own limit on the length of a file's JSON header
# the JSON files that loading a model and its tokenizer reads (a broken generation_config.json only warns)
CHECKED_JSON = ("config.json", "adapter_config.json", "tokenizer.json", "tokenizer_config.json",
                "special_tokens_map.json", "added_tokens.json")
# (single weights file, its sharded form's index), in transformers' order of preference
WEIGHT_FILES = (("model.safetensors", "model.safetensors.index.json"),
                ("pytorch_model.bin", "pytorch_model.bin.index.json"))
ADAPTER_WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")


def safetensors_problem(path: Path) -> str | None:
    """What is wrong with the safetensors file ``path`` (e.g. ``is truncated: 54624 of its 109248 bytes``), read
    as safetensors reads it: an 8-byte little-endian header length, a JSON header, then exactly the bytes its
    tensors' ``data_offsets`` cover; None when it is whole."""
    size = path.stat().st_size
    if size == 0:
        return "is empty"
    with open(path, "rb") as f:
        start = f.read(9)
        if len(start) < 8:
            return f"is truncated or not a safetensors file ({size} bytes, less than its 8-byte header length)"
        (length,) = struct.unpack("<Q", start[:8])
        if start[8:9] != b"{" or length > SAFETENSORS_MAX_HEADER:
            return "is not a safetensors file (no JSON header after its first 8 bytes)"
        if 8 + length > size:
            return f"is truncated: {size} bytes, its header alone takes {8 + length}"
        raw = start[8:] + f.read(length - 1)
    try:
        header = json.loads(raw.decode("utf-8"))
        ends = [int(entry["data_offsets"][1]) for key, entry in header.items() if key != "__metadata__"]
    except (UnicodeDecodeError, ValueError, TypeError, KeyError, IndexError, AttributeError) as exc:
        return f"is not a safetensors file (its header is not a safetensors header: {first_line(exc)})"
    expected = 8 + length + max(ends, default=0)
    if size < expected:
        return f"is truncated: {size} of its {expected} bytes"
    if size > expected:
        return f"is not a whole safetensors file: {size} bytes, its header describes {expected}"
    return None


def torch_file_problem(path: Path) -> str | None:
    """What is wrong with the PyTorch checkpoint ``path``: a zip archive (``torch.save``'s format) that lacks its
    end (its central directory) is truncated; None for a whole archive or a pickle (torch's legacy format)."""
    if path.stat().st_size == 0:
        return "is empty"
    with open(path, "rb") as f:
        start = f.read(4)
    if start == b"PK\x03\x04":
        return None if zipfile.is_zipfile(path) else "is truncated (not a whole zip archive, as torch.save writes)"
    if start[:1] == b"\x80":  # a pickle's protocol opcode
        return None
    return "is not a PyTorch checkpoint (neither a zip archive nor a pickle)"


def json_problem(path: Path) -> str | None:
    """What is wrong with the JSON file ``path`` (empty, not UTF-8, not JSON); None when it parses."""
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError:
        return "is not a JSON file (not UTF-8 text)"
    if not text.strip():
        return "is empty"
    try:
        json.loads(text)
    except ValueError as exc:
        return f"is not valid JSON ({first_line(exc)})"
    return None


def _shards(index: Path) -> list[Path]:
    """The weight files a sharded checkpoint's index lists (none when the index does not parse: it is checked as
    a JSON file itself)."""
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        names = sorted({name for name in weight_map.values() if isinstance(name, str)})
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return []
    return [index.parent / name for name in names]


def weight_files(folder: Path) -> list[Path]:
    """The weight files that loading the checkpoint in ``folder`` reads: ``model.safetensors`` or the shards of its
    index, else the PyTorch ``.bin`` forms, and an adapter's weights; only those that exist."""
    files: list[Path] = []
    for single, index in WEIGHT_FILES:
        if (folder / single).is_file():
            files = [folder / single]
            break
        if (folder / index).is_file():
            files = _shards(folder / index)
            break
    files += [folder / name for name in ADAPTER_WEIGHT_FILES if (folder / name).is_file()]
    return [f for f in files if f.is_file()]


def checkpoint_problem(folder: Path) -> str | None:
    """The first damaged file of the checkpoint in ``folder``, as ``PATH is ...`` (:func:`json_problem`,
    :func:`safetensors_problem`, :func:`torch_file_problem`); None when every file it reads looks whole. Reads
    each JSON file, the safetensors headers and a ``.bin``'s start and end, not the tensors."""
    indexes = [folder / index for _, index in WEIGHT_FILES]
    checks = [(path, json_problem) for path in (*(folder / n for n in CHECKED_JSON), *indexes) if path.is_file()]
    checks += [(path, safetensors_problem if path.suffix == ".safetensors" else torch_file_problem)
               for path in weight_files(folder)]
    for path, check in checks:
        try:
            problem = check(path)
        except OSError:  # unreadable: left to the load, which names it
            continue
        if problem is not None:
            return f"{path} {problem}"
    return None


# an exception of these types while a model loads comes from a damaged file
_DAMAGED_FILE_ERRORS = (EOFError, pickle.UnpicklingError, json.JSONDecodeError, zipfile.BadZipFile)
# transformers' (and torch's load_state_dict's) words for tensors of other shapes than the model built from config.json
_SHAPE_ERRORS = ("size mismatch", "copying a param with shape", "ignore_mismatched_sizes")
_TORCH_SIZE_MISMATCH = re.compile(r"size mismatch for ([^:\s]+): copying a param with shape torch\.Size\((\[[^\]]*\])\)"
                                  r" from checkpoint, the shape in current model is torch\.Size\((\[[^\]]*\])\)")


def is_safetensors_error(exc: BaseException) -> bool:
    """safetensors' ``SafetensorError`` (its Rust module's class), recognised without importing safetensors."""
    return any(cls.__name__ == "SafetensorError" and cls.__module__.startswith("safetensors")
               for cls in type(exc).__mro__)


def is_damaged_file_error(exc: BaseException) -> bool:
    return (is_safetensors_error(exc) or isinstance(exc, _DAMAGED_FILE_ERRORS)
            or (isinstance(exc, RuntimeError) and "PytorchStreamReader" in str(exc)))


def is_shape_error(exc: BaseException) -> bool:
    return isinstance(exc, (RuntimeError, ValueError)) and any(words in str(exc) for words in _SHAPE_ERRORS)


def weights_label(folder: Path | None) -> str:
    """How a message names a checkpoint's weights: its one file, or the folder of several."""
    if folder is None:
        return "its weights"
    files = weight_files(folder)
    return str(files[0]) if len(files) == 1 else f"the weight files in {folder}"


def mismatched_keys(exc: BaseException) -> list[tuple[str, list[int], list[int]]]:
    """(name, shape in the file, shape of the model) of each mismatched tensor: transformers raises a bare
    "see the report above" RuntimeError after logging them, so they are read from its ``loading_info`` (a local of
    the raising frames), else parsed from torch's ``size mismatch for NAME: ...`` lines."""
    for frame, _ in traceback.walk_tb(exc.__traceback__):
        keys = getattr(frame.f_locals.get("loading_info"), "mismatched_keys", None)
        if keys:
            try:
                return sorted((str(name), list(got), list(want)) for name, got, want in keys)
            except (TypeError, ValueError):
                break
    return [(name, json.loads(got), json.loads(want)) for name, got, want in _TORCH_SIZE_MISMATCH.findall(str(exc))]


def shape_message(folder: Path | None, exc: BaseException) -> str:
    config = str(folder / "config.json") if folder is not None else "its config.json"
    mismatched = mismatched_keys(exc)
    if mismatched:
        name, got, want = mismatched[0]
        detail = f"{name}: {got} in the file, {want} from the config"
        if len(mismatched) > 1:
            detail += f"; {len(mismatched)} tensors differ"
    else:
        detail = first_line(exc)
    return f"the tensor shapes in {weights_label(folder)} do not match {config} ({detail})"


def error_kind(exc: BaseException) -> str:
    return "safetensors" if is_safetensors_error(exc) else type(exc).__name__
