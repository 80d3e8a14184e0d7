"""`nanoforge grpo`: the recipe of the group-relative RL stage (losses grpo, cispo, reinforce), read like the
other recipes (recipes/pretrain.py, sft.py, ...): setup -> prompts, rewards -> policy, reference -> Stage -> train().

The run directory is an ordinary one (config.toml with the RL options under [run], checkpoints, metrics.jsonl,
samples, report); --data is a prompts JSONL file (rl/prompts.py), read as it is, never prepared into shards."""
from __future__ import annotations

from dataclasses import fields
from functools import partial
from pathlib import Path
from typing import Any

from nanoforge.core.device import resolve_device
from nanoforge.core.errors import NanoforgeError
from nanoforge.chat.tools import parse_tool_names
from nanoforge.model.gpt import GPT
from nanoforge.rl.agent import agent_rollout, check_agent_prompts
from nanoforge.rl.losses import ADVANTAGES, LOSSES, NORMS
from nanoforge.rl.prompts import PromptIterator, read_prompts
from nanoforge.rl.reward_model import load_reward_model
from nanoforge.rl.rewards import RewardFn, check_records, combine, parse_rewards, parse_weights
from nanoforge.rl.rollout import check_prompts, rollout
from nanoforge.rl.grpo_batches import RolloutBatches, policy_count, policy_objective
from nanoforge.train.distributed import setup, world
from nanoforge.train.loop import Stage
from nanoforge.train.rundir import (PreparedRun, StageSetup, fresh_run_guard, given_fields, resolve_run_options,
                                    setup_from_init)
from nanoforge.recipes.common import initial_gpt, make_sampler, train_and_report
from nanoforge.rl.options import RLOptions

# Training defaults under --config and the flags. RL moves a model that already answers: small steps (1e-6..1e-5
# for real models; MiniMind's GRPO uses 3e-7 with a cosine schedule), constant, every step logged (a step is a
# rollout: the reward curve is the point), gradients clipped at 1.
GRPO_DEFAULTS = {"lr": 3e-6, "schedule": "constant", "warmup_steps": 0, "weight_decay": 0.0, "max_steps": 200,
                 "eval_every": 0, "save_every": 50, "log_every": 1, "grad_clip": 1.0, "sample_every": 0}


FLAGS = {f.name: "--" + f.name.replace("_", "-") for f in fields(RLOptions)}


def check_options(o: dict[str, Any], given: set[str]) -> None:
    for key, choices in (("loss", LOSSES), ("advantage", ADVANTAGES), ("loss_norm", NORMS)):
        if o[key] not in choices:
            raise NanoforgeError(f"{FLAGS[key]} {o[key]!r} is not one of {', '.join(choices)}")
    if o.get("tools") is not None:
        check_tool_options(o)
    elif "max_turns" in given:
        raise NanoforgeError("--max-turns only applies to multi-turn rollouts: add --tools calculator")
    elif not o.get("reward") and not o.get("reward_model"):
        raise NanoforgeError("--reward: no reward given (math, format, length, repetition, module:function) and "
                             "no --reward-model")


def check_tool_options(o: dict[str, Any]) -> None:
    """--tools: known tools and the agent reward alone (docs/rl.md, multi-turn)."""
    if not parse_tool_names(o["tools"]):
        raise NanoforgeError("--tools: no tool named; the built-in tools: calculator")
    given = [FLAGS[k] for k in ("reward", "reward_model") if o.get(k)]
    if given:
        raise NanoforgeError(f"{' and '.join(given)} with --tools: the reward of a multi-turn rollout is the agent "
                             'reward (valid calls, the record\'s "gt" found in the final answer, unfinished '
                             "penalty); drop " + " and ".join(given))


def resolve_options(out: Path, options: RLOptions, resume: bool, given=None) -> dict[str, Any]:
    """The options this run trains with: on --resume the saved ones (a different value given is an error)."""
    given = given_fields(options, given)
    resolved = resolve_run_options(out, options, resume, given)
    if resolved["tools"] is None and resolved["reward"] is None and not resolved["reward_model"]:
        resolved["reward"] = "math"
    check_options(resolved, given)
    return resolved


def rl_setup(stage: str, init: str | None, data: str | None, out: Path, config_file: str | None,
             overrides: dict[str, Any], resume: bool, options: dict[str, Any]) -> PreparedRun:
    """The setup of an RL run (grpo, ppo): setup_from_init's, with GRPO_DEFAULTS under --config and the flags,
    the RL options saved under [run], and a prompts file for its data (open_prompts)."""
    spec = StageSetup(stage, GRPO_DEFAULTS, options, open_data=partial(open_prompts, options=options))
    return setup_from_init(spec, init, data, out, config_file, overrides, resume, quiet=False)


