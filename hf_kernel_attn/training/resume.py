"""The run's folder: refusing to overwrite a run, finding the checkpoint to resume from, the training and
validation logs (cut back to the checkpoint on resume), checkpoints (gathered from the shards when sharded) and
the final model folder, written whole or not at all.

Every process calls each method; only the main one writes, then all meet at ``wait``.
"""

from __future__ import annotations

import copy
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..events import reached
from ..fileio import write_text_atomic
from ..integration.loading import with_saved_kernel_options
from . import checkpoint as ckpt
from . import sharding
from .config import dump_config
from .hub import push_folder
from .model_card import write_card
from .tasks import TrainingTask

LOG_FILE = "training_log.jsonl"
VALIDATION_FILE = "validation.jsonl"
CONFIG_FILE = "config.resolved.yaml"


def fresh_state(world: int) -> dict[str, Any]:
    """The state of a run before its first step (a checkpoint's ``trainer_state.json`` holds the same keys)."""
    return {"global_step": 0, "stage": None, "stage_step": 0, "stage_done": False, "position": 0, "tokens": 0,
            "seconds": 0.0, "cpu_seconds": 0.0, "stage_seconds": 0.0, "world": world}


class RunFolder:
    """``output_dir`` of one run (see the module docstring)."""

    def __init__(self, out: Path, main: bool, wait: Callable[[], None]) -> None:
        self.out = out
        self.main = main
        self.wait = wait

    def prepare(self, resume: bool) -> None:
        """Create the folder; refuse one that holds a run unless resuming; remove half-written checkpoints."""
        self.out.mkdir(parents=True, exist_ok=True)
        if self.main:
            log = self.out / LOG_FILE
            if not resume and (ckpt.checkpoints(self.out) or (log.exists() and log.stat().st_size)
                               or (self.out / "final").exists()):
                raise ValueError(
                    f"output_dir {str(self.out)!r} already holds a run (checkpoints, {LOG_FILE} or final/); pass "
                    "--resume to continue it, or choose another output_dir")
            ckpt.remove_partial(self.out)
        self.wait()

    def start(self, resume: bool, world: int, config: dict[str, Any]) -> tuple[dict[str, Any], Path | None]:
        """The state to start from and the checkpoint it came from (None: from the beginning). The logs keep
        only the records up to that state's step (the rest are redone); the resolved config is written."""
        state = fresh_state(world)
        resume_from = ckpt.latest_checkpoint(self.out) if resume else None
        if resume and self.main:
            for bad in ckpt.incomplete_checkpoints(self.out):
                print(f"--resume: skipping {bad}: its files do not match its {ckpt.MANIFEST} (damaged, or written "
                      "before checkpoints had one)", flush=True)
            if resume_from is None:
                print(f"--resume: no complete checkpoint in {self.out}; starting from the beginning", flush=True)
        if resume_from is not None:
            state = ckpt.read_state(resume_from)
            if self.main:
                print(f"resuming from {resume_from} (stage {state['stage']}, step {state['global_step']})",
                      flush=True)
        self.truncate_logs(state["global_step"] if resume_from is not None else -1)
        if self.main:
            dump_config(config, self.out / CONFIG_FILE)
        return state, resume_from

    # ---------------------------------------------------------------- logs
    def log(self, record: dict[str, Any], file: str = LOG_FILE) -> None:
        """Append one JSON line (main process)."""
        if self.main:
            line = json.dumps(record) + "\n"
            with open(self.out / file, "a") as f:
                reached(f"log-{record['step']}", file=f, line=line)
                f.write(line)

    def truncate_logs(self, step: int) -> None:
        """Keep only log records up to ``step`` (-1: none)."""
        if not self.main:
            return
        for name in (LOG_FILE, VALIDATION_FILE):
            path = self.out / name
            if path.exists():
                keep = [ln for ln in ckpt.read_jsonl_lines(path) if json.loads(ln)["step"] <= step]
                write_text_atomic(path, "".join(ln + "\n" for ln in keep))

    def final_scores(self) -> dict[str, float]:
        """The last held-out scores the run logged (validation.jsonl), for the model card."""
        path = self.out / VALIDATION_FILE
        lines = ckpt.read_jsonl_lines(path) if path.exists() else []
        if not lines:
            return {}
        last = json.loads(lines[-1])
        return {k: v for k, v in last.items() if k.startswith("val_") and isinstance(v, (int, float))}

    # ---------------------------------------------------------------- checkpoints
    def save_checkpoint(self, state: dict[str, Any], model: torch.nn.Module, optimizer, scheduler,
                        sharded: bool, keep: int) -> None:
        """A checkpoint of ``state`` (model, optimizer, schedule, RNG); sharded, the full tensors are gathered to
        the main process (every process takes part). Older checkpoints beyond ``keep`` are removed."""
        tensors = None
        if sharded:
            tensors = {"model.pt": sharding.full_model_state(model),
                       "optimizer.pt": sharding.full_optimizer_state(model, optimizer.optimizer)}
        elif self.main:
            tensors = {"model.pt": model.state_dict(), "optimizer.pt": optimizer.optimizer.state_dict()}
        if self.main:
            tensors.update({"scheduler.pt": scheduler.scheduler.state_dict(), "rng.pt": ckpt.rng_state()})
            ckpt.save_checkpoint(self.out, state["global_step"], tensors, state)
            reached(f"prune-{state['global_step']}")
            ckpt.prune(self.out, keep)
        self.wait()

    # ---------------------------------------------------------------- the final model
    def save_final(self, model: torch.nn.Module, tokenizer: Any, task: TrainingTask, source: str,
                   config: dict[str, Any], state: dict[str, Any], sharded: bool) -> Path:
        """``output_dir/final``: the model (adapters merged when ``merge_lora``), the options that need no training
        (``inference_params``, ``inference_layers``), the tokenizer, the task's extra files and the model card;
        written to a temporary folder and renamed, so a failure leaves no half-written final/. Pushed to the hub if
        asked."""
        final = self.out / "final"
        full_state = sharding.full_model_state(model) if sharded else None
        if self.main:
            if type(model).__module__.startswith("peft") and config["merge_lora"]:
                model = copy.deepcopy(model).merge_and_unload()
            tmp = self.out / ".tmp-final"
            shutil.rmtree(tmp, ignore_errors=True)
            reached("save-final")
            try:
                model.save_pretrained(tmp, state_dict=full_state)
                kattn = getattr(model.config, "kernel_attention", None)
                if config["inference_params"] or config["inference_layers"]:  # options that need no training
                    kattn = with_saved_kernel_options(model.config, config["inference_params"],
                                                      config["inference_layers"]).kernel_attention
                    written = json.loads((tmp / "config.json").read_text())
                    written["kernel_attention"] = kattn  # the rest of what save_pretrained wrote stays
                    (tmp / "config.json").write_text(json.dumps(written, indent=2, sort_keys=True) + "\n")
                tokenizer.save_pretrained(tmp)
                task.save_extras(Path(source), tmp)
                write_card(tmp, config, kattn, self.final_scores(), state)
            except BaseException as exc:  # torch, safetensors and tokenizers report a full disk in their own types
                free = ckpt.free_bytes(self.out)
                shutil.rmtree(tmp, ignore_errors=True)
                if not isinstance(exc, Exception):
                    raise
                raise ckpt.write_failed("the final model", self.out, exc, free) from exc
            reached("final")
            ckpt.replace_folder(tmp, final, "final")
            print(f"saved the converted model to {final}", flush=True)
            if config["push_to_hub"]:
                repo = config["hub_model_id"] or self.out.resolve().name
                url = push_folder(final, repo, private=config["hub_private_repo"])
                print(f"pushed {final} to {url}", flush=True)
        self.wait()
        return final
