"""Model-based rewards in the LLM trainer: verl's two key layouts resolved into one setting, and the reward manager
that scores with the model and then with the rule or custom function.

Keys. verl 0.9 spells the reward model `reward.reward_model.{enable, model_path, enable_resource_pool, n_gpus_per_node,
nnodes, rollout.*}`; the legacy top-level layout `reward_model.{enable, model.path, model.input_tokenizer,
micro_batch_size_per_gpu, use_dynamic_bsz, forward_max_token_len_per_gpu, max_length, ...}` is still accepted (verl
migrates it the same way, `migrate_legacy_reward_impl`). A run sets one layout; setting the model in both is refused,
and so is any reward-model key left set while the model is off (verl ignores those silently).

Combining, as verl's reward loop does:
- no custom function: the model's score *is* the reward (verl: the rule score is not computed);
- a custom function: it decides, and gets the model's score as the keyword argument `rm_score` (polyrl's stand-in for
  verl's `reward_router_address`, through which verl's custom functions query the model themselves), so a hybrid
  reward is `return rule(...) + rm_score`. A custom function without an `rm_score` parameter is refused: the model
  would run for nothing.
Either way the score goes through the reward manager, so the DAPO overlong penalty applies to it too (verl's
model-only path skips the manager), and lands on the last response token as any reward does (`token_level_scores`;
verl's `rm_scores`).

Placement: colocated by default (the model sleeps while the actor trains); with `enable_resource_pool=True` the model
and the manager run in a process holding `n_gpus_per_node` GPUs of its own (`RemoteModelReward`), where the model
never sleeps: a Ray actor where a Ray cluster is given (the rule reward's actor machinery in rewards/remote.py), else
a process spawned on the GPUs of this host after the training processes' ones. In the off-policy pipeline
(trainer/async_ppo.py) its scoring of a batch overlaps the generation of the next.

Timing: `timing_s/reward` splits into `timing_s/reward_model` (the model) and `timing_s/reward_fn` (the manager).
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
from dataclasses import dataclass

import torch

from polyrl.errors import ConfigError
from polyrl.rewards.config import JudgeConfig, ModelRewardConfig, RewardModel09Config, RewardModelConfig

_MODEL_ONLY = ("micro_batch_size", "micro_batch_size_per_gpu", "use_dynamic_bsz", "forward_max_token_len_per_gpu",
               "max_length")  # legacy keys that configure the reward model and nothing else
_JUDGE_ONLY = ("gpu_memory_utilization", "prompt_length", "response_length", "temperature", "top_k", "top_p",
               "do_sample")


@dataclass
class RewardModelSetting:
    """The reward model as configured, whichever layout set it."""

    key: str  # the layout's prefix, for error messages: reward_model or reward.reward_model
    path_key: str
    path: str
    model: ModelRewardConfig  # the layout's block (rollout.*, judge.*, resource pool)
    input_tokenizer: str | None
    trust_remote_code: bool
    max_tokens: int | None  # padded tokens per discriminative forward (None: rows only)
    max_rows: int
    max_length: int | None

    @property
    def is_judge(self) -> bool:
        return bool(judge_of(self.model).path)


def judge_of(block: ModelRewardConfig) -> JudgeConfig:
    return block.judge


def _changed(obj, names) -> list[str]:
    default = type(obj)()
    return [n for n in names if getattr(obj, n) != getattr(default, n)]


def _changed_keys(block, prefix: str, names) -> list[str]:
    """Dotted keys under `prefix` set to non-defaults, `names` at the top, the rollout/judge groups in full."""
    out = [f"{prefix}.{n}" for n in _changed(block, names)]
    for group in ("rollout", "judge"):
        sub = getattr(block, group)
        out += [f"{prefix}.{group}.{f.name}" for f in dataclasses.fields(sub) if f.name in _changed(sub, [f.name])]
    return out


def resolve_reward_model(cfg, num_data_shards: int = 1) -> RewardModelSetting | None:
    """The configured reward model, or None; one sentence for conflicting or ignored keys (module docstring)."""
    from polyrl.learner.config import micro_batch_per_gpu

    legacy, new = cfg.reward_model, cfg.reward.reward_model
    shared = [f.name for f in dataclasses.fields(ModelRewardConfig) if f.name not in ("rollout", "judge")]
    # legacy enable_resource_pool / n_gpus_per_node also place the rule reward's Ray actor, so they are no sign
    legacy_set = _changed_keys(legacy, "reward_model", ["enable", "nnodes", *_MODEL_ONLY]) + \
        [f"reward_model.model.{n}" for n in _changed(legacy.model, [f.name for f in dataclasses.fields(legacy.model)])]
    new_set = _changed_keys(new, "reward.reward_model", [*shared, "model_path"])
    if legacy_set and new_set:
        raise ConfigError(f"{legacy_set[0]} and {new_set[0]} set the reward model in both of verl's layouts; use "
                          "one: reward.reward_model.* (verl 0.9) or the legacy reward_model.*.")
    if new_set and not new.enable:
        raise ConfigError(f"{new_set[0]} is set but reward.reward_model.enable=False; set enable=True or remove it.")
    if legacy_set and not legacy.enable:
        raise ConfigError(f"{legacy_set[0]} is set but reward_model.enable=False; set reward_model.enable=True or "
                          "remove it.")
    if not (legacy.enable or new.enable):
        return None
    if new.enable:
        block, key, path_key, path = new, "reward.reward_model", "reward.reward_model.model_path", new.model_path
    else:
        block, key, path_key, path = legacy, "reward_model", "reward_model.model.path", legacy.model.path
    if not path:
        raise ConfigError(f"{key}.enable=True needs {path_key}: a local reward-model directory (a "
                          "*ForSequenceClassification model, or a causal LM with reward_model.judge.path set).")
    r = block.rollout
    micro = micro_batch_per_gpu(legacy.micro_batch_size_per_gpu, legacy.micro_batch_size, num_data_shards)
    if legacy.use_dynamic_bsz:
        max_tokens, max_rows = legacy.forward_max_token_len_per_gpu, r.max_num_seqs
    elif micro:
        max_tokens, max_rows = None, micro
    else:
        max_tokens, max_rows = r.max_num_batched_tokens, r.max_num_seqs
    m = legacy.model
    s = RewardModelSetting(key=key, path_key=path_key, path=path, model=block, input_tokenizer=m.input_tokenizer,
                           trust_remote_code=m.trust_remote_code, max_tokens=max_tokens, max_rows=max_rows,
                           max_length=legacy.max_length)
    _check(s, cfg)
    return s


def _check_placement(block: RewardModelConfig | RewardModel09Config, key: str, launch_async: bool) -> None:
    if block.rollout.name != "native":
        raise ConfigError(f"{key}.rollout.name={block.rollout.name!r}: the reward model runs on polyrl's native engine "
                          "(vLLM/SGLang reward servers are not bundled); set it to native.")
    if launch_async and not block.enable_resource_pool:
        raise ConfigError(f"reward_model.launch_reward_fn_async with a reward model: a reward model leaves the "
                          f"trainer's process only for GPUs of its own; set {key}.enable_resource_pool=True (and "
                          "n_gpus_per_node), or leave it False to run the model colocated.")
    if block.nnodes:
        raise ConfigError(f"{key}.nnodes={block.nnodes}: a reward pool of its own nodes is not implemented; set it "
                          "to 0.")


def _check(s: RewardModelSetting, cfg) -> None:
    m = s.model
    _check_placement(m, s.key, cfg.reward_model.launch_reward_fn_async)
    if s.is_judge:
        wrong = _changed(cfg.reward_model, _MODEL_ONLY)
        if wrong:
            raise ConfigError(f"reward_model.{wrong[0]} batches a discriminative reward model, and this one is a "
                              "generative judge (reward_model.judge.path); size the judge with rollout.max_num_seqs.")
    else:
        wrong = _changed(m.rollout, _JUDGE_ONLY) + [f"judge.{n}" for n in _changed(m.judge, ["template", "parser",
                                                                                              "default_score"])]
        if wrong:
            raise ConfigError(f"{s.key}.{'' if wrong[0].startswith('judge.') else 'rollout.'}{wrong[0]} configures a "
                              f"generative judge, and {s.path_key} is used as a classifier (no judge.path); set "
                              "judge.path or remove it.")


def _takes_rm_score(fn) -> bool:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return "rm_score" in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def _model_score_only(data_source, solution_str, ground_truth, extra_info, rm_score):
    """The reward when no custom function is set: the model's score (verl's reward loop)."""
    return rm_score


class ModelReward:
    """`RewardManager.score` plus the model: `score(samples, response_lengths, chats=, response_ids=, timer=)`."""

    def __init__(self, scorer, manager, *, has_custom_fn: bool, input_tokenizer=None):
        self.scorer, self.manager = scorer, manager
        self.has_custom_fn = has_custom_fn
        self.input_tokenizer = input_tokenizer
        self.num_parse_failures = 0

    def score(self, samples, response_lengths=None, *, chats, response_ids=None, timer=None):
        stage = timer.stage if timer is not None else (lambda name: contextlib.nullcontext())
        if self.input_tokenizer is not None and response_ids is not None:
            responses = self.input_tokenizer.batch_decode(response_ids, skip_special_tokens=True)
        else:
            responses = [s[1] for s in samples]
        with stage("reward_model"):
            if hasattr(self.scorer, "parse"):  # a generative judge
                rm, failed = self.scorer.score(chats, responses, [s[2] for s in samples])
                self.num_parse_failures += sum(failed)
            else:
                rm, failed = self.scorer.score(chats, responses), None
        with stage("reward_fn"):
            scores, extras = self.manager.score(samples, response_lengths, kwargs=[{"rm_score": v} for v in rm])
        if self.has_custom_fn:
            extras["rm_score"] = list(rm)
        if failed is not None:
            extras["judge_parse_failed"] = [float(f) for f in failed]
        return scores, extras

    def pop_metrics(self) -> dict[str, float]:
        """Counts since the last call: `reward/judge_parse_failures` for a judge."""
        if not hasattr(self.scorer, "parse"):
            return {}
        n, self.num_parse_failures = self.num_parse_failures, 0
        return {"reward/judge_parse_failures": float(n)}


def _reward_fn(s: RewardModelSetting, custom):
    """The custom function, which must take `rm_score`, or the model's score alone (module docstring)."""
    from polyrl.rewards import build_reward_fn

    if not custom.path:
        return _model_score_only
    fn = build_reward_fn(custom)
    if not _takes_rm_score(fn):
        raise ConfigError(f"custom_reward_function '{custom.name}' in '{custom.path}' takes no rm_score argument, "
                          f"so the reward model ({s.path_key}) would run for nothing; add a parameter rm_score (the "
                          "model's score of that response) and combine it, or unset custom_reward_function.path.")
    return fn


