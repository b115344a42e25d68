"""Where a step's batch comes from, for `PPOTrainer` and the off-policy rollout process (async_ppo.py): prompts ->
gen -> reward (-> DAPO dynamic sampling, remax baselines) -> the padded batch the update reads.

`_collect_batch` is the on-policy path; partial rollouts (partial_rollout.py) bring their own finished groups to
`_assemble_batch`. Needs the trainer's cfg, sampler, engine, reward, tokenizer, oom guard, dist and device.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from polyrl.algorithms import select_groups
from polyrl.distributed import data as dp_data
from polyrl.errors import ConfigError
from polyrl.learner.batch import build_batch
from polyrl.rollout import SamplingParams
from polyrl.rollout.base import select_rows
from polyrl.trainer.oom import StageContext


class RolloutBatchMixin:
    """Generation, scoring and batch assembly of the LLM trainer (see the module docstring)."""

    def _collect_batch(self, timer):
        """gen + reward (+ DAPO dynamic sampling): the batch of sequences this step trains on."""
        parts, metrics = self._collect_parts(timer)
        return self._assemble_batch(parts, self.cfg.data.train_batch_size, metrics)

    def _prompt_share(self, prompts: list) -> list:
        """The prompts of a drawn batch this process generates for: its data shard's whole prompt groups
        (polyrl.distributed.data; the off-policy rollout replicas deal their own, trainer/rollout_pool.py)."""
        if not self.dist.data.is_distributed:
            return prompts
        keep = dp_data.shard_prompts(len(prompts), self.cfg.actor_rollout_ref.actor.ppo_mini_batch_size,
                                     self.dist.data.rank, self.dist.data.world_size)
        return [prompts[i] for i in keep]

    def _collect_parts(self, timer) -> tuple[list[dict], dict]:
        """gen + reward (+ DAPO dynamic sampling): scored generation parts for `_assemble_batch`, and their metrics."""
        cfg, r = self.cfg, self.cfg.actor_rollout_ref.rollout
        fg = cfg.algorithm.filter_groups
        want = cfg.data.train_batch_size
        parts, metrics = [], {}
        num_gen = 0
        while True:
            prompts, out = self._generate_batch(timer)
            num_gen += 1
            metrics.update(getattr(out, "metrics", {}))  # multi-turn: turns, tool calls, prefill tokens saved
            part = self._scored_part(prompts, out, timer, metrics)
            if cfg.algorithm.adv_estimator == "remax":
                with timer.stage("gen_max"):
                    greedy = self.engine.generate([p.prompt_ids for p in prompts],
                                                  SamplingParams(n=1, temperature=0.0, max_new_tokens=r.response_length,
                                                                 stop_token_ids=self.stop_ids))
                    base, _, _ = self._score(prompts, greedy)
                part["baselines"] = [base[i] for i in out.prompt_index]
            if not fg.enable:
                parts = [part]
                break
            # DAPO dynamic sampling: keep only groups whose metric varies, until train_batch_size prompts are kept
            scores, extras = part["scores"], part["extras"]
            metric = extras.get(fg.metric, scores) if fg.metric not in (None, "score", "seq_reward") else scores
            kept, _ = select_groups(metric, out.prompt_index)
            metrics["train/num_gen_batches"] = num_gen
            part["keep"] = set(kept)
            parts.append(part)
            num_kept = sum(len(p["keep"]) for p in parts)
            if self.dist.data.is_distributed:  # every rank generates until the job has kept enough groups
                num_kept = int(self.dist.data.all_reduce(torch.tensor(num_kept, device=self.device)))
            if num_kept >= want:
                if self.dist.data.is_distributed:
                    parts = self._deal_kept_groups(parts, want)
                break
            if fg.max_num_gen_batches and num_gen >= fg.max_num_gen_batches:
                raise ConfigError(
                    f"Dynamic sampling kept {num_kept} of the {want} prompts needed after {num_gen} generation "
                    "batches (algorithm.filter_groups.max_num_gen_batches); raise it, or disable filter_groups: "
                    "too many groups get identical rewards.")
        return parts, metrics

    def _deal_kept_groups(self, parts: list[dict], want: int) -> list[dict]:
        """DAPO dynamic sampling on several processes: ranks keep different numbers of groups, so every rank's kept
        groups go to all (only their rows travel), in the order one process keeps them (round, then the prompt's
        place in the drawn batch); the batch is the first `want` of them, and each rank trains its slice of every
        mini-batch of it (`dp_data.shard_prompts`, as for drawn prompts). One part per group, in that order."""
        env, mini = self.dist.data, self.cfg.actor_rollout_ref.actor.ppo_mini_batch_size
        drawn = self.cfg.data.gen_batch_size or self.cfg.data.train_batch_size
        sent = []
        for p in parts:
            rows = [j for j, pi in enumerate(p["out"].prompt_index) if pi in p["keep"]]
            sent.append({**p, "out": select_rows(p["out"], rows, [p["out"].prompt_index[j] for j in rows]),
                         "scores": [p["scores"][j] for j in rows],
                         "extras": {k: [v[j] for j in rows] for k, v in p["extras"].items()},
                         "baselines": None if p["baselines"] is None else [p["baselines"][j] for j in rows]})
        everyone = env.all_gather_object(sent)  # [rank][round]
        place = [dp_data.shard_prompts(drawn, mini, r, env.world_size) for r in range(env.world_size)]
        order = sorted((k, place[r][pi], r, pi) for r in range(env.world_size) for k in range(len(parts))
                       for pi in dict.fromkeys(everyone[r][k]["out"].prompt_index))
        mine = [order[i] for i in dp_data.shard_prompts(want, mini, env.rank, env.world_size)]
        return [{**everyone[r][k], "keep": {pi}} for k, _, r, pi in mine]

    def _generate_batch(self, timer):
        """This process's share of the next prompts (`_prompt_share`) and their generation (`timing_s/gen`)."""
        prompts = self._prompt_share(self.sampler.next_batch())
        with timer.stage("gen"):
            sampling = self._sampling_params()
            out = self.oom.run("gen", lambda: self._rollout(prompts, sampling), ctx=StageContext(engine=self.engine))
        return prompts, out

    def _scored_part(self, prompts, out, timer, metrics: dict, step: int | None = None) -> dict:
        """The generation scored (`timing_s/reward`), as a part for `_assemble_batch`; the reward's own counts are
        added to `metrics`; `step` names a rollout_data_dir dump (default the current one)."""
        with timer.stage("reward"):
            scores, extras, texts = self._score(prompts, out, timer=timer)
        for k, v in getattr(self.reward, "pop_metrics", dict)().items():  # counts over the step's batches
            metrics[k] = metrics.get(k, 0.0) + v
        if self.cfg.trainer.rollout_data_dir:
            self._dump_generations(self.cfg.trainer.rollout_data_dir, prompts, out, texts, scores, step)
        return dict(prompts=prompts, out=out, scores=scores, extras=extras, baselines=None)

    def _sampling_params(self) -> SamplingParams:
        r = self.cfg.actor_rollout_ref.rollout
        return SamplingParams(n=r.n, temperature=r.temperature if r.do_sample else 0.0, top_k=r.top_k, top_p=r.top_p,
                              max_new_tokens=r.response_length, stop_token_ids=self.stop_ids, ignore_eos=r.ignore_eos,
                              record_routes=r.enable_rollout_routing_replay)

    def _assemble_batch(self, parts: list[dict], want: int, metrics: dict, device=None):
        """The step's batch from scored generation parts (dicts of prompts, out, scores, extras, baselines[, keep]),
        on `device` (default the trainer's)."""
        cfg, device = self.cfg, device or self.device
        rows = kept_rows(parts, want)
        samples = [parts[i]["prompts"][parts[i]["out"].prompt_index[j]] for i, j in rows]
        agent = hasattr(parts[0]["out"], "response_masks")  # multi-turn: per-row prompts (tool schemas) and masks
        prompts_all = [parts[i]["out"].prompt_ids[j] for i, j in rows] if agent else [s.prompt_ids for s in samples]
        resp = [parts[i]["out"].token_ids[j] for i, j in rows]
        logps = [parts[i]["out"].logprobs[j] for i, j in rows]
        scores = [parts[i]["scores"][j] for i, j in rows]
        index = [i * 1_000_000 + parts[i]["out"].prompt_index[j] for i, j in rows]  # group id: (batch, prompt)
        baselines = [parts[i]["baselines"][j] for i, j in rows] if parts[0]["baselines"] is not None else []
        gdpo_keys = cfg.algorithm.gdpo_reward_keys if cfg.algorithm.adv_estimator == "gdpo" else None
        extras_all = {k: [parts[i]["extras"][k][j] for i, j in rows] for k in parts[0]["extras"]}
        batch = build_batch(prompts_all, resp, pad_token_id=self.tokenizer.pad_token_id, device=device)
        rl = torch.zeros(batch["response_mask"].shape, dtype=batch["response_mask"].dtype)  # filled on the host,
        for i, lp in enumerate(logps):  # then one copy (a device copy per row cost a sync each)
            rl[i, : len(lp)] = torch.tensor(lp, dtype=rl.dtype)
        batch["rollout_log_probs"] = rl.to(device)
        if all(p["out"].routed_experts is not None for p in parts):  # MoE routing replay (R3): the engine's routes
            batch["routed_experts"] = routes_batch([parts[i]["out"].routed_experts[j] for i, j in rows],
                                                   [len(p) for p in prompts_all], batch, device)
        if agent:  # tool tokens are context, never trained on: response_mask 0
            rm = torch.zeros_like(rl)
            for k, (i, j) in enumerate(rows):
                m = parts[i]["out"].response_masks[j]
                rm[k, : len(m)] = torch.tensor(m, dtype=rm.dtype)
            batch["response_mask"] = rm.to(device)
        tls = torch.zeros_like(batch["response_mask"])
        last = (batch["response_lengths"] - 1).clamp(min=0)
        tls[torch.arange(len(scores)), last] = torch.tensor(scores, device=device, dtype=tls.dtype)
        batch["token_level_scores"] = tls
        if baselines:
            batch["reward_baselines"] = torch.tensor(baselines, device=device)
        if gdpo_keys:  # [B, K]: one column per reward component, popped again by _advantages
            missing = [k for k in gdpo_keys if k not in extras_all]
            if missing:
                raise ConfigError(f"algorithm.gdpo_reward_keys names {missing}, which the reward function does not "
                                  f"return (it returns {sorted(extras_all)}); return them in its result dict.")
            batch["reward_components"] = torch.tensor([extras_all[k] for k in gdpo_keys], dtype=torch.float32,
                                                      device=device).T
        for k, v in extras_all.items():
            metrics[f"reward_extra/{k}/mean"] = float(np.mean(v))
        return samples, batch, index, metrics

    def _rollout(self, prompts, sampling):
        """Generation for a list of samples: one engine call, or with multi_turn.enable each sample's agent loop
        (polyrl/agents/runner.py), which samples its turns on the same engine."""
        if self.agents is None:
            return self._generate([p.prompt_ids for p in prompts], sampling)
        self.engine.resume()
        version = self._generating_version()
        run = lambda engine, samples: self.agents.generate(engine, samples, sampling, weight_version=version)  # noqa: E731
        if hasattr(self.engine, "run_led"):  # a tensor-parallel replica: its rank 0 runs the loops of every rank's prompts
            out = self.engine.run_led(prompts, run)
        else:
            out = run(self.engine, prompts)
        if self.cfg.actor_rollout_ref.rollout.free_cache_engine:
            self.engine.release_memory()
        return out

    def _generating_version(self) -> int:
        """The version of the engine's weights (optimizer steps behind them), tagged on each multi-turn turn: on-policy
        the current step's; an off-policy rollout process's own (async_ppo.py)."""
        return self.global_step

    def _generate(self, prompt_ids, sampling):
        """KV cache in, generate, KV cache out (rollout.free_cache_engine): the unit an OOM retry re-runs."""
        self.engine.resume()
        out = self.engine.generate(prompt_ids, sampling)
        if self.cfg.actor_rollout_ref.rollout.free_cache_engine:
            self.engine.release_memory()
        return out

    def _score(self, prompts, out, tool_rewards: bool = True, timer=None):
        """Reward-function scores (+ multi-turn tool step rewards unless `tool_rewards=False`, as in validation); a
        reward model's parts are timed on `timer` (default the trainer's)."""
        texts = self.tokenizer.batch_decode(out.token_ids, skip_special_tokens=True)
        samples = [(prompts[pi].data_source, text, prompts[pi].ground_truth, prompts[pi].extra_info)
                   for pi, text in zip(out.prompt_index, texts)]
        if hasattr(self.reward, "pop_metrics"):  # a reward model reads the chat prompt (rewards/model_reward.py)
            scores, extras = self.reward.score(samples, response_lengths=out.lengths, timer=timer or self.timer,
                                               chats=[prompts[pi].raw_prompt for pi in out.prompt_index],
                                               response_ids=out.token_ids)
        else:
            scores, extras = self.reward.score(samples, response_lengths=out.lengths)
        own = getattr(out, "reward_scores", None)
        if own:  # multi-turn: a loop that scores its own trajectory replaces the reward function (as verl)
            scores = [float(s) if o is None else float(o) for s, o in zip(scores, own)]
        tool = getattr(out, "tool_rewards", None) if tool_rewards else None
        if tool:  # multi-turn: the reward function's score plus the tools' step rewards
            scores = [float(a) + b for a, b in zip(scores, tool)]
            extras = {**extras, "tool_reward": list(tool)}
        return scores, extras, texts  # the decoded responses, for logging and majority votes

    def _dump_generations(self, folder: str, prompts, out, responses, scores, step: int | None = None) -> None:
        """One jsonl file per step (verl's rollout_data_dir / validation_data_dir): prompt, response, score; `step`
        is the one that trains on them (default the current one)."""
        step = self.global_step + 1 if step is None else step
        Path(folder).mkdir(parents=True, exist_ok=True)
        rank = f"_rank{self.dist.rank}" if self.dist.is_distributed else ""
        with open(Path(folder) / f"{step}{rank}.jsonl", "a") as f:
            for pi, resp, score in zip(out.prompt_index, responses, scores):
                prompt = self.tokenizer.decode(prompts[pi].prompt_ids, skip_special_tokens=True)
                f.write(json.dumps({"step": step, "input": prompt, "output": resp, "score": score})
                        + "\n")


