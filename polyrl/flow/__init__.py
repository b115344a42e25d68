"""FlowGRPO: RL for rectified-flow image models (tiny quickstart transformer up to Qwen-Image via diffusers).

Modules: `sde` (step types, log-probs, KL), `sampler` (rollout loop), `algos` (advantages and clipped loss on the
shared `polyrl.algorithms`), `pipeline` (diffusers models behind one velocity interface), `rewards`, `async_reward`,
`tiny` (quickstart model + digits), `trainer`, `quickstart`, `cli`.
"""
