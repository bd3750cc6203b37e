"""Conversion training: attention transfer, then LoRA and/or full fine-tuning, under accelerate.

Stages run in the order transfer -> distill -> lora -> full; a stage with ``steps: 0`` is skipped.

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

import copy
import inspect
import json
import os
import random
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import torch

from ..integration.layer_choice import (
    apply_head_choice,
    kv_group_size,
    measure_head_choice,
    measure_retrieval_head_choice,
    parse_auto,
    parse_heads,
)
from ..integration.loading import with_saved_kernel_options
from ..integration.modules import attention_modules, num_attention_layers
from ..integration.swap import patch
from . import checkpoint as ckpt
from . import sharding
from .config import configured_stages, dump_config
from .data import BatchPlan, PlanBatches, SampleIndex, check_training_data
from .events import reached
from .hub import push_folder
from .model_card import write_card
from .recall_data import recall_block_spans, recall_span_targets
from .schedules import make_scheduler
from .stages import STAGE_TYPES, Trains
from .tasks import TASK_TYPES

LOG_FILE = "training_log.jsonl"
PROGRESS_SECONDS = 30.0  # a progress line (stdout) at least this often in wall-clock time, besides the bar
VALIDATION_FILE = "validation.jsonl"
AUTO_LAYERS_FILE = "auto_layers.json"  # layers: auto:K -- the layers kept as softmax and every layer's error
AUTO_HEADS_FILE = "auto_heads.json"  # heads: auto:K -- the heads kept as exact softmax and every head's error
_LORA_TARGETS = {  # attention projections per architecture family (LoLCATs: q, k, v, o)
    "llama": ["q_proj", "k_proj", "v_proj", "o_proj"],
    "qwen2": ["q_proj", "k_proj", "v_proj", "o_proj"],
    "mistral": ["q_proj", "k_proj", "v_proj", "o_proj"],
    "bert": ["query", "key", "value", "attention.output.dense"],
    "gpt2": ["c_attn", "attn.c_proj"],
}


class Trainer:
    """One conversion run (see the module docstring); :meth:`run` returns ``output_dir/final``."""

    def __init__(self, config: dict[str, Any], resume: bool = False) -> None:
        from accelerate import Accelerator, DataLoaderConfiguration, DistributedType
        from accelerate.state import AcceleratorState

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
        self.task = config["task"]
        self.task_impl = TASK_TYPES[self.task](self)  # tasks/<name>.py: data, batches, loss, held-out score
        self.stages = {name: STAGE_TYPES[name](self) for name in configured_stages(config)}  # stages/<name>.py
        self.accelerate_fsdp = self.accelerator.distributed_type == DistributedType.FSDP
        self.sharded = False  # true while the full stage runs sharded (FSDP2)
        self.net: torch.nn.Module | None = None  # the model a training step runs: the prepared (wrapped) model

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

    # ---------------------------------------------------------------- setup
    def _trackers(self) -> list[str] | None:
        choice = self.config["log_with"]
        if choice in (None, "none"):
            return None
        if choice == "auto":
            try:
                import tensorboard  # noqa: F401
            except ImportError:
                return None
            return ["tensorboard"]
        return [choice] if isinstance(choice, str) else list(choice)

    def _check_output_dir(self) -> None:
        log = self.out / LOG_FILE
        if not self.resume and (ckpt.checkpoints(self.out) or (log.exists() and log.stat().st_size)
                                or (self.out / "final").exists()):
            raise ValueError(
                f"output_dir {str(self.out)!r} already holds a run (checkpoints, {LOG_FILE} or final/); pass "
                "--resume to continue it, or choose another output_dir"
            )

    def _model_source(self) -> str:
        """The checkpoint to load: the model folder/id, or a normal checkpoint converted from GGUF."""
        cfg = self.config
        if not cfg["gguf_file"]:
            return cfg["model"]
        from ..integration.loading import convert_gguf

        target = self.out / "base-model"
        if self.main and not (target / "config.json").exists():
            tmp = self.out / ".tmp-base-model"
            shutil.rmtree(tmp, ignore_errors=True)
            convert_gguf(cfg["model"], cfg["gguf_file"], tmp,
                         model_class=cfg["model_class"] or self.task_impl.auto_class)
            os.replace(tmp, target)
        self._wait()
        return str(target)

    def _load(self) -> None:
        import transformers
        from transformers import AutoTokenizer

        cfg = self.config
        source = self._model_source()
        self.source = source
        self.tokenizer = AutoTokenizer.from_pretrained(source)
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        cls = getattr(transformers, cfg["model_class"] or self.task_impl.auto_class)
        kwargs: dict[str, Any] = dict(cfg["config_overrides"])
        if kwargs:
            model_config = transformers.AutoConfig.from_pretrained(source)
            unknown = sorted(k for k in kwargs if not hasattr(model_config, k))
            if unknown:
                raise ValueError(f"config_overrides: {unknown} are not attributes of the {model_config.model_type} "
                                 f"config; it has {sorted(model_config.to_dict())}")
        kwargs.update(self.task_impl.model_kwargs())
        self._load_kwargs = kwargs
        torch.manual_seed(cfg["seed"])  # a new classification head is drawn from the seed
        model = cls.from_pretrained(source, **kwargs)
        if model.config.pad_token_id is None:
            model.config.pad_token_id = self.tokenizer.pad_token_id
        self.auto_keep = parse_auto(cfg["layers"])
        self._auto_applied = False
        self.auto_heads = parse_heads(cfg["heads"]) if cfg["heads"] else None
        self._heads_applied = False
        # layers: auto:K converts every layer first; the choice is made after attention transfer
        patch(model, kernel=cfg["kernel"], layers=None if self.auto_keep is not None else cfg["layers"],
              **cfg["kernel_params"])
        if self.auto_keep is not None and self.auto_keep > num_attention_layers(model):
            raise ValueError(f"layers: auto:{self.auto_keep} keeps more layers as softmax than the model has "
                             f"({num_attention_layers(model)})")
        model.to(self.device)
        # kernel parameters the kernel itself declares learnable (σ, g, hedgehog maps, learnable ω)
        self.kernel_params = {id(p) for n, p in model.named_parameters() if ".kernel_attn." in n and p.requires_grad}
        self.model = model
        self.forward_kwargs = set(inspect.signature(type(model).forward).parameters)

    def load_original_model(self) -> torch.nn.Module:
        """The model as it was before the run: softmax attention, the original weights (a distillation teacher)."""
        import transformers

        cls = getattr(transformers, self.config["model_class"] or self.task_impl.auto_class)
        return cls.from_pretrained(self.source, **self._load_kwargs)

    @property
    def teacher(self) -> torch.Tensor:
        """sentence_embedding: the original model's pooled embedding of each training sentence."""
        return self.task_impl.teacher

    def _load_data(self) -> None:
        self.train, self.valid = self.task_impl.load_data()
        data = self.config["data"]
        self.plan = BatchPlan(len(self.train), self.config["seed"], data["batch_size"], self.world, self.rank)

    # ---------------------------------------------------------------- batches
    def encode(self, texts_a: list[str], texts_b: list[str | None] | None = None) -> dict[str, torch.Tensor]:
        seq_len = self.config["data"]["seq_len"]
        if texts_b is not None and any(t is not None for t in texts_b):
            enc = self.tokenizer(texts_a, [t or "" for t in texts_b], padding=True, truncation=True,
                                 max_length=seq_len, return_tensors="pt")
        else:
            enc = self.tokenizer(texts_a, padding=True, truncation=True, max_length=seq_len, return_tensors="pt")
        return {k: v.to(self.device) for k, v in enc.items() if k in ("input_ids", "attention_mask",
                                                                      "token_type_ids")}

    # ---------------------------------------------------------------- objectives
    def student(self) -> torch.nn.Module:
        """The model a training step runs: during a stage the prepared one (DDP-wrapped, autocast), else the model."""
        return self.net if self.net is not None else self.model

    def _collate(self, idx: list[int]) -> dict[str, Any]:
        batch, n_tokens = self.task_impl.batch(self.train.items, idx)
        return {**batch, "num_tokens": n_tokens}

    # ---------------------------------------------------------------- automatic layer choice
    def _calibration_batches(self) -> list[dict[str, Any]]:
        """The held-out validation batches (the first training batches when there are none) as model inputs."""
        data = self.config["data"]
        rows = self.valid.items if len(self.valid) else self.train.items
        n = min(len(rows), data["validation_batches"] * data["batch_size"])
        bs = data["batch_size"]
        batches = []
        for s in range(0, n, bs):
            batches.append(self.task_impl.calibration_batch(rows[s:min(n, s + bs)]))
        return batches

    def _apply_auto_layers(self) -> None:
        """``layers: auto:K``: once attention transfer is over, keep the K layers with the largest transfer
        error on the held-out text as softmax (their kernels are dropped; the others keep their trained
        parameters). The choice is written to auto_layers.json and reused on resume."""
        if self.auto_keep is None or self._auto_applied:
            return
        from ..integration.layer_choice import apply_choice, measure_choice

        cfg = self.config
        path = self.out / AUTO_LAYERS_FILE
        if path.exists():
            record = json.loads(path.read_text())
        else:
            record = measure_choice(self.model, self.auto_keep, self._calibration_batches())
            if self.main:
                tmp = path.with_suffix(".tmp")
                tmp.write_text(json.dumps(record, indent=2) + "\n")
                os.replace(tmp, path)
            self._wait()
        apply_choice(self.model, cfg["kernel"], cfg["kernel_params"], record["softmax_layers"], record)
        self._auto_applied = True
        if self.main:
            worst = {i: round(record["errors"][str(i)], 6) for i in record["softmax_layers"]}
            print(f"layers auto:{self.auto_keep}: keeping layers {record['softmax_layers']} as softmax "
                  f"(transfer errors {worst}; all layers in {path})", flush=True)

    def _apply_auto_heads(self) -> None:
        """``heads: auto:K`` / ``retrieval:K``: once attention transfer is over (and after ``layers: auto:K``), keep
        K query heads (K KV heads with all their query heads, with ``heads_share_kv``) as exact softmax inside
        their layers (kernel option ``softmax_heads``): those with the largest transfer error (``auto``) or those
        where the softmax teacher puts the most attention on a stated fact while answering for it
        (``retrieval``; the calibration blocks then carry recall facts). With recall text
        (``data.recall_fraction``), ``auto`` measures on blocks with facts too. Written to auto_heads.json and
        reused on resume."""
        if self.auto_heads is None or self._heads_applied:
            return
        criterion, keep = self.auto_heads
        path = self.out / AUTO_HEADS_FILE
        if path.exists():
            record = json.loads(path.read_text())
        else:
            batches = self._calibration_batches()
            data = self.config["data"]
            group = kv_group_size(self.model) if self.config["heads_share_kv"] else 1
            if criterion == "retrieval" or data["recall_fraction"]:  # causal LMs only (config checks)
                def encode(text: str) -> list[int]:
                    return self.tokenizer(text, add_special_tokens=False)["input_ids"]

                rows, targets = [], []
                for b in batches:
                    # the rows' random streams of with_recall_facts(..., fraction=1, seed=seed + 1)
                    blocks = [recall_block_spans(row.tolist(), encode, random.Random(
                        (self.config["seed"] + 1) * 1_000_003 + j), data["recall_max_facts"])
                        for j, row in enumerate(b["input_ids"])]
                    rows.append({"input_ids": torch.tensor([blk for blk, _ in blocks], dtype=b["input_ids"].dtype)})
                    targets.append([recall_span_targets(spans) for _, spans in blocks])
                batches = rows
                if criterion == "retrieval" and not any(t for row in targets for t in row):
                    raise ValueError(f"heads: retrieval:{keep} found no room for a recall fact in the calibration "
                                     f"blocks of data.seq_len={data['seq_len']} tokens (a fact and its question "
                                     "take about 40 tokens, and must fit in half a block); raise data.seq_len")
            if criterion == "retrieval":
                record = measure_retrieval_head_choice(self.model, keep, batches, targets, group)
            else:
                record = measure_head_choice(self.model, keep, batches, group)
            if self.main:
                tmp = path.with_suffix(".tmp")
                tmp.write_text(json.dumps(record, indent=2) + "\n")
                os.replace(tmp, path)
            self._wait()
        apply_head_choice(self._base_model(), record)
        # the chosen layers' kernels were rebuilt (with their trained parameters): new parameter objects
        self.kernel_params = {id(p) for n, p in self.model.named_parameters()
                              if ".kernel_attn." in n and p.requires_grad}
        self._heads_applied = True
        if self.main:
            what = "errors" if criterion == "auto" else "retrieval scores"
            print(f"heads {criterion}:{keep}: exact softmax heads {record['softmax_heads']} (all heads' {what} in "
                  f"{path})", flush=True)

    def _base_model(self):
        return self.model.get_base_model() if self.is_peft() else self.model

    # ---------------------------------------------------------------- stages
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
        trains = self._trains(stage)
        if trains is Trains.LORA and not self.is_peft():
            self.model = self._wrap_lora(self.model, stage)
        elif trains is Trains.FULL and self.is_peft():
            self.model = self.model.merge_and_unload()

    def is_peft(self) -> bool:
        return type(self.model).__module__.startswith("peft")

    def _lora_targets(self, stage: str) -> list[str]:
        given = self.config["stages"][stage]["target_modules"]
        if given:
            return list(given)
        mtype = getattr(self.model.config, "model_type", "")
        if mtype in _LORA_TARGETS:
            return _LORA_TARGETS[mtype]
        names = set()
        for module in attention_modules(self.model):
            names |= {n for n, m in module.named_children() if isinstance(m, torch.nn.Linear)}
        if not names:
            raise ValueError(f"cannot find the attention projections of model type {mtype!r}; set "
                             "stages.lora.target_modules")
        return sorted(names)

    def _wrap_lora(self, model, stage: str):
        from peft import LoraConfig, get_peft_model

        lora = self.config["stages"][stage]
        task_type = self.task_impl.peft_task_type
        cfg = LoraConfig(r=lora["r"], lora_alpha=lora["alpha"], lora_dropout=lora["dropout"],
                         target_modules=self._lora_targets(stage), task_type=task_type)
        torch.manual_seed(self.config["seed"] + 1)  # LoRA A matrices
        return get_peft_model(model, cfg)

    def _set_trainable(self, stage: str) -> list[torch.nn.Parameter]:
        stage_cfg = self.config["stages"][stage]
        trains = self._trains(stage)
        chosen = stage_cfg.get("target_modules") if trains is Trains.FULL else None  # distill's train: full
        for n, p in self.model.named_parameters():
            is_kernel = id(p) in self.kernel_params
            if trains is Trains.KERNEL:
                p.requires_grad_(is_kernel)
            elif trains is Trains.LORA:
                adapter = "lora_" in n or "modules_to_save" in n
                p.requires_grad_(adapter or (is_kernel and stage_cfg["train_kernel"]))
            else:
                weight = ".kernel_attn." not in n and (chosen is None or any(f".{m}." in f".{n}" for m in chosen))
                p.requires_grad_(weight or (is_kernel and stage_cfg["train_kernel"]))
            if set(n.split(".")) & set(self.task_impl.unused_modules):
                p.requires_grad_(False)
        return [p for p in self.model.parameters() if p.requires_grad]

    def _checkpoint_tensors(self, optimizer, scheduler) -> dict[str, Any]:
        """What a checkpoint holds; sharded, the full tensors gathered to process 0 (every process calls this)."""
        if self.sharded:
            model_state = sharding.full_model_state(self.model)
            optimizer_state = sharding.full_optimizer_state(self.model, optimizer.optimizer)
        else:
            model_state, optimizer_state = self.model.state_dict(), optimizer.optimizer.state_dict()
        return {"model.pt": model_state, "optimizer.pt": optimizer_state,
                "scheduler.pt": scheduler.scheduler.state_dict(), "rng.pt": ckpt.rng_state()}

    def _save(self, state: dict[str, Any], optimizer, scheduler) -> None:
        tensors = self._checkpoint_tensors(optimizer, scheduler) if self.sharded or self.main else None
        if self.main:
            ckpt.save_checkpoint(self.out, state["global_step"], tensors, state)
            reached(f"prune-{state['global_step']}")
            ckpt.prune(self.out, self.config["keep_checkpoints"])
        self._wait()

    def _log(self, record: dict[str, Any], file: str = LOG_FILE) -> None:
        if self.main:
            line = json.dumps(record) + "\n"
            with open(self.out / file, "a") as f:
                reached(f"log-{record['step']}", file=f, line=line)
                f.write(line)

    def _truncate_log(self, step: int) -> None:
        """After a resume: keep only records up to the checkpoint's step (the rest are redone)."""
        if not self.main:
            return
        for name in (LOG_FILE, VALIDATION_FILE):
            path = self.out / name
            if not path.exists():
                continue
            keep = [ln for ln in ckpt.read_jsonl_lines(path) if json.loads(ln)["step"] <= step]
            tmp = path.with_suffix(".tmp")
            tmp.write_text("".join(ln + "\n" for ln in keep))
            os.replace(tmp, path)

    # ---------------------------------------------------------------- validation
    @torch.no_grad()
    def validate(self) -> dict[str, float]:
        """Held-out score: perplexity (causal_lm), the task metric (classification), Spearman ×100 of
        cosine similarities against gold scores (sentence_embedding on STS-B pairs)."""
        if not len(self.valid):
            return {}
        was_training = self.model.training
        self.model.eval()
        data = self.config["data"]
        n = min(len(self.valid), data["validation_batches"] * data["batch_size"])
        bs = data["batch_size"]
        try:
            return self.task_impl.validate(self.model, self.valid.items[:n], bs)
        finally:
            self.model.train(was_training)

    # ---------------------------------------------------------------- main loop
    def run(self) -> Path:
        cfg = self.config
        self.out.mkdir(parents=True, exist_ok=True)
        if self.main:
            self._check_output_dir()
            ckpt.remove_partial(self.out)
        self._wait()
        check_training_data(cfg, glue_rows=not self.task_impl.language_model)  # before the model loads
        self._load()
        self._load_data()
        state = {"global_step": 0, "stage": None, "stage_step": 0, "stage_done": False, "position": 0,
                 "tokens": 0, "seconds": 0.0, "cpu_seconds": 0.0, "stage_seconds": 0.0, "world": self.world}
        resume_from = ckpt.latest_checkpoint(self.out) if self.resume else None
        if self.resume and self.main:
            for bad in ckpt.incomplete_checkpoints(self.out):
                print(f"--resume: skipping {bad}: its files do not match its {ckpt.MANIFEST} (damaged, or written "
                      "before checkpoints had one)", flush=True)
        if self.resume and resume_from is None and self.main:
            print(f"--resume: no complete checkpoint in {self.out}; starting from the beginning", flush=True)
        if resume_from is not None:
            state = ckpt.read_state(resume_from)
            if self.main:
                print(f"resuming from {resume_from} (stage {state['stage']}, step {state['global_step']})",
                      flush=True)
            self._truncate_log(state["global_step"])
        elif self.main:
            self._truncate_log(-1)
        if self.main:
            dump_config(cfg, self.out / "config.resolved.yaml")
        self.accelerator.init_trackers("tensorboard")
        self.task_impl.before_training()
        self.t0 = time.perf_counter() - state["seconds"]
        self.cpu0 = time.process_time() - state.get("cpu_seconds", 0.0)
        active = [s for s in configured_stages(cfg) if cfg["stages"][s]["steps"] > 0]
        if self.accelerate_fsdp and active != ["full"]:
            raise ValueError(f"accelerate's FSDP shards the model once and for good, so it runs the full stage alone "
                             f"here; this run's stages are {active}: set the other stages' steps to 0 (or run them "
                             "first under configs/accelerate/gpu-ddp.yaml and convert the result)")
        done_before = active.index(state["stage"]) if state["stage"] in active else -1
        if resume_from is None and cfg["validate"]:
            self._log_validation(state, "start")
        for i, stage in enumerate(active):
            if self.stages[stage].applies_auto_choice:
                self._apply_auto_layers()
                self._apply_auto_heads()
            if i < done_before:
                self._enter(stage)
                continue
            self._enter(stage)
            if i == done_before:  # the checkpoint's stage: load its weights (and continue it if unfinished)
                self.model.load_state_dict(ckpt.load_file(resume_from, "model.pt"))
                if state["stage_done"]:
                    continue
                self._run_stage(stage, state, resume_from)
            else:
                state.update(stage=stage, stage_step=0, stage_done=False, stage_seconds=0.0)
                self._run_stage(stage, state, None)
        self._apply_auto_layers()
        self._apply_auto_heads()
        path = self._save_final(state)
        self.accelerator.end_training()
        return path

    def _run_stage(self, stage: str, state: dict[str, Any], resume_from: Path | None) -> None:
        cfg = self.config
        stage_cfg = cfg["stages"][stage]
        params = self._set_trainable(stage)
        if not params:
            if self.main:
                print(f"stage {stage}: {cfg['kernel']!r} has no trainable parameters here; skipped", flush=True)
            state.update(stage_done=True)
            return
        acc = self.accelerator
        self.model.train(self.stages[stage].train_mode)  # transfer: the teacher and student see no dropout
        checkpointing = cfg["gradient_checkpointing"] and self.stages[stage].train_mode  # HF: in train mode only
        if checkpointing:
            self._base_model().gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        # accelerate's FSDP shards the model in every stage it prepares; ours (sharding: fsdp) the full stage
        ours = cfg["sharding"] == "fsdp" and self.stages[stage].fsdp
        self.sharded = self.world > 1 and (self.accelerate_fsdp or ours)
        if self.sharded and not self.accelerate_fsdp:
            sharding.shard(self.model)
            params = [p for p in self.model.parameters() if p.requires_grad]
            local, total = sharding.local_parameter_count(self.model)
            print(f"sharding: fsdp: process {self.rank} holds {local} of the model's {total} parameter elements "
                  f"({local / total:.3f})", flush=True)
        optimizer = torch.optim.AdamW(params, lr=stage_cfg["lr"], weight_decay=stage_cfg["weight_decay"])
        scheduler = make_scheduler(optimizer, stage_cfg)
        if resume_from is not None:
            if not self.sharded:
                optimizer.load_state_dict(ckpt.load_file(resume_from, "optimizer.pt"))
            scheduler.load_state_dict(ckpt.load_file(resume_from, "scheduler.pt"))
        loader = torch.utils.data.DataLoader(SampleIndex(len(self.train)), collate_fn=self._collate,
                                             batch_sampler=PlanBatches(self.plan, state["position"]))
        if self.sharded and not self.accelerate_fsdp:
            net = self.model
            optimizer, scheduler, loader = acc.prepare(optimizer, scheduler, loader)
        else:
            net, optimizer, scheduler, loader = acc.prepare(self.model, optimizer, scheduler, loader)
        if resume_from is not None:
            if self.sharded:
                saved = ckpt.load_file(resume_from, "optimizer.pt")
                sharding.load_full_optimizer_state(net, optimizer.optimizer, saved)
            ckpt.set_rng_state(ckpt.load_file(resume_from, "rng.pt"))
        self.net = net
        try:
            self._steps(stage, state, net, params, optimizer, scheduler, iter(loader))
        finally:
            self.net = None
            if not (self.sharded and not self.accelerate_fsdp):
                self.model = _unwrap(acc, net)
            acc.free_memory()
            if checkpointing:
                self._base_model().gradient_checkpointing_disable()
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
            from tqdm.auto import tqdm

            bar = tqdm(total=stage_cfg["steps"], initial=state["stage_step"], desc=stage, dynamic_ncols=True)
        said = None  # wall clock of the last progress line: one at the first step, the last, and every
        # PROGRESS_SECONDS between (the bar alone says nothing in a log file, or beside other processes' output)
        while state["stage_step"] < stage_cfg["steps"]:
            reached(f"begin-step-{state['global_step'] + 1}")
            step_start = time.perf_counter()
            loss_sum, tokens, lr = 0.0, 0, scheduler.get_last_lr()[0]
            for _ in range(accum):
                batch = next(batches)
                state["position"] += self.plan.global_batch
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
            self._log(record)
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
                self._save(dict(state), optimizer, scheduler)
            if last:
                break
        if bar is not None:
            bar.close()

    def _log_validation(self, state: dict[str, Any], stage: str) -> None:
        scores = self.validate() if self.main or self.sharded else {}  # a sharded forward needs every process
        if self.main:
            record = {"stage": stage, "step": state["global_step"], "tokens": state["tokens"],
                      "seconds": round(time.perf_counter() - self.t0, 3), **scores}
            self._log(record, VALIDATION_FILE)
            print(f"validation after {stage}: {scores}", flush=True)
        self._wait()

    def _final_scores(self) -> dict[str, float]:
        """The last held-out scores the run logged (validation.jsonl), for the model card."""
        path = self.out / VALIDATION_FILE
        lines = ckpt.read_jsonl_lines(path) if path.exists() else []
        if not lines:
            return {}
        last = json.loads(lines[-1])
        return {k: v for k, v in last.items() if k.startswith("val_") and isinstance(v, (int, float))}

    def _save_final(self, state: dict[str, Any]) -> Path:
        final = self.out / "final"
        full_state = sharding.full_model_state(self.model) if self.sharded else None
        if self.main:
            model = self.model
            if self.is_peft() and self.config["merge_lora"]:
                model = copy.deepcopy(model).merge_and_unload()
            tmp = self.out / ".tmp-final"
            shutil.rmtree(tmp, ignore_errors=True)
            reached("save-final")
            try:
                model.save_pretrained(tmp, state_dict=full_state)
                kattn = getattr(model.config, "kernel_attention", None)
                if self.config["inference_params"]:  # options that need no training, e.g. a sparse cache
                    kattn = with_saved_kernel_options(model.config, self.config["inference_params"]).kernel_attention
                    written = json.loads((tmp / "config.json").read_text())
                    written["kernel_attention"] = kattn  # the rest of what save_pretrained wrote stays
                    (tmp / "config.json").write_text(json.dumps(written, indent=2, sort_keys=True) + "\n")
                self.tokenizer.save_pretrained(tmp)
                self.task_impl.save_extras(Path(self.source), tmp)
                write_card(tmp, self.config, kattn, self._final_scores(), state)
            except BaseException as exc:  # torch, safetensors and tokenizers report a full disk in their own types
                free = ckpt.free_bytes(self.out)
                shutil.rmtree(tmp, ignore_errors=True)
                if not isinstance(exc, Exception):
                    raise
                raise ckpt.write_failed("the final model", self.out, exc, free) from exc
            reached("final")
            ckpt.replace_folder(tmp, final, "final")
            print(f"saved the converted model to {final}", flush=True)
            if self.config["push_to_hub"]:
                repo = self.config["hub_model_id"] or self.out.resolve().name
                url = push_folder(final, repo, private=self.config["hub_private_repo"])
                print(f"pushed {final} to {url}", flush=True)
        self._wait()
        return final


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

