"""`python -m sdsat.train`: train SATs, resume a run, or export a trained adapter.

Every TrainConfig field is a flag (`--seq-len 256`, `--target-modules q_proj v_proj`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import typing
from pathlib import Path

from . import trainer
from .trainer import TrainConfig, train


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m sdsat.train", description=__doc__,
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    hints = typing.get_type_hints(TrainConfig)
    for f in dataclasses.fields(TrainConfig):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        flag = "--" + f.name.replace("_", "-")
        if f.name == "weights":
            parser.add_argument(flag, type=json.loads, default=default, help="source weights as JSON")
        elif f.name in ("target_modules", "layers"):
            parser.add_argument(flag, nargs="+", type=str if f.name == "target_modules" else int, default=default)
        else:
            kind = {int: int, float: float, str: str}.get(hints[f.name], str)
            parser.add_argument(flag, type=kind, default=default)
    parser.add_argument("--export", metavar="DIR", help="after training, copy the trained SATs and record into DIR, "
                        "all at once (a crash never leaves half an export); other files in DIR are kept")
    return parser


def main(argv: list[str] | None = None) -> int:
    from ..cli import guarded

    return guarded(_main, argv)


def _main(argv: list[str] | None) -> int:
    args = vars(_parser().parse_args(argv))
    export = args.pop("export")
    config = TrainConfig(**args)
    train(config)  # a bad setting or a damaged checkpoint: ValueError, one line from guarded
    if export:
        trainer.export(Path(config.out) / "sats", Path(export))
        print(f"exported {Path(config.out) / 'sats'} -> {export}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
