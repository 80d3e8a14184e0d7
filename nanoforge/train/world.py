"""This process's place in a torchrun job, from the variables torchrun sets (a single process without them). No
torch: a command that only reads files (`nanoforge report`) asks it too. The job itself is train/distributed.py's."""
import os
from dataclasses import dataclass


@dataclass(frozen=True)
class World:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def world() -> World:
    return World(int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1)),
                 int(os.environ.get("LOCAL_RANK", 0)))


def is_main() -> bool:
    return world().is_main
