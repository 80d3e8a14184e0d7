"""The RL stage's two halves for the one loop (train/stage.py's contract): `RolloutBatches`, a batch source that
samples a rollout every ppo_epochs steps, and `policy_objective`, the loss over a rollout batch.

With --ppo-epochs K the same rollout is trained on for K optimizer steps (each its grad_accum micro-batches),
so the ratio and its clipping act (with MiniMind's one step per rollout the ratio is always 1). The old log-probs
take no forward of their own: the first update runs on the sampling weights (no dropout), so its detached
log-probs are them exactly (PPO needs them before any update: rl/ppo_batches.py's rollouts bring them).

Exact resume: a rollout is a function of the prompts it takes (the PromptIterator's position), the policy's
weights and its seed, derived from (--seed, rollout index, rank); a checkpoint in the middle of a rollout's K
steps also holds that rollout (every rank's, gathered to rank 0, which writes it)."""
import base64
from typing import Any

import torch
import torch.distributed as dist

from nanoforge.core.errors import NanoforgeError
from nanoforge.rl.losses import loss_count, policy_loss
from nanoforge.rl.prompts import PromptIterator
from nanoforge.model.prefix import prefix_token_logps
from nanoforge.rl.options import PPOOptions, RLOptions
from nanoforge.train.stage import Batch
from nanoforge.rl.rollout import RewardFn, rollout, rows


def rollout_seed(seed: int, index: int, rank: int) -> int:
    """The sampling seed of rollout `index` on `rank`: a hash of the three (Python hashes int tuples the same
    in every process), so no generator state needs saving and every rank draws differently."""
    return hash((int(seed), int(index), int(rank))) & 0x7FFF_FFFF_FFFF_FFFF


class RolloutBatches:
    """BatchSource of the RL stages: next_batch() returns micro-batch (call % grad_accum) of the current rollout,
    sampling a new rollout every ppo_epochs x grad_accum calls. The model is the plain (unwrapped) policy.
    rollout_fn samples a rollout batch, rl/rollout.py `rollout` or (grpo --tools) rl/agent.py `agent_rollout`, in
    `precision`; opts: the stage's options (their sampling fields)."""

    def __init__(self, model, tokenizer, prompts: PromptIterator, opts: RLOptions | PPOOptions,
                 reward_fn: RewardFn | None, seed: int, ppo_epochs: int = 1, grad_accum: int = 1, reference=None,
                 rollout_fn=rollout, precision: str = "fp32"):
        rows_per_rollout = prompts.prompts_per_step * opts.num_generations
        if rows_per_rollout % grad_accum:
            raise NanoforgeError(f"--grad-accum {grad_accum} must divide the {rows_per_rollout} replies of a rollout "
                                 f"(--prompts-per-step {prompts.prompts_per_step} x --num-generations "
                                 f"{opts.num_generations})")
        self.model, self.tokenizer, self.prompts, self.opts = model, tokenizer, prompts, opts
        self.reward_fn, self.seed, self.reference, self.rollout_fn = reward_fn, int(seed), reference, rollout_fn
        self.ppo_epochs, self.grad_accum, self.precision = ppo_epochs, grad_accum, precision
        self.micro_rows = rows_per_rollout // grad_accum
        self.calls = 0  # next_batch calls so far
        self.rollouts = 0  # rollouts sampled so far
        self.current: Batch | None = None
        self.every_rank: list[Batch] | None = None  # all ranks' current rollouts, for the checkpoint (rank 0)
        self.first_logps: list[torch.Tensor] = []  # the first update's micro-batches' log-probs so far

    @property
    def sequences_per_epoch(self) -> int:
        """For --epochs (recipes/common.py steps_from_epochs, which divides by the replies of a step): every prompt
        once, G replies each, trained on ppo_epochs times."""
        return len(self.prompts.records) * self.opts.num_generations * self.ppo_epochs

    @property
    def cycle(self) -> int:
        return self.ppo_epochs * self.grad_accum

    def next_batch(self) -> Batch:
        position = self.calls % self.cycle
        if position == 0:
            self._sample()
        micro = position % self.grad_accum
        self.calls += 1
        return rows(self.current, micro * self.micro_rows, (micro + 1) * self.micro_rows)

    def _sample(self) -> None:
        records = self.prompts.next_prompts()
        seed = rollout_seed(self.seed, self.rollouts, self.prompts.rank)
        self.current = self.rollout_fn(self.model, self.tokenizer, records, self.opts, self.reward_fn, seed,
                                       self.reference, self.micro_rows, self.precision)
        self.rollouts += 1
        self.every_rank = [self.current]
        if "old_logp" in self.current:  # ppo's; grpo's come with its first update (keep_old_logps)
            self._share()

    def keep_old_logps(self, logp: torch.Tensor) -> torch.Tensor:
        """A first-update micro-batch's log-probs, detached: its old ones, kept (in micro-batch order) for later."""
        if self.ppo_epochs > 1:
            self.first_logps.append(logp.detach().cpu())
            if len(self.first_logps) == self.grad_accum:
                self.current["old_logp"], self.first_logps = torch.cat(self.first_logps), []
                self._share()
        return logp.detach()

    def _share(self) -> None:  # a checkpoint between a rollout's steps holds every rank's rollout (rank 0 writes)
        if self.prompts.world_size > 1 and self.ppo_epochs > 1:
            gathered: list[Any] = [None] * self.prompts.world_size
            dist.all_gather_object(gathered, encode_batch(self.current))
            self.every_rank = [decode_batch(b) for b in gathered]

    def state_dict(self) -> dict[str, Any]:
        """The prompt position, the counters and, between a rollout's steps, every rank's rollout (JSON-able)."""
        state = {"prompts": self.prompts.state_dict(), "calls": self.calls, "rollouts": self.rollouts,
                 "seed": self.seed, "cycle": self.cycle}
        if self.calls % self.cycle:
            state["current"] = [encode_batch(b) for b in self.every_rank]
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("seed", self.seed) != self.seed:
            raise NanoforgeError(f"cannot resume the rollouts: they were sampled with --seed {state['seed']}, this "
                                 f"run has --seed {self.seed}")
        self.prompts.load_state_dict(state["prompts"])
        calls, self.rollouts = int(state["calls"]), int(state["rollouts"])
        self.current = self.every_rank = None
        if "current" in state:
            saved = state["current"]
            if len(saved) != self.prompts.world_size:
                raise NanoforgeError(f"the checkpoint was taken in the middle of a rollout's --ppo-epochs steps by "
                                     f"{len(saved)} processes; resume it with {len(saved)} (this run has "
                                     f"{self.prompts.world_size}), or from a checkpoint at a rollout boundary")
            if state.get("cycle") != self.cycle:
                raise NanoforgeError("the checkpoint was taken in the middle of a rollout; resume it with the "
                                     "same --ppo-epochs and --grad-accum")
            self.every_rank = [decode_batch(b) for b in saved]
            self.current = self.every_rank[self.prompts.rank]
        self.calls = calls


