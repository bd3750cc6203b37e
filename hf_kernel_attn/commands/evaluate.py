"""Evaluation commands: ``eval``, ``leaderboard`` and ``lm-eval`` (lm-eval's own command line)."""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from ..evaluation.lm_eval_tasks import local_task_args, register_model
from ..evaluation.runner import EvalSettings, ModelSpec, check_press, run_eval, summary_table
from ..evaluation.tasks import get_tasks
from ..kernel_args import check_param_targets, kernel_options, parse_kernel_spec, parse_params
from ..kernels import SOFTMAX
from ..leaderboard.runner import leaderboard
from ..model_paths import locate_model
from ..training.model_card import add_eval_results

LM_EVAL_DESCRIPTION = """\
lm-eval's own command line (lm-evaluation-harness) with the model type hf-kernel-attn registered:
  --model hf-kernel-attn --model_args pretrained=PATH[,kernel=NAME,layers=JSON,kernel_params=JSON,gguf_file=F]
patches kernel NAME in; without kernel=, a saved kernel model runs its own kernel; PATH may be pkg:PACKAGE[/SUB].
  --data-dir DIR [--split validation|test]: run the named --tasks offline on the local files of EVAL_SPLITS.md
(lm-eval's stock task configs with the dataset swapped; tasks: arc_easy, arc_challenge, lambada_openai, piqa,
boolq, copa, openbookqa)."""


def eval_kernel(kernel: str | None, items: list[str] | None) -> tuple[str | None, dict[str, Any]]:
    """``eval --kernel [NAME[:KEY=VALUE,...]] --param [NAME.]KEY=VALUE`` -> (NAME or None, options). Without
    ``--kernel`` the options go to the model's saved kernel, so only ``KEY=VALUE`` can be given."""
    params = parse_params(items)
    if kernel is None:
        qualified = sorted(k for k in params if k is not None)
        if qualified:
            raise ValueError(f"--param {qualified[0]}.KEY=VALUE names a kernel, but no --kernel is given: without "
                             "--kernel the model runs its saved kernel; give its options as --param KEY=VALUE")
        return None, params.get(None, {})
    name, inline = parse_kernel_spec(kernel)
    check_param_targets(params, [name])
    return name, kernel_options(name, inline, params, softmax=SOFTMAX)


def eval_command(args: argparse.Namespace) -> int:
    path = locate_model(args.model, args.gguf_file)
    if args.update_card and not (Path(path) / "README.md").is_file():
        raise ValueError(f"--update-card: no model card at {str(Path(path) / 'README.md')!r} (checkpoints "
                         "written by `hf-kernel-attn finetune` have one); evaluate without --update-card")
    if args.threads:
        torch.set_num_threads(args.threads)
    kernel, options = eval_kernel(args.kernel, args.param)
    spec = ModelSpec(args.model, args.gguf_file, kernel, args.layers, options)
    settings = EvalSettings(split=args.split, data_dir=args.data_dir, limit=args.limit, batch_size=args.batch_size,
                            context=args.context, stride=args.stride, lengths=args.lengths, depths=args.depths,
                            samples=args.samples, seed=args.seed, output=args.output, plot_dir=args.plot_dir,
                            press=args.press, compression=args.compression, press_bytes=args.press_bytes)
    if args.press is not None:
        try:  # run_eval checks this too; here a missing kvpress is an `error:` line, not a traceback
            check_press(settings, get_tasks(args.tasks), spec)
        except ImportError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    records = run_eval(spec, args.tasks, settings)
    print(summary_table(records))
    if args.update_card:
        print(f"model card updated: {add_eval_results(path, records, limit=args.limit)}")
    return 0


def leaderboard_command(args: argparse.Namespace) -> int:
    table = leaderboard(args.config, data_dir=args.data_dir, output_dir=args.output_dir,
                        retry_errors=args.retry_errors, jobs=args.jobs, overrides=args.set, quick=args.quick)
    print(table["markdown"])
    print(f"({table['seconds']:.0f} s)")
    return 0


def lm_eval_command(argv: list[str], prog: str) -> int:
    """lm-eval's own command line, with the hf-kernel-attn model type registered and its help naming ``prog``."""
    register_model()
    task_dir = tempfile.TemporaryDirectory(prefix="hf_kernel_attn-lm-eval-tasks-")
    try:
        argv = local_task_args(argv, task_dir.name)  # --data-dir DIR [--split S]: local copies of the stock tasks
    except ValueError as exc:
        task_dir.cleanup()
        print(f"error: {exc}", file=sys.stderr)
        return 2
    saved_argv, sys.argv = sys.argv, ["lm_eval", *argv]  # lm-eval reads sys.argv
    try:
        try:  # lm-eval >= 0.4.9: HarnessCLI; rename its parsers so that --help names this command
            from lm_eval._cli import HarnessCLI  # optional API: older lm-eval has only cli_evaluate
            from lm_eval.utils import setup_logging
        except ImportError:
            from lm_eval.__main__ import cli_evaluate

            cli_evaluate()
            return 0
        setup_logging()
        cli = HarnessCLI()
        rename_lm_eval_parsers(cli, prog)
        cli.execute(cli.parse_args())
    finally:
        sys.argv = saved_argv
        task_dir.cleanup()
    return 0


def rename_lm_eval_parsers(cli: Any, prog: str) -> None:
    """``lm-eval`` -> ``prog`` in the usage lines of lm-eval's parser and its subcommands' (private attributes
    of lm-eval's HarnessCLI: skipped where they are missing)."""
    parser, subparsers = getattr(cli, "_parser", None), getattr(cli, "_subparsers", None)
    if not isinstance(parser, argparse.ArgumentParser):
        return
    parser.prog = prog
    parser.description = LM_EVAL_DESCRIPTION + (f"\n\n{parser.description}" if parser.description else "")
    for name, sub in getattr(subparsers, "choices", {}).items():
        sub.prog = f"{prog} {name}"
        if sub.usage:
            sub.usage = sub.usage.replace("lm-eval", prog, 1)
