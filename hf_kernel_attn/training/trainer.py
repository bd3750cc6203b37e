"""Conversion training: attention transfer, then LoRA and/or full fine-tuning, under accelerate.

Stages run in the order transfer -> distill -> lora -> full -> retention; a stage with ``steps: 0`` is skipped.

* **transfer** (Hedgehog, Zhang et al. ICLR 2024; LoLCATs, Zhang et al. ICLR 2025): only the kernels'
  own parameters train, on the layer-local loss of :mod:`hf_kernel_attn.integration.transfer`; the
  model runs in eval mode and a causal LM skips its LM head (``logits_to_keep=1``).
* **distill** (causal LM): LoRA adapters (``train: lora``) or the weights (``train: full``) train on
  KL(teacher ‖ student) of the next-token distributions (:func:`.losses.distillation_loss`), the teacher
  being the same model with softmax attention and its original weights, computed in the same step
  (adapters switched off, or a frozen copy for ``train: full``); plus ``ce_weight`` × cross-entropy.
* **lora**: LoRA adapters through ``peft`` (LoLCATs: r = 8, α = 16 on the attention projections).
* **full**: every weight trains.

Task losses: next-token cross-entropy (``causal_lm``), the classification / regression head
(``sequence_classification``), and cosine distillation of the original model's mean-pooled
embeddings, computed once with the softmax teacher (``sentence_embedding``).

The engine is accelerate: each stage's model, optimizer, schedule (``transformers.get_scheduler``) and data
loader go through ``accelerator.prepare``; steps use ``accelerator.accumulate``, ``backward`` and
``clip_grad_norm_``, under ``mixed_precision``. Under ``accelerate launch`` / ``torchrun`` each process reads its
slice of every global micro-batch (``split_batches``) and DDP averages the gradients, so P processes with
batch_size b/P follow the same trajectory as one process with batch_size b. ``sharding: fsdp`` shards the
``full`` stage with FSDP2 (:mod:`.sharding`).
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch
from accelerate import Accelerator, DataLoaderConfiguration, DistributedType
from accelerate.state import AcceleratorState
from tqdm.auto import tqdm

from ..events import reached
from . import checkpoint as ckpt
from . import sharding
from .config import configured_stages
from .context import RunContext
from .data import BatchPlan, PlanBatches, SampleIndex, check_training_data
from .model_setup import ModelSetup
from .resume import VALIDATION_FILE, RunFolder
from .schedules import make_scheduler
from .stages import STAGE_TYPES, TrainingStage, Trains
from .tasks import TASK_TYPES, TrainingTask

PROGRESS_SECONDS = 30.0  # a progress line (stdout) at least this often in wall-clock time, besides the bar


class Trainer:
    """One conversion run (see the module docstring); :meth:`run` returns ``output_dir/final``.

    The parts: :class:`.model_setup.ModelSetup` (loading, layer/head choices, LoRA, what trains),
    :class:`.resume.RunFolder` (the output folder, logs, checkpoints, the final model) and the loop here. Stages
    and the task see the run through :attr:`context` (:class:`.context.RunContext`)."""

    def __init__(self, config: dict[str, Any], resume: bool = False) -> None:
        self.config = config
        self.out = Path(config["output_dir"])
        self.resume = resume
        if config["threads"]:
            torch.set_num_threads(int(config["threads"]))
        # the run's precision is its own, not the one an earlier Accelerator of this process (a Trainer) left in
        # accelerate's process-wide state (the process group and device stay)
        AcceleratorState._reset_state()
        precision = config["mixed_precision"] or os.environ.get("ACCELERATE_MIXED_PRECISION", "no")
        self.accelerator = Accelerator(
            cpu=not torch.cuda.is_available(), log_with=self._trackers(), project_dir=str(self.out),
            mixed_precision=precision, gradient_accumulation_steps=config["data"]["grad_accum"],
            dataloader_config=DataLoaderConfiguration(split_batches=True))
        self.config["mixed_precision"] = str(self.accelerator.mixed_precision)  # what runs (launcher's if null)
        self.device = self.accelerator.device
        self.world, self.rank = self.accelerator.num_processes, self.accelerator.process_index
        self.main = self.accelerator.is_main_process
        self.context = RunContext(config=config, device=self.device)
        self.task: TrainingTask = TASK_TYPES[config["task"]](self.context)  # tasks/<name>.py
        self.stages: dict[str, TrainingStage] = {  # stages/<name>.py
            name: STAGE_TYPES[name](self.context, self.task) for name in configured_stages(config)}
        self.setup = ModelSetup(self.context, self.task, self.out, self.main, self._wait)
        self.folder = RunFolder(self.out, self.main, self._wait)
        self.accelerate_fsdp = self.accelerator.distributed_type == DistributedType.FSDP
        self.sharded = False  # true while the full stage runs sharded (FSDP2)

    # what tests and notebooks read of a finished run
    @property
    def model(self) -> torch.nn.Module:
        """The converted model (a peft wrapper when adapters are in and not merged)."""
        return self.context.model

    @property
    def train(self) -> Any:
        """The training split."""
        return self.context.train

    @property
    def teacher(self) -> torch.Tensor:
        """sentence_embedding: the original model's pooled embedding of each training sentence."""
        return self.task.teacher

    def _wait(self) -> None:
        self.accelerator.wait_for_everyone()

    def _reduce(self, value: float, how: str) -> float:
        """``value`` combined over the processes (``mean``, ``sum``, or ``max``) through accelerate."""
        if self.world == 1:
            return value
        t = torch.tensor([float(value)], device=self.device)
        if how == "max":
            return float(self.accelerator.gather(t).max().item())
        return float(self.accelerator.reduce(t, reduction=how).item())

    def _trackers(self) -> list[str] | None:
        choice = self.config["log_with"]
        if choice in (None, "none"):
            return None
        if choice == "auto":
            try:
                import tensorboard  # noqa: F401  (optional: only whether it is installed)
            except ImportError:
                return None
            return ["tensorboard"]
        return [choice] if isinstance(choice, str) else list(choice)

    def _load_data(self) -> None:
        ctx = self.context
        ctx.train, ctx.valid = self.task.load_data()
        data = self.config["data"]
        ctx.plan = BatchPlan(len(ctx.train), self.config["seed"], data["batch_size"], self.world, self.rank)

    def _collate(self, idx: list[int]) -> dict[str, Any]:
        batch, n_tokens = self.task.batch(self.context.train.items, idx)
        return {**batch, "num_tokens": n_tokens}

    def _trains(self, stage: str) -> Trains:
        """What ``stage`` trains (:class:`Trains`); a stage of one's own may return the config value."""
        trains = self.stages[stage].trains()
        try:
            return Trains(trains)
        except ValueError:
            raise ValueError(f"stage {stage!r}: trains() returned {trains!r}; it must be one of "
                             f"{[t.value for t in Trains]}") from None

    def _enter(self, stage: str) -> None:
        """Give the model the structure of ``stage`` (LoRA adapters in, or merged out)."""
        self.setup.enter(self._trains(stage), self.config["stages"][stage])

    @torch.no_grad()
    def validate(self) -> dict[str, float]:
        """Held-out score: perplexity (causal_lm), the task metric (classification), Spearman ×100 of
        cosine similarities against gold scores (sentence_embedding on STS-B pairs)."""
        valid, model = self.context.valid, self.context.model
        if not len(valid):
            return {}
        was_training = model.training
        model.eval()
        data = self.config["data"]
        n = min(len(valid), data["validation_batches"] * data["batch_size"])
        try:
            return self.task.validate(model, valid.items[:n], data["batch_size"])
        finally:
            model.train(was_training)

    # ---------------------------------------------------------------- main loop
    def run(self) -> Path:
        cfg, ctx = self.config, self.context
        created = _new_folder(self.out)
        try:  # until the run's first write (folder.start): a failure leaves no folder this run created
            self.folder.prepare(self.resume)
            check_training_data(cfg, glue_rows=not self.task.language_model)  # before the model loads
            self.setup.load()  # every layer index and kernel option checked against the model, then patched
            self._load_data()
        except Exception:
            if created is not None and self.main:
                shutil.rmtree(created, ignore_errors=True)
            raise
        state, resume_from = self.folder.start(self.resume, self.world, cfg)
        self.accelerator.init_trackers("tensorboard")
        self.task.before_training()
        self.t0 = time.perf_counter() - state["seconds"]
        self.cpu0 = time.process_time() - state.get("cpu_seconds", 0.0)
        active = [s for s in configured_stages(cfg) if cfg["stages"][s]["steps"] > 0]
        unsharded = [s for s in active if not self.stages[s].fsdp]
        if self.accelerate_fsdp and (unsharded or len(active) != 1):
            raise ValueError(f"accelerate's FSDP shards the model once and for good, so it runs one stage that "
                             f"shards (the full stage) alone here; this run's stages are {active}: set the other "
                             "stages' steps to 0 (or run them first under configs/accelerate/gpu-ddp.yaml and convert "
                             "the result)")
        done_before = active.index(state["stage"]) if state["stage"] in active else -1
        if resume_from is None and cfg["validate"]:
            self._log_validation(state, "start")
        for i, stage in enumerate(active):
            if self.stages[stage].applies_auto_choice:
                self.setup.apply_auto_choices()
            self._enter(stage)
            if i < done_before:
                continue
            if i == done_before:  # the checkpoint's stage: load its weights (and continue it if unfinished)
                ctx.model.load_state_dict(ckpt.load_file(resume_from, "model.pt"))
                if state["stage_done"]:
                    continue
                self._run_stage(stage, state, resume_from)
            else:
                state.update(stage=stage, stage_step=0, stage_done=False, stage_seconds=0.0)
                self._run_stage(stage, state, None)
        self.setup.apply_auto_choices()
        path = self.folder.save_final(ctx.model, ctx.tokenizer, self.task, self.setup.source, cfg, state,
                                      self.sharded)
        self.accelerator.end_training()
        return path

    def _run_stage(self, stage: str, state: dict[str, Any], resume_from: Path | None) -> None:
        cfg = self.config
        stage_cfg = cfg["stages"][stage]
        ctx = self.context
        params = self.setup.set_trainable(self._trains(stage), stage_cfg)
        if not params:
            if self.main:
                print(f"stage {stage}: {cfg['kernel']!r} has no trainable parameters here; skipped", flush=True)
            state.update(stage_done=True)
            return
        acc = self.accelerator
        ctx.model.train(self.stages[stage].train_mode)  # transfer: the teacher and student see no dropout
        checkpointing = cfg["gradient_checkpointing"] and self.stages[stage].train_mode  # HF: in train mode only
        if checkpointing:
            ctx.base_model().gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        # accelerate's FSDP shards the model in every stage it prepares; ours (sharding: fsdp) the full stage
        ours = cfg["sharding"] == "fsdp" and self.stages[stage].fsdp
        self.sharded = self.world > 1 and (self.accelerate_fsdp or ours)
        if self.sharded and not self.accelerate_fsdp:
            sharding.shard(ctx.model)
            params = [p for p in ctx.model.parameters() if p.requires_grad]
            local, total = sharding.local_parameter_count(ctx.model)
            print(f"sharding: fsdp: process {self.rank} holds {local} of the model's {total} parameter elements "
                  f"({local / total:.3f})", flush=True)
        optimizer = torch.optim.AdamW(params, lr=stage_cfg["lr"], weight_decay=stage_cfg["weight_decay"])
        scheduler = make_scheduler(optimizer, stage_cfg)
        if resume_from is not None:
            if not self.sharded:
                optimizer.load_state_dict(ckpt.load_file(resume_from, "optimizer.pt"))
            scheduler.load_state_dict(ckpt.load_file(resume_from, "scheduler.pt"))
        loader = torch.utils.data.DataLoader(SampleIndex(len(ctx.train)), collate_fn=self._collate,
                                             batch_sampler=PlanBatches(ctx.plan, state["position"]))
        if self.sharded and not self.accelerate_fsdp:
            net = ctx.model
            optimizer, scheduler, loader = acc.prepare(optimizer, scheduler, loader)
        else:
            net, optimizer, scheduler, loader = acc.prepare(ctx.model, optimizer, scheduler, loader)
        if resume_from is not None:
            if self.sharded:
                saved = ckpt.load_file(resume_from, "optimizer.pt")
                sharding.load_full_optimizer_state(net, optimizer.optimizer, saved)
            ckpt.set_rng_state(ckpt.load_file(resume_from, "rng.pt"))
        ctx.net = net
        try:
            self._steps(stage, state, net, params, optimizer, scheduler, iter(loader))
        finally:
            ctx.net = None
            if not (self.sharded and not self.accelerate_fsdp):
                ctx.model = _unwrap(acc, net)
            acc.free_memory()
            if checkpointing:
                ctx.base_model().gradient_checkpointing_disable()
        if cfg["validate"]:
            self._log_validation(state, stage)

    def _steps(self, stage: str, state: dict[str, Any], net, params, optimizer, scheduler, batches) -> None:
        """Optimizer steps of ``stage`` until its steps or its budget run out, saving checkpoints on the way."""
        cfg = self.config
        stage_cfg = cfg["stages"][stage]
        acc = self.accelerator
        accum, budget = cfg["data"]["grad_accum"], stage_cfg["max_minutes"]
        clip = stage_cfg["max_grad_norm"]
        clock = _budget_clock(cfg["budget_clock"])
        stage_start = clock() - state["stage_seconds"]
        bar = None
        if self.main:
            bar = tqdm(total=stage_cfg["steps"], initial=state["stage_step"], desc=stage, dynamic_ncols=True)
        said = None  # wall clock of the last progress line: one at the first step, the last, and every
        # PROGRESS_SECONDS between (the bar alone says nothing in a log file, or beside other processes' output)
        while state["stage_step"] < stage_cfg["steps"]:
            reached(f"begin-step-{state['global_step'] + 1}")
            step_start = time.perf_counter()
            loss_sum, tokens, lr = 0.0, 0, scheduler.get_last_lr()[0]
            for _ in range(accum):
                batch = next(batches)
                state["position"] += self.context.plan.global_batch
                tokens += batch.pop("num_tokens")
                with acc.accumulate(net):
                    loss = self.stages[stage].loss(batch)
                    acc.backward(loss)
                    loss_sum += loss.item() / accum
                    if acc.sync_gradients:
                        if clip:
                            acc.clip_grad_norm_(params, clip)
                        optimizer.step()
                        scheduler.step()
                        optimizer.zero_grad(set_to_none=True)
            loss_value = self._reduce(loss_sum, "mean")
            tokens = int(self._reduce(tokens, "sum"))
            state["global_step"] += 1
            state["stage_step"] += 1
            state["tokens"] += tokens
            state["seconds"] = time.perf_counter() - self.t0
            state["cpu_seconds"] = time.process_time() - self.cpu0
            state["stage_seconds"] = clock() - stage_start
            reached(f"step-{state['global_step']}")
            step_seconds = time.perf_counter() - step_start
            record = {"stage": stage, "step": state["global_step"], "stage_step": state["stage_step"],
                      "loss": loss_value, "lr": lr, "tokens": state["tokens"],
                      "seconds": round(state["seconds"], 3), "cpu_seconds": round(state["cpu_seconds"], 3),
                      "tokens_per_second": round(tokens / step_seconds, 1)}
            self.folder.log(record)
            acc.log({f"{stage}/loss": loss_value, f"{stage}/lr": lr}, step=state["global_step"])
            if bar is not None:
                bar.set_postfix(loss=f"{loss_value:.4g}", tok_s=f"{tokens / step_seconds:.0f}")
                bar.update(1)
            over = budget is not None and state["stage_seconds"] >= 60 * budget
            if over and state["stage_step"] < stage_cfg["steps"]:
                over = self._reduce(float(over), "max") > 0
            last = state["stage_step"] >= stage_cfg["steps"] or over
            now = time.perf_counter()
            if bar is not None and (last or said is None or now - said >= PROGRESS_SECONDS):
                said = now
                bar.write(f"{stage}: step {state['stage_step']}/{stage_cfg['steps']} (run step "
                          f"{state['global_step']}), loss {loss_value:.4g}, {tokens / step_seconds:.0f} tokens/s, "
                          f"{state['seconds']:.0f} s", file=sys.stdout)
                sys.stdout.flush()
            if last:
                state["stage_done"] = True
                if over and self.main:
                    print(f"stage {stage}: budget of {budget} min ({cfg['budget_clock']} clock) reached after "
                          f"{state['stage_step']} steps", flush=True)
            if last or (cfg["save_every"] and state["global_step"] % cfg["save_every"] == 0):
                self.folder.save_checkpoint(dict(state), self.context.model, optimizer, scheduler, self.sharded,
                                            cfg["keep_checkpoints"])
            if last:
                break
        if bar is not None:
            bar.close()

    def _log_validation(self, state: dict[str, Any], stage: str) -> None:
        scores = self.validate() if self.main or self.sharded else {}  # a sharded forward needs every process
        if self.main:
            record = {"stage": stage, "step": state["global_step"], "tokens": state["tokens"],
                      "seconds": round(time.perf_counter() - self.t0, 3), **scores}
            self.folder.log(record, VALIDATION_FILE)
            print(f"validation after {stage}: {scores}", flush=True)
        self._wait()


