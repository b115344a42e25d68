"""Reward config groups with verl's key names: `custom_reward_function.*`, `reward_model.*` (legacy layout) and
`reward.reward_model.*` (verl 0.9).

The trainer's config tree mounts these; the keys are the ones verl's DAPO recipe and examples use
(`custom_reward_function.path`, `reward_model.overlong_buffer.len`, ...).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CustomRewardConfig:
    path: str | None = None
    """Python file defining the reward function; null uses the built-in rule scorers (dispatch on data_source)."""
    name: str = "compute_score"
    """Function in that file: fn(data_source, solution_str, ground_truth, extra_info) -> float | dict with 'score'."""


@dataclass
class OverlongBufferConfig:
    enable: bool = False
    """DAPO's soft overlong penalty: responses longer than max_response_length - len lose reward linearly."""
    len: int = 0
    """Width of the penalty zone in tokens, ending at data.max_response_length."""
    penalty_factor: float = 1.0
    """Penalty at max_response_length; it grows linearly from 0 at the start of the zone."""
    log: bool = False
    """Log the penalty (reward_extra/overlong_reward) and the overlong fraction (reward_extra/overlong)."""


@dataclass
class RewardModelRolloutConfig:
    """The reward model's engine (verl's `reward_model.rollout.*`): the generative judge's sampling and cache, and the
    discriminative model's dtype, token budget and sleep."""

    name: str = "native"
    """Engine: native (polyrl's, CPU and GPU). verl's vllm/sglang servers are not bundled."""
    dtype: str = "bfloat16"
    """Weights' dtype on GPU (a CPU always computes in float32)."""
    gpu_memory_utilization: float = 0.5
    """Judge: fraction of GPU memory its KV cache may fill while it runs."""
    free_cache_engine: bool = True
    """Colocated: sleep between steps (weights to pinned host memory, KV cache freed) while the actor trains."""
    max_num_seqs: int = 1024
    """Judge: sequences decoded at once; discriminative model: rows per forward at most."""
    max_num_batched_tokens: int = 8192
    """Tokens per forward: the discriminative model's padded token budget, the judge's prefill chunk."""
    prompt_length: int = 2048
    """Longest judge prompt (or scored sequence), in the reward model's tokens; longer ones keep their end."""
    response_length: int = 2048
    """Judge: most tokens it may generate per answer."""
    temperature: float = 1.0
    """Judge sampling temperature (verl's default; set do_sample=False for a greedy judge)."""
    top_k: int = -1
    """Judge top-k (-1: off)."""
    top_p: float = 1.0
    """Judge top-p."""
    do_sample: bool = True
    """False: the judge decodes greedily."""


@dataclass
class JudgeConfig:
    """polyrl's generative judge: where its prompt and parser come from (verl leaves both to a custom function)."""

    path: str | None = None
    """Python file with the judge's prompt template and score parser; set: the reward model is a generative judge."""
    template: str = "JUDGE_TEMPLATE"
    """Name of the string in that file: the judge's user message, with {question}, {response} and optionally
    {reference} (the ground truth)."""
    parser: str = "parse_score"
    """Function in that file: parse_score(judge_answer: str) -> float, or None when the answer holds no score."""
    default_score: float = 0.0
    """Score of an answer the parser cannot read (counted in reward/judge_parse_failures)."""


@dataclass
class ModelRewardConfig:
    """The keys both of verl's layouts share: `reward_model.*` (legacy) and `reward.reward_model.*` (0.9)."""

    enable: bool = False
    """Score responses with a reward model: a sequence classifier, or a generative judge (judge.path)."""
    enable_resource_pool: bool = False
    """Score in a process holding n_gpus_per_node GPUs of its own. A reward model on one host needs no Ray: it runs
    in a process spawned on the GPUs after the training processes' ones. With a Ray cluster (RAY_ADDRESS; always for
    a rule reward or FlowGRPO's scorer), a Ray actor: start Ray with only those GPUs visible
    (`CUDA_VISIBLE_DEVICES=4 ray start --head --num-gpus=1`) and train on the others with RAY_ADDRESS=auto."""
    n_gpus_per_node: int = 0
    """GPUs of the reward resource pool per node; each trainer rank's actor asks for this / ranks per node."""
    nnodes: int = 0
    """Nodes of the reward resource pool (0: the trainer's nodes)."""
    rollout: RewardModelRolloutConfig = field(default_factory=RewardModelRolloutConfig)
    """The reward model's engine."""
    judge: JudgeConfig = field(default_factory=JudgeConfig)
    """Generative judge: prompt template and score parser."""


@dataclass
class RewardModel09Config(ModelRewardConfig):
    """verl 0.9's `reward.reward_model.*`."""

    n_gpus_per_node: int = 8
    """GPUs of the reward resource pool per node (verl 0.9's default 8); each trainer rank's actor asks for this /
    ranks per node."""
    model_path: str | None = None
    """Local HF directory of the reward model (a *ForSequenceClassification, or a causal LM judge)."""


@dataclass
class RewardConfig:
    """verl 0.9's `reward.*` group (the model-based part; the rule reward keeps its legacy keys)."""

    reward_model: RewardModel09Config = field(default_factory=RewardModel09Config)
    """The reward model (same meaning as the legacy top-level reward_model.* keys; set one layout, not both)."""


@dataclass
class RewardModelModelConfig:
    """Legacy `reward_model.model.*`."""

    path: str | None = None
    """Local HF directory of the reward model (a *ForSequenceClassification, or a causal LM judge)."""
    input_tokenizer: str | None = None
    """Tokenizer that decodes the policy's responses before the reward model's chat template re-renders them; null:
    the policy's own (verl's default, ${actor_rollout_ref.model.path})."""
    trust_remote_code: bool = False
    """Allow the reward model directory's own modelling code."""


@dataclass
class RewardModelConfig(ModelRewardConfig):
    """Legacy top-level `reward_model.*`: the reward model (rewards/model_reward.py) and the reward manager."""

    model: RewardModelModelConfig = field(default_factory=RewardModelModelConfig)
    """The reward model's directory and input tokenizer."""
    micro_batch_size: int | None = None
    """Deprecated global micro-batch of the reward model (divided by the data-parallel size)."""
    micro_batch_size_per_gpu: int | None = None
    """Rows per reward-model forward (unset: cut by a token budget, see use_dynamic_bsz)."""
    use_dynamic_bsz: bool = False
    """Cut reward-model forwards by forward_max_token_len_per_gpu (else by rollout.max_num_batched_tokens when no
    micro_batch_size_per_gpu is set)."""
    forward_max_token_len_per_gpu: int = 32768
    """Padded tokens per reward-model forward under use_dynamic_bsz."""
    max_length: int | None = None
    """Longest scored sequence in the reward model's tokens; longer ones keep their end (where the score is read)."""
    reward_manager: str = "naive"
    """naive, or dapo (which applies the overlong buffer)."""
    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)
    """DAPO overlong penalty."""
    reward_kwargs: dict = field(default_factory=dict)
    """Extra reward-manager arguments (overlong_buffer_cfg is verl's older name)."""
    launch_reward_fn_async: bool = False
    """Score in a Ray actor apart from the trainer (polyrl.rewards.remote.RemoteReward)."""