def routes_batch(routes: list[torch.Tensor], prompt_lens: list[int], batch, device) -> torch.Tensor:
    """`[B, P+T, num_moe_layers, top_k]` int16 in the batch's layout (left-padded prompt | response), -1 where no
    route was recorded, from `Generation.routed_experts` (one `[len(prompt) + len(response), L, K]` per row)."""
    B, L = batch["input_ids"].shape
    P = L - batch["responses"].shape[1]
    out = torch.full((B, L, *routes[0].shape[1:]), -1, dtype=torch.int16)
    for b, (r, p) in enumerate(zip(routes, prompt_lens)):
        n = min(len(r), L - (P - p))
        out[b, P - p:P - p + n] = r[:n]
    return out.to(device)


def kept_rows(parts: list[dict], num_groups: int) -> list[tuple[int, int]]:
    """(generation batch, row) pairs to train on: every row of every part (a plain step has one; the off-policy
    trainer gets one from each rollout replica); under DAPO dynamic sampling the rows of the first `num_groups` kept
    prompt groups (whole groups only, in generation order)."""
    if "keep" not in parts[0]:
        return [(i, j) for i, p in enumerate(parts) for j in range(len(p["out"].prompt_index))]
    groups = [(i, pi) for i, p in enumerate(parts) for pi in dict.fromkeys(p["out"].prompt_index) if pi in p["keep"]]
    chosen = set(groups[:num_groups])
    return [(i, j) for i, p in enumerate(parts) for j, pi in enumerate(p["out"].prompt_index) if (i, pi) in chosen]
