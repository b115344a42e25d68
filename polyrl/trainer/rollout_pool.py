"""Who does what in the off-policy job (trainer/async_ppo.py): its ranks, the prompts each rollout replica generates,
and how a replica's rows reach the trainer ranks that train them.

Ranks `[0, T)` train (FSDP2 over the trainer's world, `trainer.nnodes x trainer.n_gpus_per_node`); ranks
`[T, T + R)` generate (`rollout.nnodes x rollout.n_gpus_per_node`), in replicas of `tp` consecutive ranks
(`actor_rollout_ref.rollout.tensor_model_parallel_size`). A replica's first rank is its leader: it scores the rows
and sends them; the others only take part in the replica's collectives. Trainer rank `j % T` streams the weights
to replica `j`.

Batches are split as the on-policy trainer splits them: trainer rank `t` trains its slice of every mini-batch
(`distributed.data.shard_prompts`), and replica `j` generates the `j`-th contiguous share of each trainer rank's
prompts (`deal_prompts`). Every replica draws the same global batch (same sampler, same position), so no prompt
travels; a replica sends each trainer rank the rows of its prompts (`select_prompts`), and the trainer rank puts
the replicas' pieces in replica order, which is its shard's order.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from dataclasses import dataclass

from polyrl.distributed.data import shard_evenly, shard_prompts

ROW_KEYS = ("scores", "baselines", "versions", "old_log_probs")  # a part's per-row lists besides `out` and `extras`


@dataclass(frozen=True)
class Placement:
    num_trainers: int
    """Trainer processes (T): ranks [0, T)."""
    num_rollout: int
    """Rollout processes (R): ranks [T, T + R)."""
    tp: int = 1
    """Processes per rollout replica (its tensor-parallel size)."""

    @classmethod
    def of(cls, cfg) -> "Placement":
        t, pool = cfg.trainer, cfg.rollout
        return cls(t.nnodes * t.n_gpus_per_node, pool.nnodes * pool.n_gpus_per_node,
                   cfg.actor_rollout_ref.rollout.tensor_model_parallel_size or 1)

    @property
    def world_size(self) -> int:
        return self.num_trainers + self.num_rollout

    @property
    def num_replicas(self) -> int:
        return self.num_rollout // self.tp

    def is_trainer(self, rank: int) -> bool:
        return rank < self.num_trainers

    def replica_of(self, rank: int) -> int:
        return (rank - self.num_trainers) // self.tp

    def leader(self, replica: int) -> int:
        return self.num_trainers + replica * self.tp

    def owner(self, replica: int) -> int:
        """The trainer rank that streams weights to `replica`."""
        return replica % self.num_trainers

    def served_by(self, trainer_rank: int) -> list[int]:
        """The rollout ranks trainer rank `trainer_rank` streams weights to."""
        return [self.leader(j) + i for j in range(self.num_replicas) if self.owner(j) == trainer_rank
                for i in range(self.tp)]


def deal_prompts(num_prompts: int, prompts_per_mini: int, num_trainers: int,
                 num_replicas: int) -> list[list[list[int]]]:
    """`[replica][trainer rank]` -> the positions in the global batch that replica generates for that trainer rank
    (module docstring). With one trainer and one replica: every prompt, in order."""
    shards = [shard_prompts(num_prompts, prompts_per_mini, t, num_trainers) for t in range(num_trainers)]
    return [[[shard[i] for i in shard_evenly(len(shard), j, num_replicas)] for shard in shards]
            for j in range(num_replicas)]


def row_versions(out, version: int) -> list[int]:
    """Each row's weights version, for a part's `versions`: a multi-turn row's oldest turn's (its turns carry their
    own, `AgentGeneration.weight_versions`; partial rollouts may span several), else `version` (the call's)."""
    turns = getattr(out, "weight_versions", None)
    if turns is None:
        return [version] * len(out.prompt_index)
    return [min(v) if v else version for v in turns]


def select_rows(out, rows: list[int]):
    """A `Generation` (or a subclass) of the rows `rows` of `out`: every per-row list field, in that order."""
    n = len(out.prompt_index)
    picked = {f.name: [getattr(out, f.name)[r] for r in rows] for f in dataclasses.fields(out)
              if isinstance(getattr(out, f.name), list) and len(getattr(out, f.name)) == n}
    return dataclasses.replace(out, **picked)


def select_prompts(part: dict, prompts: list[int]) -> dict:
    """The rows of `part`'s prompts `prompts` (that order, each prompt's rows in their order) as a part of its own,
    for `RolloutBatchMixin._assemble_batch`; prompt indices renumbered."""
    out = part["out"]
    rows_of = defaultdict(list)
    for row, pi in enumerate(out.prompt_index):
        rows_of[pi].append(row)
    rows = [r for p in prompts for r in rows_of[p]]
    renumber = {p: i for i, p in enumerate(prompts)}
    gen = select_rows(out, rows)
    gen.prompt_index = [renumber[out.prompt_index[r]] for r in rows]
    piece = {"prompts": [part["prompts"][p] for p in prompts], "out": gen,
             "extras": {k: [v[r] for r in rows] for k, v in part["extras"].items()}}
    for key in ROW_KEYS:
        if key in part:
            piece[key] = None if part[key] is None else [part[key][r] for r in rows]
    return piece