def _unwrap(accelerator, net: torch.nn.Module) -> torch.nn.Module:
    """The model inside a prepared ``net`` with its own forward back. accelerate's ``keep_fp32_wrapper=False``
    unwraps every ``__wrapped__`` layer, which strips transformers' own decorators from ``forward`` too (its
    ``return_dict`` handling); the autocast wrapper is dropped here by restoring the saved forward instead."""
    model = accelerator.unwrap_model(net)
    original = model.__dict__.pop("_original_forward", None)
    if original is not None:
        if getattr(original, "__func__", None) is getattr(type(model), "forward", None):
            model.__dict__.pop("forward", None)  # the class's forward again
        else:
            model.forward = original
    return model


def _new_folder(path: Path) -> Path | None:
    """The outermost folder on the way to ``path`` that does not exist yet (None: ``path`` exists)."""
    path, new = path.absolute(), None
    while not path.exists() and path != path.parent:
        new, path = path, path.parent
    return new


def finetune(config: dict[str, Any], resume: bool = False) -> Path:
    """Run the conversion described by ``config`` (see :mod:`hf_kernel_attn.training.config`)."""
    return Trainer(config, resume=resume).run()


def _budget_clock(kind: str):
    """Seconds for ``max_minutes``: wall-clock, or (``cpu``) this process's CPU time divided by torch's thread
    count -- the minutes the run would take with its threads to itself, so a budget measured on a shared
    machine does not shrink when other work competes for the cores."""
    if kind == "cpu":
        threads = max(1, torch.get_num_threads())
        return lambda: time.process_time() / threads
    return time.perf_counter

