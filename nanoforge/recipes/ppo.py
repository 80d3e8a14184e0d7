"""`nanoforge ppo`: the recipe of the PPO stage, read like `grpo`'s (recipes/grpo.py): setup -> prompts and rewards
-> policy, critic and reference -> Stage -> train().

The trained model is a PolicyWithValue (rl/critic.py): the --init policy and a critic copied from its weights,
one optimizer over both. Its checkpoints hold the policy's keys unchanged and the critic's under `critic.`;
the loader drops the latter, so chat, eval and export read a PPO run as its policy."""
from __future__ import annotations

from dataclasses import fields
from pathlib import Path
from typing import Any

from nanoforge.core.device import resolve_device
from nanoforge.core.errors import NanoforgeError
from nanoforge.rl.critic import PolicyWithValue
from nanoforge.recipes.grpo import chosen_rewards, frozen_reference, reward_function, rl_setup
from nanoforge.rl.options import PPOOptions
from nanoforge.rl.ppo_update import ppo_count
from nanoforge.rl.ppo_batches import PPOBatches, ppo_objective
from nanoforge.rl.prompts import PromptIterator
from nanoforge.rl.rollout import check_prompts
from nanoforge.train.distributed import setup, world
from nanoforge.train.loop import Stage
from nanoforge.train.rundir import fresh_run_guard, resolve_run_options
from nanoforge.recipes.common import initial_gpt, make_sampler, train_and_report


FLAGS = {f.name: "--" + f.name.replace("_", "-") for f in fields(PPOOptions)}


def resolve_options(out: Path, options: PPOOptions, resume: bool, given=None) -> dict[str, Any]:
    """The options this run trains with: on --resume the saved ones (a different value given is an error)."""
    o = resolve_run_options(out, options, resume, given)
    if o["reward"] is None and not o["reward_model"]:
        o["reward"] = "math"
    for key in ("num_generations", "prompts_per_step", "ppo_epochs", "max_new_tokens"):
        if o[key] < 1:
            raise NanoforgeError(f"{FLAGS[key]} {o[key]} must be >= 1")
    if not o["temperature"] > 0:
        raise NanoforgeError(f"--temperature {o['temperature']} must be > 0: PPO samples from the policy")
    return o


@fresh_run_guard
def ppo(init: str | None, data: str | None, out: str | Path, options: PPOOptions | None = None,
        config_file: str | None = None, overrides: dict[str, Any] | None = None, resume: bool = False,
        quiet: bool = False, given=None) -> dict[str, Any]:
    """`nanoforge ppo`: sample replies to P prompts with the policy, score them, and train policy and critic
    on them with PPO's clipped surrogate and clipped value loss (per-token KL penalty to the frozen --init
    model in the rewards when --beta > 0, GAE advantages), --ppo-epochs updates per rollout."""
    out = Path(out)
    o = resolve_options(out, options or PPOOptions(), resume, given)
    rewards = chosen_rewards(o)
    cfg_ppo = PPOOptions(**{f.name: o[f.name] for f in fields(PPOOptions) if f.name in o})  # the resolved options
    cfg_ppo.validate()
    run = rl_setup("ppo", init, data, out, config_file, dict(overrides or {}), resume, o)
    mcfg, tcfg, tok, records = run.mcfg, run.tcfg, run.tokenizer, run.data
    if tcfg.optimizer == "muon":
        raise NanoforgeError("--optimizer muon: not for ppo (its policy + critic module has no single lm_head "
                             "for Muon to leave to AdamW); use --optimizer adamw")
    device = setup(resolve_device(tcfg.device))
    w = world()
    iterator = PromptIterator(records, o["prompts_per_step"], tcfg.seed, w.rank, w.world_size)
    reference = frozen_reference(mcfg, tcfg, run.init, device) if cfg_ppo.beta > 0 else None
    model = (PolicyWithValue.from_config(mcfg) if resume  # the loop loads the checkpoint's policy and critic
             else PolicyWithValue.from_policy(initial_gpt(mcfg, tcfg, run.init, resume)))
    check_prompts(tok, records, cfg_ppo.think, model.policy.context_length)
    batches = PPOBatches(model, tok, iterator, cfg_ppo, reward_function(o, rewards, device), tcfg.seed,
                         o["ppo_epochs"], tcfg.grad_accum, reference, tcfg.precision)
    tcfg.batch_size = batches.micro_rows
    sampler = make_sampler(run.run_dir, tcfg, tok, run.prompts, chat=True)
    stage = Stage("ppo", batches, ppo_objective(cfg_ppo), None, None, run.info,
                  count_fn=ppo_count,
                  sampler=(lambda m, step, log: sampler(m.policy, step, log)) if sampler else None)
    if not quiet:
        print(f"ppo: {len(records)} prompts, {o['prompts_per_step']} x {o['num_generations']} replies per rollout"
              f" (x {w.world_size} processes), reward {o.get('reward') or ''}"
              f"{' + model' if o.get('reward_model') else ''}, beta {cfg_ppo.beta:g}, ppo epochs {o['ppo_epochs']}"
              f", target kl {cfg_ppo.target_kl}", flush=True)
    return train_and_report(stage, model, run, resume, quiet)