def build_model_reward(s: RewardModelSetting, cfg, *, overlong, device: torch.device, dist=None):
    """The reward for the trainer: a `ModelReward` in this process, or, with `enable_resource_pool`, a client of one
    in a process holding `n_gpus_per_node` GPUs of its own (`RemoteModelReward`)."""
    if _pool(s.model):
        check_model_reward(s, cfg)  # a bad custom function or directory fails here, not in the worker
        return RemoteModelReward(s, cfg, overlong)
    return _build(s, cfg, overlong=overlong, device=device, dist=dist, colocated=True)


def check_model_reward(s: RewardModelSetting, cfg) -> None:
    """One sentence for a missing model directory or a custom function without `rm_score`, before anything loads."""
    from polyrl.models.loader import _check_dir

    _check_dir(s.path, s.path_key)
    _reward_fn(s, cfg.custom_reward_function)


def _pool(block: RewardModelConfig | RewardModel09Config) -> bool:
    return block.enable_resource_pool


def _build(s: RewardModelSetting, cfg, *, overlong, device: torch.device, dist=None, colocated: bool) -> ModelReward:
    """The scorer (classifier or judge) and the manager around it, from a resolved setting."""
    from polyrl.models.loader import load_tokenizer
    from polyrl.rewards import RewardManager
    from polyrl.utils.device import to_dtype

    custom = cfg.custom_reward_function
    fn = _reward_fn(s, custom)
    manager = RewardManager(fn, overlong_buffer=overlong, max_response_length=cfg.data.max_response_length)
    m = s.model
    dtype = torch.float32 if device.type == "cpu" else to_dtype(m.rollout.dtype, f"{s.key}.rollout.dtype")
    if s.is_judge:
        from polyrl.rewards.judge import GenerativeJudge

        rollout = m.rollout if colocated else dataclasses.replace(m.rollout, free_cache_engine=False)
        scorer = GenerativeJudge(s.path, key=s.path_key, judge=judge_of(m), rollout=rollout, device=device,
                                 dtype=dtype, seed=cfg.trainer.seed, trust_remote_code=s.trust_remote_code)
    else:
        from polyrl.rewards.reward_model import DiscriminativeRM

        scorer = DiscriminativeRM.load(s.path, key=s.path_key, device=device, dtype=dtype, max_tokens=s.max_tokens,
                                  max_rows=s.max_rows, max_length=s.max_length,
                                       sleep=colocated and m.rollout.free_cache_engine,
                                  dist=dist, fsdp_config=cfg.actor_rollout_ref.ref.fsdp_config,
                                  trust_remote_code=s.trust_remote_code)
    tok = load_tokenizer(s.input_tokenizer, key="reward_model.model.input_tokenizer") if s.input_tokenizer else None
    return ModelReward(scorer, manager, has_custom_fn=bool(custom.path), input_tokenizer=tok)


