"""`beamrl parity`: compare SGLang's logprobs and routes with the reference model on a checkpoint (docs/parity.md)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from beamrl.dtypes import RUN_DTYPES

NAME = "parity"
HELP = "Score the same tokens in SGLang and the reference Beam model; report logprob gaps and routing agreement."


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--checkpoint", required=True, type=Path, help="Beam checkpoint directory (SGLang format)")
    parser.add_argument("--engine", default="sglang", choices=["sglang", "none"],
                        help="engine to compare (default sglang; 'none' with --trainer: trainer vs reference only)")
    parser.add_argument("--dtype", default="float32", choices=sorted(RUN_DTYPES), help="dtype of both sides")
    parser.add_argument("--json", type=Path, default=None, help='write {"comparisons": [...]} to this file')
    parser.add_argument("--num-sequences", type=int, default=8, help="random prompts to score (default 8)")
    parser.add_argument("--seq-len", type=int, default=64, help="tokens per prompt (default 64)")
    parser.add_argument("--gen-len", type=int, default=16, help="generated tokens per prompt for routes (default 16)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random prompts and the engine (default 0)")
    parser.add_argument("--dump", type=Path, default=None,
                        help="also save the engine's raw outputs (prompts, logprobs, routes) to this .pt file")
    parser.add_argument("--timeout", type=float, default=600.0, help="engine start / call timeout in s (default 600)")
    trainer = parser.add_argument_group("trainer parity (--trainer megatron; docs/trainer.md)")
    trainer.add_argument("--trainer", default=None, choices=["megatron"],
                         help="also score the prompts with a multi-process Megatron trainer in the layout below "
                              "and add megatron-vs-reference (and megatron-vs-sglang) rows")
    trainer.add_argument("--tp", type=int, default=1, help="tensor parallel size (default 1)")
    trainer.add_argument("--sp", action="store_true", help="sequence parallelism (needed with MoE when --tp > 1)")
    trainer.add_argument("--ep", type=int, default=1, help="expert parallel size (default 1)")
    trainer.add_argument("--pp", type=int, default=1, help="pipeline parallel size (default 1)")
    trainer.add_argument("--vpp", type=int, default=None, help="virtual pipeline stages per rank (default none)")


def run(args: argparse.Namespace) -> int:
    from beamrl.parity.comparison import format_table, write_json
    from beamrl.parity.sglang_parity import ParityInputError, ParitySettings, main_log, run_sglang_parity
    from beamrl.protocols.rollout import EngineError
    from beamrl.trainer.megatron.launch import LaunchError

    try:
        settings = ParitySettings(checkpoint=args.checkpoint, dtype=args.dtype, num_sequences=args.num_sequences,
                                  seq_len=args.seq_len, gen_len=args.gen_len, seed=args.seed,
                                  start_timeout=args.timeout, call_timeout=args.timeout,
                                  dump_path=args.dump)
        if args.trainer == "megatron":
            rows = _run_megatron(args, settings, main_log)
        elif args.engine == "none":
            raise ParityInputError("--engine none needs --trainer megatron (nothing to compare otherwise)")
        else:
            rows = [run_sglang_parity(settings, log=main_log)]
    except ParityInputError as e:
        print(f"beamrl parity: error: {e}", file=sys.stderr)
        return 2
    except EngineError as e:
        print(f"beamrl parity: engine error: {e}", file=sys.stderr)
        return 1
    except LaunchError as e:
        print(f"beamrl parity: the Megatron run failed: {e}", file=sys.stderr)
        return 1
    print(format_table(rows))
    if args.json is not None:
        write_json(rows, args.json)
        print(f"wrote {args.json}", file=sys.stderr)
    return 0


def _run_megatron(args: argparse.Namespace, settings, log):
    from beamrl.parity.megatron_parity import MegatronLayout, run_megatron_parity, run_with_sglang

    layout = MegatronLayout(tp=args.tp, sp=args.sp, ep=args.ep, pp=args.pp, vpp=args.vpp)
    if args.engine == "sglang":
        return run_with_sglang(settings, layout, log=log)
    return run_megatron_parity(settings.checkpoint, layout, settings.dtype, settings.num_sequences,
                               settings.seq_len, settings.seed, settings.call_timeout, log=log)
