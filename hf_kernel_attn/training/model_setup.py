"""The model side of a conversion run: loading (a GGUF file converted once), the kernel swap, the automatic layer
and head choices made after attention transfer, LoRA adapters in and out, and which parameters each stage trains.
:func:`.config_against_model.check_against_model` checks every layer index and kernel option of the config against
the loaded model before anything trains.

:class:`ModelSetup` keeps :class:`.context.RunContext` current: ``context.model`` is the model being converted,
replaced when adapters go in (:meth:`ModelSetup.enter`) or are merged.
"""

from __future__ import annotations

import inspect
import json
import os
import random
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import transformers
from peft import LoraConfig, get_peft_model

from ..configfile import ConfigError
from ..fileio import write_text_atomic
from ..integration.layer_choice import (
    apply_choice,
    apply_head_choice,
    kv_group_size,
    measure_choice,
    measure_head_choice,
    measure_retrieval_head_choice,
    parse_auto,
    parse_heads,
)
from ..integration.loading import convert_gguf, local_model_path
from ..integration.modules import attention_modules, num_attention_layers
from ..integration.patching import kernel_config
from ..integration.swap import patch
from .config_against_model import check_against_model, check_inference_options
from .context import RunContext
from .recall_data import recall_rows, recall_span_targets
from .stages import Trains
from .tasks import TrainingTask

AUTO_LAYERS_FILE = "auto_layers.json"  # layers: auto:K -- the layers kept as softmax and every layer's error
AUTO_HEADS_FILE = "auto_heads.json"  # heads: auto:K -- the heads kept as exact softmax and every head's error
LORA_TARGETS = {  # attention projections per architecture family (LoLCATs: q, k, v, o)
    "llama": ["q_proj", "k_proj", "v_proj", "o_proj"],
    "qwen2": ["q_proj", "k_proj", "v_proj", "o_proj"],
    "mistral": ["q_proj", "k_proj", "v_proj", "o_proj"],
    "bert": ["query", "key", "value", "attention.output.dense"],
    "gpt2": ["c_attn", "attn.c_proj"],
}


