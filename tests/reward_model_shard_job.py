"""One rank of the 2-process sharded reward-model check (test_reward_model_on_cpu.py runs this under torchrun).

Each rank scores a different number of rows under a small token budget, so the ranks run different forward counts
and the padding passes must pair the FSDP2 all-gathers up; each writes its scores to `<out>/rank<r>.json`."""

import json
import sys

import torch

from polyrl.distributed import DistEnv
from polyrl.learner.config import FSDPConfig
from polyrl.rewards.reward_model import DiscriminativeRM

rm_dir, out = sys.argv[1], sys.argv[2]
dist = DistEnv.setup("cpu")
rm = DiscriminativeRM.load(rm_dir, key="reward_model.model.path", device=torch.device("cpu"), dtype=torch.float32,
                      max_tokens=60, max_rows=64, dist=dist, fsdp_config=FSDPConfig())
chats = json.loads(open(f"{out}/chats.json").read())
rows = chats[: 9 if dist.rank == 0 else 2]
scores = rm.score([c for c, _ in rows], [r for _, r in rows])
open(f"{out}/rank{dist.rank}.json", "w").write(json.dumps(scores))
dist.finish()