def open_prompts(run: PreparedRun, data: str | None, options: dict[str, Any]) -> None:
    """An RL run's data: the prompt records of --data (on --resume without it, the run's own file), read once the
    run's config and tokenizer are checked to suit RL."""
    if run.mcfg.dropout:
        raise NanoforgeError(f"dropout {run.mcfg.dropout}: RL needs the policy that samples and the one that is "
                             "trained to be the same distribution; use --dropout 0")
    if run.tcfg.fsdp:
        raise NanoforgeError("--fsdp: rollouts generate with the whole model on each rank; use DDP (the default "
                             "under torchrun)")
    if options.get("think") and not run.tokenizer.supports_tools:
        raise NanoforgeError("--think needs a chat template with think blocks (MiniMind-3's format); this "
                             "tokenizer's template has none")
    data = data or run.info.get("data")
    if not data:
        raise NanoforgeError("--data is required: a JSONL file of prompts (chats ending in a user turn, or "
                             'GSM8K\'s {"question", "answer"})')
    run.data = read_prompts(data)
    check_records(options.get("reward"), run.data)
    run.info["data"] = str(Path(data).resolve())


def chosen_rewards(o: dict[str, Any]) -> list[tuple[str, RewardFn]]:
    """--reward's functions, imported and checked (and --reward-weights against them) as the options are read,
    before anything is written; the --reward-model joins them later, on the run's device."""
    chosen = parse_rewards(o["reward"]) if o.get("reward") else []
    parse_weights(o.get("reward_weights"), len(chosen) + bool(o.get("reward_model")))
    return chosen


def reward_function(o: dict[str, Any], chosen: list[tuple[str, RewardFn]], device):
    """chosen_rewards and --reward-model as one function (rl/rewards.py combine): (total, parts) per reply."""
    if o.get("reward_model"):
        model = load_reward_model(o["reward_model"], trust_remote_code=bool(o.get("trust_remote_code")),
                                  device=str(device))
        chosen = [*chosen, ("model", model.reward)]
    return combine(chosen, parse_weights(o.get("reward_weights"), len(chosen)))


def frozen_reference(mcfg, tcfg, init_path: Path, device) -> GPT:
    """The --init model, frozen, whatever step a run resumes at: the reference of the KL term."""
    return initial_gpt(mcfg, tcfg, init_path, resume=False).to(device).eval().requires_grad_(False)


@fresh_run_guard
def grpo(init: str | None, data: str | None, out: str | Path, options: RLOptions | None = None,
         config_file: str | None = None, overrides: dict[str, Any] | None = None, resume: bool = False,
         quiet: bool = False, given=None) -> dict[str, Any]:
    """`nanoforge grpo`: sample G replies to each of P prompts, score them, and train the policy on their group
    advantages with the --loss surrogate (and a k3 KL to the frozen --init model when --beta > 0). `given`: the
    options given on the command line (the others keep a resumed run's saved values)."""
    out = Path(out)
    o = resolve_options(out, options or RLOptions(), resume, given)
    rewards = chosen_rewards(o)
    run = rl_setup("grpo", init, data, out, config_file, dict(overrides or {}), resume, o)
    mcfg, tcfg, tok, records = run.mcfg, run.tcfg, run.tokenizer, run.data
    device = setup(resolve_device(tcfg.device))  # under torchrun: this rank's device
    w = world()
    iterator = PromptIterator(records, o["prompts_per_step"], tcfg.seed, w.rank, w.world_size)
    opts = RLOptions(**{f.name: o[f.name] for f in fields(RLOptions) if f.name in o})  # the resolved options
    opts.validate()
    reference = frozen_reference(mcfg, tcfg, run.init, device) if o["beta"] > 0 else None
    model = initial_gpt(mcfg, tcfg, run.init, resume)
    tools = parse_tool_names(o.get("tools"))
    if tools:  # multi-turn: rl/agent.py's rollouts and reward
        check_agent_prompts(tok, records, tools, opts.think, model.context_length)
        rollout_fn, reward = partial(agent_rollout, tools=tools, max_turns=o["max_turns"]), None
    else:
        check_prompts(tok, records, opts.think, model.context_length)
        rollout_fn, reward = rollout, reward_function(o, rewards, device)
    batches = RolloutBatches(model, tok, iterator, opts, reward, tcfg.seed, o["ppo_epochs"], tcfg.grad_accum,
                             reference, rollout_fn, tcfg.precision)
    tcfg.batch_size = batches.micro_rows  # for the header: replies per micro-batch
    loss = policy_objective(o["loss"], o["epsilon"], o.get("epsilon_high"), o["beta"], o["loss_norm"], o["temperature"],
                            batches)
    stage = Stage("grpo", batches, loss, None, None, run.info, count_fn=policy_count(o["loss_norm"]),
                  sampler=make_sampler(run.run_dir, tcfg, tok, run.prompts, chat=True))
    if not quiet:
        reward_name = (f"agent (tools {','.join(tools)}, max turns {o['max_turns']})" if tools else
                       f"{o.get('reward') or ''}{' + model' if o.get('reward_model') else ''}")
        print(f"grpo: {len(records)} prompts, {o['prompts_per_step']} x {o['num_generations']} replies per rollout"
              f" (x {w.world_size} processes), loss {o['loss']}, reward {reward_name}, beta {o['beta']:g}, "
              f"ppo epochs {o['ppo_epochs']}", flush=True)
    return train_and_report(stage, model, run, resume, quiet)
