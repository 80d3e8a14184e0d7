"""The `nanoforge` command: parses arguments and calls the modules that do the work, nothing else."""
from __future__ import annotations

import argparse
import dataclasses
import math
import sys

from nanoforge import __version__
from nanoforge.core.config import MODEL_FIELDS, PRESETS, TRAIN_FIELDS, LoraConfig, ModelConfig, TrainConfig
from nanoforge.data.options import PrepareOptions
from nanoforge.eval.options import EvalOptions
from nanoforge.infer.options import CHAT_SAMPLING, ChatOptions, DeviceOptions
from nanoforge.recipes.options import DistillOptions, DPOOptions
from nanoforge.rl.options import PPOOptions, RLOptions
from nanoforge.serve.options import ServeOptions


def number(kind: type, interval: str = "(-inf, inf)"):
    """The argparse type of every numeric flag, the one check of them all: a `kind` (int or float) that is finite
    and in `interval` ("[0, 1)": 0 included, 1 not), else a usage error (exit 2) before any work."""
    low, high = (float(end) for end in interval[1:-1].split(","))
    what = f"{'>' if interval[0] == '(' else '>='} {low:g}" if high == math.inf else f"in {interval}"

    def parse(text: str):
        value = kind(text)  # a ValueError: argparse's "invalid int value: 'x'" (it names the type by __name__)
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"{text} is not a finite number")
        if not (low < value < high or value == low and interval[0] == "[" or value == high and interval[-1] == "]"):
            raise argparse.ArgumentTypeError(f"{text} must be {what}")
        return value
    parse.__name__, parse.interval = kind.__name__, interval  # interval: for the test that walks every flag
    return parse


INT_GE1, INT_GE0, FLOAT_GT0, FLOAT_GE0 = (number(int, "[1, inf)"), number(int, "[0, inf)"),
                                          number(float, "(0, inf)"), number(float, "[0, inf)"))


def _resume_value(text: str) -> str:
    if text != "auto":
        raise argparse.ArgumentTypeError(f"{text!r}: the one value is auto (--resume alone continues the run)")
    return text


def add_resume_flag(p: argparse.ArgumentParser) -> None:
    """--resume on every training command (grpo too: call this, and commands.run resolves `auto`)."""
    p.add_argument("--resume", nargs="?", const=True, default=False, type=_resume_value, metavar="auto",
                   help="continue the run in --out from its latest checkpoint; `--resume auto`: continue it if it "
                        "holds a checkpoint, else start fresh (one command line for every (re)start)")


def add_config_flags(p: argparse.ArgumentParser, presets: bool = True, exclude: tuple[str, ...] = ()) -> None:
    """--preset, --config and one --field-name flag per config field, defaults shown in --help."""
    if presets:
        p.add_argument("--preset", choices=sorted(PRESETS), help="model/training preset (default: mini when no "
                       "--config is given)")
    p.add_argument("--config", metavar="FILE.toml", help="TOML file with [model] and [train] sections")
    for title, cls, names in (("model", ModelConfig, MODEL_FIELDS), ("training", TrainConfig, TRAIN_FIELDS)):
        group = p.add_argument_group(f"{title} config fields (override preset and --config)")
        defaults = cls()
        for name, f in names.items():
            if name in exclude:
                continue
            default = getattr(defaults, name)
            what = f.metadata["help"].replace("%", "%%")  # argparse formats help with %
            group.add_argument(f"--{name.replace('_', '-')}", dest=f"cfg_{name}", metavar=_metavar(f),
                               help=f"{what} (default: {default!r})" if what else f"(default: {default!r})")


def add_option_flags(p: argparse.ArgumentParser, cls, given_only: bool = False) -> None:
    """One --field-name flag per field of a command's options dataclass (config.option), its default the field's
    (or, given an instance, the instance's value; a field marked flag=False has none): a number in the field's
    interval, a store_true for a bool, nargs/choices/metavar and help as the field says (config.option).
    given_only: an omitted flag stays out of the namespace (argparse.SUPPRESS; the dataclass default fills it), so
    that a --resume keeps the run's saved value, and the help states the default itself."""
    for f in (f for f in dataclasses.fields(cls) if f.metadata.get("flag", True)):
        flag, default = dict(f.metadata), getattr(cls, f.name)
        kind = f.type.split(" ")[0]  # the annotation's text: "int", "float | None", ...
        interval, what = flag.pop("interval") or "(-inf, inf)", flag.pop("help").replace("%", "%%")
        if given_only and default not in (None, False) and "(default" not in what:
            what += f" (default: {default})"
        if kind == "bool":
            flag["action"] = "store_true"
        elif kind in ("int", "float"):
            flag["type"] = number(int if kind == "int" else float, interval)
        p.add_argument(f"--{f.name.replace('_', '-')}", default=argparse.SUPPRESS if given_only else default,
                       help=what, **flag)


