"""Ray, for what torchrun cannot do alone: the one place that imports it and joins (or starts) a cluster.

- `import_ray()`: Ray, or one sentence saying how to install it.
- `init_ray(address)`: join a running cluster (`address`, or `RAY_ADDRESS`, e.g. set by `ray start --head` on the
  node) or start a local one.

Its users: `launch.launch_on_ray` (`trainer.nnodes > 1`: one torchrun agent per node) and the reward workers in
`polyrl.rewards.remote` / `polyrl.rewards.async_scorer` (`reward_model.launch_reward_fn_async`, reward GPU pools).
Ray is an optional extra (`pip install 'polyrl[ray]'`): nothing here is imported on a single-node run.
"""

from __future__ import annotations

import os
from typing import Any

from polyrl.errors import ConfigError


def import_ray():
    try:
        import ray
    except ImportError as e:
        raise ConfigError("This setting needs Ray (multi-node placement or reward_model.launch_reward_fn_async); "
                          "`pip install 'polyrl[ray]'` or turn it off.") from e
    return ray


def init_ray(address: str | None = None, **kwargs) -> Any:
    """Join the cluster at `address` / $RAY_ADDRESS, or start a local one; idempotent."""
    ray = import_ray()
    if not ray.is_initialized():
        address = address or os.environ.get("RAY_ADDRESS") or None
        ray.init(address=address, include_dashboard=False, log_to_driver=False, **kwargs)
    return ray
