"""What the training loop needs of a model, said once (nanoforge/train/loop.py checks it before training).

GPT offers it, and so does LoraModel, which forwards each part to the GPT it adapts. A model that lacks a part
is refused with the list, rather than losing a feature silently (a LoRA run once skipped
--activation-checkpointing because the wrapper had no such switch)."""
from typing import Protocol, runtime_checkable

import torch

TRAINABLE_INTERFACE = ("activation_checkpointing", "flops_per_token", "state_dict_for_save", "load_weights")


@runtime_checkable
class TrainableModel(Protocol):
    # recompute each block in backward (--activation-checkpointing); the loop sets it before training
    activation_checkpointing: bool

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token (forward + backward), for MFU."""

    def state_dict_for_save(self) -> dict[str, torch.Tensor]:
        """The tensors a checkpoint holds (for LoRA: the adapters only)."""

    def load_weights(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Load what state_dict_for_save() gave, strictly: every mismatched key is an error."""