class ModelSetup:
    """Loads the run's model into ``context`` and changes its structure between stages.

    ``out`` is the run's folder; ``main`` whether this process writes shared files; ``wait`` a barrier across
    the run's processes (every process calls each method; the main one writes, the others read)."""

    def __init__(self, context: RunContext, task: TrainingTask, out: Path, main: bool,
                 wait: Callable[[], None]) -> None:
        self.context = context
        self.task = task
        self.config = context.config
        self.out = out
        self.main = main
        self.wait = wait
        self.source = ""
        self.kernel_params: set[int] = set()  # ids of the kernels' own learnable parameters
        self.auto_keep: int | None = None
        self.auto_heads: tuple[str, int] | None = None
        self._auto_applied = self._heads_applied = False
        self._load_kwargs: dict[str, Any] = {}

    # ---------------------------------------------------------------- loading
    def model_source(self) -> str:
        """The checkpoint to load: the model folder/id, or a normal checkpoint converted from GGUF."""
        cfg = self.config
        if not cfg["gguf_file"]:
            return cfg["model"]
        target = self.out / "base-model"
        if self.main and not (target / "config.json").exists():
            tmp = self.out / ".tmp-base-model"
            shutil.rmtree(tmp, ignore_errors=True)
            convert_gguf(cfg["model"], cfg["gguf_file"], tmp, model_class=cfg["model_class"] or self.task.auto_class)
            os.replace(tmp, target)
        self.wait()
        return str(target)

    def _model_class(self) -> type:
        return getattr(transformers, self.config["model_class"] or self.task.auto_class)

    def check_architecture(self) -> None:
        """The config against the model's architecture before any weight is read or a GGUF file converted: the
        model built from its config.json (or the GGUF file's metadata) on the meta device, checked by
        :func:`check_against_model`, so that a bad layer index or kernel option fails in seconds."""
        cfg = self.config
        kwargs = {"gguf_file": cfg["gguf_file"]} if cfg["gguf_file"] else {}
        model_config = transformers.AutoConfig.from_pretrained(local_model_path(cfg["model"]), **kwargs)
        for key, value in cfg["config_overrides"].items():
            if hasattr(model_config, key):  # (unknown keys are refused by load(), naming them)
                setattr(model_config, key, value)
        with torch.device("meta"):
            model = self._model_class().from_config(model_config)
        check_against_model(cfg, model)

    def load(self) -> None:
        """Tokenizer and model into the context, the kernel swapped in (every layer for ``layers: auto:K``)."""
        cfg, ctx = self.config, self.context
        self.check_architecture()
        self.source = self.model_source()
        tokenizer = transformers.AutoTokenizer.from_pretrained(self.source)
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        kwargs: dict[str, Any] = dict(cfg["config_overrides"])
        if kwargs:
            model_config = transformers.AutoConfig.from_pretrained(self.source)
            unknown = sorted(k for k in kwargs if not hasattr(model_config, k))
            if unknown:
                raise ValueError(f"config_overrides: {unknown} are not attributes of the {model_config.model_type} "
                                 f"config; it has {sorted(model_config.to_dict())}")
        kwargs.update(self.task.model_kwargs())
        self._load_kwargs = kwargs
        torch.manual_seed(cfg["seed"])  # a new classification head is drawn from the seed
        model = self._model_class().from_pretrained(self.source, **kwargs)
        if model.config.pad_token_id is None:
            model.config.pad_token_id = tokenizer.pad_token_id
        self.auto_keep = parse_auto(cfg["layers"])
        self.auto_heads = parse_heads(cfg["heads"]) if cfg["heads"] else None
        if self.auto_keep is not None and self.auto_keep > num_attention_layers(model):
            raise ValueError(f"layers: auto:{self.auto_keep} keeps more layers as softmax than the model has "
                             f"({num_attention_layers(model)})")
        check_against_model(cfg, model)  # every index and kernel option, before anything trains
        # layers: auto:K converts every layer first; the choice is made after attention transfer
        patch(model, kernel=cfg["kernel"], layers=None if self.auto_keep is not None else cfg["layers"],
              **cfg["kernel_params"])
        model.to(ctx.device)
        ctx.tokenizer, ctx.model = tokenizer, model
        ctx.forward_kwargs = frozenset(inspect.signature(type(model).forward).parameters)
        ctx.load_original = self.load_original_model
        self._note_kernel_params()

    def load_original_model(self) -> torch.nn.Module:
        """The model as it was before the run: softmax attention, the original weights (a distillation teacher)."""
        return self._model_class().from_pretrained(self.source, **self._load_kwargs)

    def _note_kernel_params(self) -> None:
        """The kernel parameters the kernel itself declares learnable (σ, g, hedgehog maps, learnable ω)."""
        self.kernel_params = {id(p) for n, p in self.context.model.named_parameters()
                              if ".kernel_attn." in n and p.requires_grad}

    # ---------------------------------------------------------------- automatic layer and head choices
    def calibration_batches(self) -> list[dict[str, Any]]:
        """The held-out validation batches (the first training batches when there are none) as model inputs."""
        data, ctx = self.config["data"], self.context
        rows = ctx.valid.items if len(ctx.valid) else ctx.train.items
        n = min(len(rows), data["validation_batches"] * data["batch_size"])
        bs = data["batch_size"]
        return [self.task.calibration_batch(rows[s:min(n, s + bs)]) for s in range(0, n, bs)]

    def _write_choice(self, path: Path, record: dict[str, Any]) -> None:
        if self.main:
            write_text_atomic(path, json.dumps(record, indent=2) + "\n")
        self.wait()

    def apply_auto_choices(self) -> None:
        """The automatic layer choice, then the head choice (each once per run)."""
        self.apply_auto_layers()
        self.apply_auto_heads()

    def apply_auto_layers(self) -> None:
        """``layers: auto:K``: once attention transfer is over, keep the K layers with the largest transfer
        error on the held-out text as softmax (their kernels are dropped; the others keep their trained
        parameters). The choice is written to auto_layers.json and reused on resume."""
        if self.auto_keep is None or self._auto_applied:
            return
        cfg, model = self.config, self.context.model
        path = self.out / AUTO_LAYERS_FILE
        if path.exists():
            record = json.loads(path.read_text())
        else:
            record = measure_choice(model, self.auto_keep, self.calibration_batches())
            self._write_choice(path, record)
        apply_choice(model, cfg["kernel"], cfg["kernel_params"], record["softmax_layers"], record)
        try:  # inference_layers for a layer now softmax: an error now, not at the final save
            check_inference_options(cfg, model, kernel_config(model))
        except ConfigError as exc:
            raise ConfigError(f"{exc} (layers: auto:{self.auto_keep} keeps layers {record['softmax_layers']} as "
                              "softmax; the choice is in auto_layers.json, reused by --resume)") from None
        self._auto_applied = True
        if self.main:
            worst = {i: round(record["errors"][str(i)], 6) for i in record["softmax_layers"]}
            print(f"layers auto:{self.auto_keep}: keeping layers {record['softmax_layers']} as softmax "
                  f"(transfer errors {worst}; all layers in {path})", flush=True)

    def apply_auto_heads(self) -> None:
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
        ctx = self.context
        path = self.out / AUTO_HEADS_FILE
        if path.exists():
            record = json.loads(path.read_text())
        else:
            batches = self.calibration_batches()
            data = self.config["data"]
            group = kv_group_size(ctx.model) if self.config["heads_share_kv"] else 1
            if criterion == "retrieval" or data["recall_fraction"]:  # causal LMs only (config checks)
                batches, targets = self._recall_batches(batches, keep if criterion == "retrieval" else None)
            if criterion == "retrieval":
                record = measure_retrieval_head_choice(ctx.model, keep, batches, targets, group)
            else:
                record = measure_head_choice(ctx.model, keep, batches, group)
            self._write_choice(path, record)
        apply_head_choice(ctx.base_model(), record)
        check_inference_options(self.config, ctx.base_model(), kernel_config(ctx.base_model()))
        self._note_kernel_params()  # the chosen layers' kernels were rebuilt: new parameter objects
        self._heads_applied = True
        if self.main:
            what = "errors" if criterion == "auto" else "retrieval scores"
            print(f"heads {criterion}:{keep}: exact softmax heads {record['softmax_heads']} (all heads' {what} in "
                  f"{path})", flush=True)

    def _recall_batches(self, batches: list[dict[str, Any]], retrieval_keep: int | None
                        ) -> tuple[list[dict[str, Any]], list[list[Any]]]:
        """The calibration blocks with recall facts stated in them (the rows' random streams of
        ``with_recall_facts(..., fraction=1, seed=seed + 1)``) and each row's answer spans."""
        data = self.config["data"]

        def encode(text: str) -> list[int]:
            return self.context.tokenizer(text, add_special_tokens=False)["input_ids"]

        rows, targets = [], []
        for b in batches:
            rngs = [random.Random((self.config["seed"] + 1) * 1_000_003 + j) for j in range(len(b["input_ids"]))]
            ids, spans = recall_rows(b["input_ids"], encode, rngs, data["recall_max_facts"], data["recall_style"])
            rows.append({"input_ids": ids})
            targets.append([recall_span_targets(row) for row in spans])
        if retrieval_keep is not None and not any(t for row in targets for t in row):
            raise ValueError(f"heads: retrieval:{retrieval_keep} found no room for a recall fact in the calibration "
                             f"blocks of data.seq_len={data['seq_len']} tokens (a fact and its question "
                             "take about 40 tokens, and must fit in half a block); raise data.seq_len")
        return rows, targets

    # ---------------------------------------------------------------- a stage's structure and parameters
    def enter(self, trains: Trains, stage_cfg: dict[str, Any]) -> None:
        """Give the model the structure a stage that trains ``trains`` needs (LoRA adapters in, or merged out)."""
        ctx = self.context
        if trains is Trains.LORA and not ctx.is_peft():
            ctx.model = self._wrap_lora(ctx.model, stage_cfg)
        elif trains is Trains.FULL and ctx.is_peft():
            ctx.model = ctx.model.merge_and_unload()

    def lora_targets(self, stage_cfg: dict[str, Any]) -> list[str]:
        """The modules LoRA adapts: the stage's ``target_modules``, the family's attention projections, or every
        linear layer inside the attention modules."""
        given = stage_cfg["target_modules"]
        if given:
            return list(given)
        model = self.context.model
        mtype = getattr(model.config, "model_type", "")
        if mtype in LORA_TARGETS:
            return LORA_TARGETS[mtype]
        names = set()
        for module in attention_modules(model):
            names |= {n for n, m in module.named_children() if isinstance(m, torch.nn.Linear)}
        if not names:
            raise ValueError(f"cannot find the attention projections of model type {mtype!r}; set "
                             "stages.lora.target_modules")
        return sorted(names)

    def _wrap_lora(self, model: torch.nn.Module, stage_cfg: dict[str, Any]) -> torch.nn.Module:
        cfg = LoraConfig(r=stage_cfg["r"], lora_alpha=stage_cfg["alpha"], lora_dropout=stage_cfg["dropout"],
                         target_modules=self.lora_targets(stage_cfg), task_type=self.task.peft_task_type)
        torch.manual_seed(self.config["seed"] + 1)  # LoRA A matrices
        return get_peft_model(model, cfg)

    def set_trainable(self, trains: Trains, stage_cfg: dict[str, Any]) -> list[torch.nn.Parameter]:
        """Switch on the gradients of what a stage trains (kernel parameters, adapters, or weights -- a ``full``
        stage's ``target_modules`` only, where given); returns the trainable parameters."""
        model = self.context.model
        chosen = stage_cfg.get("target_modules") if trains is Trains.FULL else None  # distill's train: full
        for n, p in model.named_parameters():
            is_kernel = id(p) in self.kernel_params
            if trains is Trains.KERNEL:
                p.requires_grad_(is_kernel)
            elif trains is Trains.RETENTION:
                p.requires_grad_(".retention_gate." in f".{n}")
            elif trains is Trains.LORA:
                adapter = "lora_" in n or "modules_to_save" in n
                p.requires_grad_(adapter or (is_kernel and stage_cfg["train_kernel"]))
            else:
                weight = ".kernel_attn." not in n and (chosen is None or any(f".{m}." in f".{n}" for m in chosen))
                p.requires_grad_(weight or (is_kernel and stage_cfg["train_kernel"]))
            if set(n.split(".")) & set(self.task.unused_modules):
                p.requires_grad_(False)
        return [p for p in model.parameters() if p.requires_grad]