def add_tokenizer_flag(p: argparse.ArgumentParser) -> None:
    """--tokenizer for a model given as MiniMind's .pth, which holds none (weights/minimind.py)."""
    p.add_argument("--tokenizer", metavar="DIR", help="the tokenizer of a MiniMind .pth model (its model/ folder; "
                   "default: a tokenizer.json beside the .pth or in ../model); runs and HF directories bring their own")


def add_split_flag(p: argparse.ArgumentParser) -> None:
    """--split, after a --data that takes HF datasets directories (commands.choose_split reads it)."""
    p.add_argument("--split", dest="dataset_split", default="train", metavar="NAME",
                   help="a datasets DatasetDict directory in --data (`load_dataset(...).save_to_disk(DIR)`): the "
                        "split to read")


def add_data_flags(p: argparse.ArgumentParser, what: str) -> None:
    """A training command's --data (`what` it takes), and --split for a DatasetDict directory among them."""
    p.add_argument("--data", nargs="*", default=[], metavar="PATH", help=what)
    add_split_flag(p)


def add_run_flags(p: argparse.ArgumentParser, exclude: tuple[str, ...] = ()) -> None:
    """The last flags of a fine-tuning command: --tokenizer (for a .pth --init), --resume, --quiet, then the
    config's (no presets: the shape comes from --init)."""
    add_tokenizer_flag(p)
    add_resume_flag(p)
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    add_config_flags(p, presets=False, exclude=exclude)


def _metavar(f: dataclasses.Field) -> str:
    kind = f.type if isinstance(f.type, str) else f.type.__name__
    return {"int": "N", "float": "X", "bool": "BOOL", "str": "STR"}[kind]