def _actor_scorer(s: RewardModelSetting, cfg, overlong):
    """Built inside the reward worker (its own GPUs): (samples, lengths, chats, ids) -> (scores, extras,
    metrics, seconds in the model, seconds in the manager)."""
    from polyrl.utils.timing import StepTimer

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    reward = _build(s, cfg, overlong=overlong, device=device, colocated=False)
    timer = StepTimer()

    def score(samples, response_lengths, chats, response_ids):
        scores, extras = reward.score(samples, response_lengths, chats=chats, response_ids=response_ids, timer=timer)
        t = timer.pop()
        return scores, extras, reward.pop_metrics(), t["timing_s/reward_model"], t["timing_s/reward_fn"]

    return score


class RemoteModelReward:
    """`ModelReward`'s interface over a process with GPUs of its own (`enable_resource_pool`): a Ray actor, or without
    a Ray cluster a process spawned on this host's spare GPUs (`remote.reward_worker`). The model loads and runs
    there, never on the trainer's GPUs, and it never sleeps. `timing_s/reward_model` and `timing_s/reward_fn` are
    the worker's own; the rest of `timing_s/reward` is the round trip."""

    def __init__(self, s: RewardModelSetting, cfg, overlong, *, address: str | None = None):
        from polyrl.rewards.remote import reward_worker

        self.client = reward_worker(_actor_scorer, (s, cfg, overlong), n_gpus_per_node=s.model.n_gpus_per_node,
                                    key=f"{s.key}.n_gpus_per_node", address=address)
        self.metrics: dict[str, float] = {}

    def score(self, samples, response_lengths=None, *, chats, response_ids=None, timer=None):
        ids = [list(map(int, r)) for r in response_ids] if response_ids is not None else None
        scores, extras, metrics, t_model, t_fn = self.client.get(self.client.submit(samples, response_lengths,
                                                                                    chats, ids))
        for k, v in metrics.items():
            self.metrics[k] = self.metrics.get(k, 0.0) + v
        if timer is not None:
            timer.add("reward_model", t_model)
            timer.add("reward_fn", t_fn)
        return scores, extras

    def pop_metrics(self) -> dict[str, float]:
        out, self.metrics = self.metrics, {}
        return out

    def close(self) -> None:
        self.client.close()