def encode_batch(batch: Batch) -> dict[str, Any]:
    """A batch of CPU tensors -> JSON-able {name: [dtype, shape, base64 of the bytes]}, exact to the bit."""
    return {k: [str(v.dtype).removeprefix("torch."), list(v.shape),
                base64.b64encode(v.contiguous().numpy().tobytes()).decode("ascii")] for k, v in batch.items()}


def decode_batch(encoded: dict[str, Any]) -> Batch:
    return {key: torch.frombuffer(bytearray(base64.b64decode(data)), dtype=getattr(torch, dtype)).reshape(shape).clone()
            for key, (dtype, shape, data) in encoded.items()}


def policy_objective(loss: str, epsilon: float, epsilon_high: float | None, beta: float, norm: str, temperature: float,
                     batches: RolloutBatches | None = None):
    """Stage.loss_fn: the policy loss of a rollout micro-batch under the current model, log-probs at the
    sampling temperature; the rollout's stat_* figures ride along as extras (so they are logged per step)."""
    def loss_fn(model, batch: Batch):
        logp = prefix_token_logps(model, batch["input_ids"], batch["loss_mask"], temperature)  # (B, L-1)
        old_logp = batch.get("old_logp")
        if old_logp is None:  # the rollout's first update: its own log-probs are the old ones (module docstring)
            old_logp = batches.keep_old_logps(logp) if batches else logp.detach()
        total, count, extras = policy_loss(logp, old_logp, batch["advantages"], batch["loss_mask"],
                                           loss=loss, epsilon=epsilon, epsilon_high=epsilon_high,
                                           ref_logp=batch.get("ref_logp"), beta=beta, norm=norm)
        extras.update({k[5:]: v for k, v in batch.items() if k.startswith("stat_")})
        return total, count, extras
    return loss_fn


def policy_count(norm: str):
    """Stage.count_fn: what the step divides by (rl/losses.py loss_count)."""
    return lambda batch: loss_count(batch["loss_mask"], norm)