class _Formatter(argparse.ArgumentDefaultsHelpFormatter):
    """Show defaults, except where the help already says it or there is none to show."""

    def _get_help_string(self, action):
        if "(default" in (action.help or "") or action.default in (None, False, []):
            return action.help
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    fmt = _Formatter
    parser = argparse.ArgumentParser(prog="nanoforge", description="Train small GPT language models from scratch.")
    parser.add_argument("--version", action="version", version=f"nanoforge {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    add_data_parsers(sub, fmt)
    add_training_parsers(sub, fmt)
    add_tool_parsers(sub, fmt)
    add_inference_parsers(sub, fmt)
    return parser


def add_data_parsers(sub, fmt) -> None:
    """demo, report, tokenizer and prepare: the data and the results around training."""
    demo = sub.add_parser("demo", help="the whole pipeline on documentation found on this machine (CPU, minutes)",
                          formatter_class=fmt)
    demo.add_argument("--out", default="runs/demo", metavar="DIR", help="work directory (a previous demo's goes)")
    demo.add_argument("--minutes", type=FLOAT_GT0, default=5.0, help="time budget; training steps are sized to fit it")

    rep = sub.add_parser("report", help="markdown report (loss, lr, grad norm, tokens/s, memory plots; config, data, "
                         "time, metrics, samples) for one run or several side by side; training commands write "
                         "RUN/report.md themselves", formatter_class=fmt)
    rep.add_argument("runs", nargs="+", metavar="RUN", help="run directories")
    rep.add_argument("--out", required=True, metavar="FILE.md", help="report path (PNG plots are written beside it)")

    tok = sub.add_parser("tokenizer", help="train a byte-level BPE tokenizer", formatter_class=fmt)
    tok_sub = tok.add_subparsers(dest="tokenizer_command", metavar="ACTION", required=True)
    tt = tok_sub.add_parser("train", help="train on JSONL (text or conversations) or .txt files", formatter_class=fmt)
    tt.add_argument("--data", nargs="+", required=True, metavar="FILE", help="JSONL or .txt files")
    tt.add_argument("--vocab-size", type=INT_GE1, default=6400, help="vocabulary size including special tokens")
    tt.add_argument("--min-frequency", type=INT_GE0, default=2, help="minimum pair frequency for a merge")
    tt.add_argument("--out", required=True, metavar="DIR", help="output directory (written atomically)")
    tt.add_argument("--force", action="store_true", help="replace --out if it exists and is not empty")

    prep = sub.add_parser("prepare", help="tokenize JSONL into token shards for training; `prepare merge DIR... "
                          "--out DIR` combines prepared parts", formatter_class=fmt)
    prep.add_argument("--kind", required=True, choices=["pretrain", "sft", "dpo"], help="record format")
    prep.add_argument("--data", required=True, nargs="+", metavar="FILE", help="JSONL or Parquet files, HF datasets "
                      "directories (save_to_disk), or (pretrain) plain-text .txt/.md files")
    add_split_flag(prep)
    prep.add_argument("--tokenizer", required=True, metavar="DIR", help="tokenizer directory or tokenizer.json")
    prep.add_argument("--out", required=True, metavar="DIR", help="output directory (written atomically)")
    add_option_flags(prep, PrepareOptions)
    merge = add_merge_parser(prep, "write --out over the prepared DIRs (a manifest referencing their shards; no token "
                             "is copied)", fmt)
    merge.add_argument("parts", nargs="+", metavar="DIR", help="the prepared directories, in order")
    merge.add_argument("--out", required=True, metavar="DIR", help="output directory (written atomically)")
    merge.add_argument("--force", action="store_true", help="replace --out if it exists")
    merge.add_argument("--allow-incomplete", action="store_true", help="merge even when some parts of a --part I/N "
                       "splitting are not given (by default every part must be)")


def add_merge_parser(p: argparse.ArgumentParser, what: str, fmt) -> argparse.ArgumentParser:
    """`prepare merge` and `lora merge`: the subcommand of a command that also runs without one. argparse would
    ask for the command's own required flags after `merge` too, so they are required only without it (main)."""
    alone = [a for a in p._actions if a.required]
    for action in alone:
        action.required = False
    p.set_defaults(required_alone=(p, alone))
    return p.add_subparsers(dest="action", metavar="ACTION").add_parser("merge", help=what, formatter_class=fmt)


def add_training_parsers(sub, fmt) -> None:
    """The training commands: pretrain, sft, lora, dpo, grpo, ppo, distill."""
    pre = sub.add_parser("pretrain", help="pretrain a GPT on a token stream", formatter_class=fmt)
    add_data_flags(pre, "a prepared directory, or JSONL files (prepared into RUN/data)")
    pre.add_argument("--out", required=True, metavar="RUN_DIR", help="run directory")
    add_resume_flag(pre)
    pre.add_argument("--tokenizer", metavar="DIR", help="tokenizer for raw JSONL (default: train one on the data); "
                     "with a MiniMind .pth --init, its tokenizer")
    pre.add_argument("--init", metavar="RUN_OR_CHECKPOINT",
                     help="continue pretraining from this run, checkpoint, HF model directory or MiniMind .pth (its "
                          "shape and tokenizer; a fresh optimizer and schedule) instead of random weights")
    pre.add_argument("--quiet", action="store_true", help="no progress lines")
    add_config_flags(pre)

    sft = sub.add_parser("sft", help="supervised fine-tuning on conversations (loss on assistant replies)",
                         formatter_class=fmt)
    sft.add_argument("--init", metavar="RUN_OR_CHECKPOINT", help="the pretrained run, checkpoint, HF dir or "
                     "MiniMind .pth to use")
    add_data_flags(sft, "a directory from `prepare --kind sft`, or conversation JSONL files")
    sft.add_argument("--out", required=True, metavar="RUN_DIR", help="run directory")
    add_run_flags(sft)

    lora = sub.add_parser("lora", help="LoRA fine-tuning on conversations; `lora merge RUN --out DIR` folds "
                          "the adapters into the base", formatter_class=fmt)
    lora.add_argument("--init", metavar="RUN_OR_CHECKPOINT", help="the base run, checkpoint or HF model dir to adapt")
    add_data_flags(lora, "a directory from `prepare --kind sft`, or conversation JSONL files")
    lora.add_argument("--out", required=True, metavar="RUN_DIR", help="run directory")
    add_option_flags(lora, LoraConfig, given_only=True)
    add_run_flags(lora, exclude=("dropout",))
    merge = add_merge_parser(lora, "write RUN's base with the adapters folded in to --out", fmt)
    merge.add_argument("run", metavar="RUN", help="the LoRA run or checkpoint")
    merge.add_argument("--out", required=True, metavar="DIR", help="output directory")

    dpo = sub.add_parser("dpo", help="direct preference optimisation on chosen/rejected pairs", formatter_class=fmt)
    dpo.add_argument("--init", metavar="RUN_OR_CHECKPOINT", help="the SFT run, checkpoint or HF model directory "
                     "to align; it is also the frozen reference")
    add_data_flags(dpo, "a directory from `prepare --kind dpo`, or DPO JSONL files")
    dpo.add_argument("--out", required=True, metavar="RUN_DIR", help="run directory")
    add_option_flags(dpo, DPOOptions, given_only=True)
    add_run_flags(dpo)

    add_rl_parser(sub, fmt, "grpo")
    add_rl_parser(sub, fmt, "ppo")

    dist = sub.add_parser("distill", help="distill a teacher run into a student (a run or a preset)",
                          formatter_class=fmt)
    dist.add_argument("--teacher", metavar="RUN", help="the run or checkpoint to learn from")
    dist.add_argument("--init", metavar="RUN_OR_PRESET",
                      help=f"the student: a run/checkpoint, or a preset for a fresh one ({', '.join(PRESETS)})")
    add_data_flags(dist, "pretraining or SFT data: a prepared directory or JSONL files")
    dist.add_argument("--out", required=True, metavar="RUN_DIR", help="run directory")
    add_option_flags(dist, DistillOptions, given_only=True)
    add_run_flags(dist)


def add_tool_parsers(sub, fmt) -> None:
    """plan, bench, eval and export: before, beside and after training."""
    plan = sub.add_parser("plan", help="memory, batch and time a run will need, before running it", formatter_class=fmt)
    plan.add_argument("--device", default="rtx3090", help="cpu, rtx3090, rtx4090, a100-40g, a100-80g, h100, h200, "
                      "l4, t4")
    plan.add_argument("--global-batch", type=INT_GE1, help="target sequences per optimizer step (default: "
                      "batch_size x grad_accum)")
    plan.add_argument("--tokens", type=FLOAT_GT0, help="training tokens, for a projected wall time")
    plan.add_argument("--mfu", type=number(float, "(0, 1]"), default=0.40,
                      help="assumed model-FLOPs utilisation on a GPU")
    plan.add_argument("--tokens-per-s", type=FLOAT_GT0, help="measured throughput to project with instead")
    add_config_flags(plan, exclude=("device",))

    bench = sub.add_parser("bench", help="tokens/s, MFU, peak memory and time split of the training loop",
                           formatter_class=fmt)
    bench.add_argument("--steps", type=INT_GE1, default=10, help="timed steps (medians are taken over them)")
    bench.add_argument("--warmup", type=INT_GE0, default=2, help="untimed steps first (allocator, compilation)")
    bench.add_argument("--data", metavar="DIR", help="a prepared directory to read batches from (default: random "
                       "tokens from a fixed seed)")
    bench.add_argument("--compare-naive", action="store_true", help="also run a naive fp32 hand-written loop and "
                       "show both side by side")
    bench.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    bench.add_argument("--quiet", action="store_true", help="no progress lines")
    add_config_flags(bench)

    ev = sub.add_parser("eval", help="loss / bits per byte on data, multiple-choice benchmarks, GSM8K, tool calls, "
                        "samples", formatter_class=fmt)
    ev.add_argument("run", metavar="RUN", help="run directory, checkpoint, HF model directory or MiniMind .pth")
    add_tokenizer_flag(ev)
    add_option_flags(ev, EvalOptions)

    exp = sub.add_parser("export", help="write a run as an HF transformers directory, a GGUF file or MiniMind's "
                         ".pth", formatter_class=fmt)
    exp.add_argument("run", metavar="RUN_OR_CHECKPOINT", help="run directory (latest checkpoint), checkpoint, HF "
                     "directory or MiniMind .pth")
    add_tokenizer_flag(exp)
    exp.add_argument("--format", choices=("hf", "gguf", "minimind"), default="hf", help="output format")
    exp.add_argument("--out", required=True, help="directory (hf); .gguf file or existing directory (gguf); .pth "
                     "file or directory for MiniMind's {weight}_{hidden}.pth (minimind)")
    exp.add_argument("--dtype", choices=("f32", "f16"), help="tensor type (default: f32 for gguf, f16 for minimind, "
                     "as MiniMind's trainers save)")
    exp.add_argument("--force", action="store_true", help="replace an existing output")


def add_inference_parsers(sub, fmt) -> None:
    """chat, generate and serve: a trained model at work."""
    chat = sub.add_parser("chat", help="talk to a trained model in the terminal (streaming)", formatter_class=fmt)
    chat.add_argument("run", metavar="RUN", help="run directory (its latest checkpoint), checkpoint, HF directory "
                      "or MiniMind .pth")
    add_tokenizer_flag(chat)
    add_option_flags(chat, CHAT_SAMPLING)

    gen = sub.add_parser("generate", help="continue a plain-text prompt (a pretrained model; no chat template)",
                         formatter_class=fmt)
    gen.add_argument("run", metavar="RUN", help="run directory (its latest checkpoint), checkpoint, HF directory "
                     "or MiniMind .pth")
    add_tokenizer_flag(gen)
    gen.add_argument("--prompt", help="text to continue (default: standard input; empty: a new document)")
    gen.add_argument("--num-samples", type=INT_GE1, default=1, help="continuations to write, one after another")
    add_option_flags(gen, CHAT_SAMPLING)
    add_option_flags(gen, DeviceOptions)

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP API and a web chat page", formatter_class=fmt)
    serve.add_argument("run", metavar="RUN", help="run directory (its latest checkpoint), checkpoint, HF directory "
                       "or MiniMind .pth")
    add_tokenizer_flag(serve)
    add_option_flags(serve, ServeOptions)
    add_option_flags(serve, DeviceOptions)
    add_option_flags(chat, ChatOptions)
    add_option_flags(chat, DeviceOptions)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    parser, required = vars(args).pop("required_alone", (None, []))
    missing = [a.option_strings[0] for a in required if args.action is None and getattr(args, a.dest) is None]
    if missing:  # `prepare` or `lora` without `merge` (add_merge_parser): the message argparse gives
        parser.error(f"the following arguments are required: {', '.join(missing)}")
    # The one import left for later: the commands load torch (about a second) and the modules that do the work,
    # which `--help` and a usage error do not need.
    from nanoforge import commands
    return commands.run(args)


RL_STAGES = {  # name: (options, help, what --init is), recipes/grpo.py and recipes/ppo.py
    "grpo": (RLOptions, "reinforcement learning with verifiable rewards: GRPO, CISPO or REINFORCE on groups of "
             "sampled replies", "train; also the frozen reference of the KL term"),
    "ppo": (PPOOptions, "reinforcement learning with PPO: a critic from the policy's weights, GAE, clipped policy "
            "and value losses, KL penalty, early stop on approximate KL", "train (its weights also start the "
            "critic); also the frozen reference of the KL penalty"),
}


def add_rl_parser(sub, fmt, name: str) -> None:
    """`nanoforge grpo` and `nanoforge ppo`: RL on sampled replies to a prompts file, each with its options."""
    options, what, init = RL_STAGES[name]
    rl = sub.add_parser(name, help=what, formatter_class=fmt)
    rl.add_argument("--init", metavar="RUN_OR_CHECKPOINT", help=f"the SFT run, checkpoint or HF model directory to "
                    f"{init}")
    rl.add_argument("--data", metavar="FILE.jsonl", help="prompts: chats ending in a user turn (or an empty "
                    'assistant placeholder), GSM8K\'s {"question", "answer"}; "answer"/"gt" for the rewards')
    rl.add_argument("--out", required=True, metavar="RUN_DIR", help="run directory")
    add_option_flags(rl, options, given_only=True)
    add_run_flags(rl)


if __name__ == "__main__":
    sys.exit(main())
