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


# One line of help per TrainConfig field; ArgumentDefaultsHelpFormatter appends each default.
_METAVARS = {int: "N", float: "X", str: "STR"}
_HELP = {
    "mode": "adapter (frozen base; SAT embeddings + SAT-only LoRA; lossless) or paper (fine-tune the model)",
    "model": "base model: the embedded default, a hub id or a local folder",
    "out": "run folder: corpus, checkpoints, training record, trained SATs (re-running resumes)",
    "num_sats": "SATs trained = the largest k the decoder may use",
    "rank": "adapter: LoRA rank of the SAT-only updates (0: SAT embeddings only)",
    "alpha": "adapter: LoRA scale numerator (the update is scaled by alpha / rank)",
    "target_modules": "adapter: projection names that get SAT-only LoRA updates",
    "layers": "adapter: decoder layer indices with updates (None: --inject-layer and above)",
    "inject_layer": "adapter: decoder layer where the SAT embeddings enter; backprop stops there (0: input)",
    "per_position": "adapter: each SAT position gets LoRA updates of its own, num_sats times the room (from a shared "
                    "--init-from, each position starts as a copy of the shared updates)",
    "mlp_width": "adapter: extra MLP neurons in each adapted layer that only SAT rows use (0: none; from an "
                 "--init-from without them, they start adding nothing)",
    "sat_token": "paper: the vocabulary token used as SAT (also the adapter's initial embedding)",
    "paper_lora_rank": "paper: 0 fine-tunes every weight, > 0 trains LoRA (peft) of this rank",
    "target": "adapter: argmax (match the base model's token) or distribution (its full distribution)",
    "dtype": "compute precision: bfloat16 (autocast: products in bfloat16, losses and trained weights float32) "
             "or float32 (the shipped adapter's)",
    "offset_decay": "loss weight of SAT j is decay ** j (1.0: equal weights)",
    "latent_weight": "adapter: weight of the latent consistency term, each SAT row's final hidden state pulled "
                     "toward the standard token's at the position it stands for (relative squared distance, "
                     "weighted per SAT as the token loss is, --on-policy-weight included; 0: none)",
    "on_policy_weight": "adapter: extra loss weight on SATs whose draft greedy decoding would test and reject (every "
                        "draft before it in its run right, its own wrong), found afresh each step (0: none)",
    "steps": "optimizer steps in total (a resumed run continues to this step)",
    "batch_size": "sequences per optimizer step",
    "seq_len": "standard tokens per training sequence",
    "runs_per_seq": "SAT runs inserted at random points of each sequence",
    "lr": "peak learning rate, reached after warm-up",
    "lr_schedule": "after warm-up: cosine (decay to 0 at --steps) or constant (a run stopped at step n equals a "
                   "run of n steps: resume with more --steps for the next point of a learning curve)",
    "embedding_lr_scale": "adapter: learning-rate multiplier for SAT embeddings that enter above layer 0",
    "warmup": "warm-up steps (linear rise to --lr)",
    "seed": "seed of data, SAT layouts and initialisation",
    "code_files": "standard-library Python files for the raw-code source",
    "code_prompts": "function signatures + docstrings completed by the base model (self-distillation)",
    "chat_prompts": "chat instructions answered by the base model (self-distillation)",
    "distill_tokens": "new tokens per self-distilled completion",
    "distill_batch": "completions generated at once while building the corpus",
    "corpus": "a corpus folder built by python -m sdsat.train.corpus (its completions replace the built-in ones; "
              "read afresh at each start, so a growing corpus is used as it stands)",
    "corpus_modes": "which decodings of --corpus to train on (greedy text teaches greedy drafts best)",
    "init_from": "adapter: start from this trained adapter's weights, e.g. the shipped one (a fresh optimizer "
                 "and schedule; the shapes must match)",
    "weights": "sampling weight per source, as JSON",
    "held_out": "sequences per source kept out of training for evaluation",
    "eval_every": "steps between held-out acceptance evaluations",
    "checkpoint_every": "steps between checkpoints",
    "save_at": "steps whose SATs are also saved, each as <out>/sats-step<N> (the points of a learning curve)",
}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m sdsat.train", description=__doc__,
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    hints = typing.get_type_hints(TrainConfig)
    for f in dataclasses.fields(TrainConfig):
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        flag = "--" + f.name.replace("_", "-")
        if f.name == "weights":
            parser.add_argument(flag, type=json.loads, default=default, metavar="JSON", help=_HELP.get(f.name))
        elif f.name in ("target_modules", "corpus_modes", "layers", "save_at"):
            named = f.name in ("target_modules", "corpus_modes")
            parser.add_argument(flag, nargs="+", type=str if named else int, default=default,
                                metavar="NAME" if named else "N", help=_HELP.get(f.name))
        elif hints[f.name] is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=_HELP.get(f.name))
        else:
            kind = {int: int, float: float, str: str}.get(hints[f.name], str)
            parser.add_argument(flag, type=kind, default=default, metavar=_METAVARS[kind], help=_HELP.get(f.name))
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
