"""Mixture-of-Experts training on CPU (issue 47): routing replay (R2/R3), the router load-balancing loss, the routes'
path from the hf rollout into the batch, and the config rules. Tiny in-memory Qwen3-MoE models (transformers'
`grouped_mm` experts backend, which has a CPU kernel)."""

import copy
import dataclasses

import pytest
import torch

from polyrl.algorithms.losses import LossKnobs
from polyrl.errors import ConfigError
from polyrl.learner.actor import Actor, ForwardSettings, UpdateSettings, compute_logprobs, make_scheduler
from polyrl.learner.batch import build_batch, pad_columns, select, trim_columns
from polyrl.models.moe import MoERouting, check_router_replay, find_routers, parameter_counts


def _moe(seed=0, layers=2, experts=8, top_k=2, **kw):
    from transformers import AutoModelForCausalLM

    from polyrl.models.tiny import tiny_config

    torch.manual_seed(seed)
    cfg = tiny_config(100, arch="qwen3_moe", hidden_size=32, layers=layers, heads=4, kv_heads=2, intermediate=64,
                      num_experts=experts, num_experts_per_tok=top_k, **kw)
    return AutoModelForCausalLM.from_config(cfg)


def _batch(num_rows=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(4, 90, (int(torch.randint(3, 8, (1,), generator=g)),), generator=g).tolist()
               for _ in range(num_rows)]
    responses = [torch.randint(4, 90, (int(torch.randint(1, 6, (1,), generator=g)),), generator=g).tolist()
                 for _ in range(num_rows)]
    batch = build_batch(prompts, responses, pad_token_id=0, device=torch.device("cpu"))
    batch["advantages"] = torch.randn(batch["responses"].shape, generator=g) * batch["response_mask"]
    return batch


def _random_routes(batch, experts=8, top_k=2, layers=2, seed=1):
    """Distinct random expert ids at every real position, -1 at padding."""
    g = torch.Generator().manual_seed(seed)
    B, L = batch["input_ids"].shape
    ids = torch.rand(B, L, layers, experts, generator=g).argsort(-1)[..., :top_k].to(torch.int16)
    return torch.where(batch["attention_mask"].bool()[:, :, None, None], ids, torch.full_like(ids, -1))


def _actor(model, fwd=None):
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = make_scheduler(opt, total_steps=10, warmup_steps=0, kind="constant", min_lr_ratio=0.0, num_cycles=0.5)
    return Actor(model, opt, sched, fwd=fwd)


def _settings(**kw):
    base = dict(mini_batch_size=6, micro_batch_size=3, ppo_epochs=1, temperature=1.0, loss_mode="vanilla",
                loss_agg_mode="token-mean", knobs=LossKnobs(), grad_clip=1e9, entropy_coeff=0.0,
                use_kl_loss=False, kl_loss_coef=0.0, kl_loss_type="low_var_kl", old_from_current=True)
    base.update(kw)
    return UpdateSettings(**base)


def _experts_calls(model):
    """Record the (top_k_index, top_k_weights) every experts module receives."""
    calls = []
    for layer in model.model.layers:
        layer.mlp.experts.register_forward_pre_hook(lambda m, args: calls.append((args[1].clone(), args[2])))
    return calls


# ------------------------------------------------------------------------------------------------- replay (R3)
def test_replayed_routes_are_used_and_the_router_still_learns():
    model = _moe()
    batch = _batch()
    routes = _random_routes(batch)
    routing = MoERouting(model)
    calls = _experts_calls(model)
    with routing.plan(replay=True):
        routing.begin(routes.flatten(0, 1))
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        logits.square().mean().backward()
    real = batch["attention_mask"].flatten().bool()
    for layer, (ids, weights) in enumerate(calls):
        want = routes.flatten(0, 1)[:, layer].long()
        assert torch.equal(ids[real], want[real])  # exactly the recorded experts at every real token
        assert torch.allclose(weights.sum(-1), torch.ones(len(weights)), atol=1e-5)  # norm_topk_prob
    for router in find_routers(model):
        assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0
    # gate weights are the live softmax gathered at the replayed ids, renormalised
    hidden = {}
    h = find_routers(model)[0].register_forward_hook(lambda m, a, o: hidden.update(x=a[0].detach()))
    with torch.no_grad(), routing.plan(replay=True):
        calls.clear()
        routing.begin(routes.flatten(0, 1))
        model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    h.remove()
    probs = torch.softmax(hidden["x"] @ find_routers(model)[0].weight.T, -1)
    want = routes.flatten(0, 1)[:, 0].long()
    gate = probs.gather(1, want.clamp_min(0))
    torch.testing.assert_close(calls[0][1][real], (gate / gate.sum(-1, keepdim=True))[real])


def test_replaying_the_models_own_routes_changes_nothing_and_agrees_fully():
    model = _moe()
    batch = _batch()
    routing = MoERouting(model)
    with torch.no_grad():
        ref = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        with routing.plan(record=True):
            routing.begin()
            model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
            own = routing.take_recorded()
        with routing.plan(replay=True):
            routing.begin(own)
            again = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
            match, total = routing.agreement_counts()
    assert torch.equal(ref, again)
    assert int(match) == int(total) == own.shape[0] * routing.num_layers
    # outside a plan the hooks do nothing, even with stale state
    with torch.no_grad():
        assert torch.equal(model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits, ref)


@pytest.mark.parametrize("packed", [False, True])
def test_r2_records_then_replays_in_the_batch_layout(packed):
    """compute_logprobs(record_routes=True) returns routes in the batch's columns (micro-batches trimmed
    differently); replaying them reproduces the log-probs exactly and agrees 100%, packed or padded."""
    model = _moe()
    batch = _batch(num_rows=6)
    fwd = ForwardSettings(use_remove_padding=packed, pack_on_cpu=packed, routing=MoERouting(model),
                          replay_routes=True)
    logp, routes = compute_logprobs(model, batch, temperature=1.0, micro_batch_size=2, fwd=fwd, record_routes=True)
    assert routes.shape == (*batch["input_ids"].shape, 2, 2)
    assert bool(((routes[..., 0] >= 0) == batch["attention_mask"].bool()[:, :, None]).all())
    batch["routed_experts"] = routes
    again = compute_logprobs(model, batch, temperature=1.0, micro_batch_size=3, fwd=fwd)
    torch.testing.assert_close(again, logp, rtol=0, atol=1e-6)
    # R3-style foreign routes change the log-probs
    batch["routed_experts"] = _random_routes(batch)
    assert (compute_logprobs(model, batch, temperature=1.0, micro_batch_size=3, fwd=fwd) - logp).abs().max() > 1e-4


def test_routes_survive_trim_and_pad_columns():
    batch = _batch()
    batch["routed_experts"] = _random_routes(batch)
    mb = trim_columns(select(batch, slice(0, 2)))
    assert mb["routed_experts"].shape[:2] == mb["input_ids"].shape
    wide = pad_columns(mb, batch["input_ids"].shape[1] - batch["responses"].shape[1] + 2,
                       batch["responses"].shape[1] + 1)
    assert wide["routed_experts"].shape[:2] == wide["input_ids"].shape
    assert bool(((wide["routed_experts"][..., 0, 0] >= 0) == wide["attention_mask"].bool()).all())


def test_update_with_replay_reports_agreement_and_mismatch_kl():
    model = _moe()
    batch = _batch()
    batch["rollout_log_probs"] = compute_logprobs(model, batch, temperature=1.0, micro_batch_size=6) - 0.01
    batch["routed_experts"] = _random_routes(batch)
    actor = _actor(model, ForwardSettings(replay_routes=True))
    m = actor.update(batch, _settings())
    assert 0.0 <= m["actor/router_agreement"] < 0.5  # random routes rarely equal the router's own top-2 of 8
    assert "rollout_corr/kl" in m
    assert not actor.fwd.routing.planned  # the plan ends with the update (the hf rollout shares the module)


# ------------------------------------------------------------------------------------------------- aux loss
def test_aux_loss_off_leaves_the_update_unchanged_and_on_reaches_the_router():
    batch = _batch()
    base = _moe()
    results = {}
    for name in ("dense_path", "off", "on"):
        model = copy.deepcopy(base)
        if name == "on":
            model.config.output_router_logits = True
            model.config.router_aux_loss_coef = 0.5
        fwd = ForwardSettings()
        actor = _actor(model, fwd)
        if name == "dense_path":  # no router hooks at all: what polyrl did before MoE support
            actor.fwd = dataclasses.replace(actor.fwd, routing=None)
        m = actor.update(batch, _settings())
        results[name] = (torch.cat([p.detach().flatten() for p in model.parameters()]), m,
                         torch.cat([r.weight.detach().flatten() for r in find_routers(model)]))
    assert torch.equal(results["off"][0], results["dense_path"][0])  # off: bitwise the same update
    assert "actor/moe_aux_loss" not in results["off"][1]
    assert results["on"][1]["actor/moe_aux_loss"] > 0
    assert (results["on"][2] - results["off"][2]).abs().max() > 1e-6  # the aux term moved the routers


def test_aux_term_alone_gives_the_router_a_gradient():
    """Zero advantages: the policy loss has no gradient, so any router gradient comes from the aux term."""
    batch = _batch()
    batch["advantages"] = torch.zeros_like(batch["advantages"])
    grads = {}
    for on in (False, True):
        model = _moe()
        model.config.output_router_logits = on
        model.config.router_aux_loss_coef = 0.01
        actor = _actor(model)
        actor.optimizer.step = lambda: None  # keep the gradient for inspection
        actor.update(batch, _settings(grad_clip=1e9))
        grads[on] = sum(float(r.weight.grad.abs().sum()) if r.weight.grad is not None else 0.0
                        for r in find_routers(model))
    assert grads[False] == 0.0 and grads[True] > 0.0


# ------------------------------------------------------------------------------------------------- rollout -> batch
def test_hf_rollout_records_routes_the_trainer_reproduces():
    from polyrl.rollout.base import SamplingParams
    from polyrl.rollout.hf import HFRollout
    from polyrl.trainer.rollout_batch import routes_batch

    model = _moe().eval()
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12]]
    out = HFRollout(model, pad_token_id=0).generate(prompts, SamplingParams(n=2, max_new_tokens=5,
                                                                            record_routes=True))
    rows = [prompts[i] for i in out.prompt_index]
    for r, p, t in zip(out.routed_experts, rows, out.token_ids):
        assert r.shape == (len(p) + len(t), 2, 2) and r.dtype == torch.int16
        assert bool((r[-1] == -1).all()) and bool((r[:-1] >= 0).all())  # the last token was never fed back
    batch = build_batch(rows, out.token_ids, pad_token_id=0, device=torch.device("cpu"))
    batch["routed_experts"] = routes_batch(out.routed_experts, [len(p) for p in rows], batch, torch.device("cpu"))
    routing = MoERouting(model)
    with torch.no_grad(), routing.plan(replay=False):
        routing.begin(batch["routed_experts"].flatten(0, 1))
        model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
              position_ids=batch["position_ids"])
        match, total = routing.agreement_counts()
    assert int(total) == sum(len(r) - 1 for r in out.routed_experts) * 2
    assert float(match) / float(total) > 0.95  # same weights, same fp32 numbers up to batching


# ------------------------------------------------------------------------------------------------- config + counts
def test_router_replay_config_rules():
    check_router_replay("R3", True, True)
    check_router_replay("R2", False, True)
    check_router_replay("disabled", True, True)  # record and measure the agreement only
    for args, words in [(("R3", False, True), "enable_rollout_routing_replay=True"),
                        (("R2", True, True), "conflicts"),
                        (("R4", False, True), "one of disabled, R2, R3"),
                        (("R3", True, False), "dense"),
                        (("R3", True, True, 2), "ulysses")]:
        with pytest.raises(ConfigError, match=words):
            check_router_replay(*args)


def test_total_and_active_parameter_counts():
    model = _moe(experts=8, top_k=2)
    total, active = parameter_counts(model)
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    assert total == sum(p.numel() for p in model.parameters())
    assert active == total - experts + experts // 4


def test_flops_and_memory_count_active_experts_for_compute_and_all_for_state():
    """Qwen3-30B-A3B's real shape (meta device, no weights): 3.04B active matmul parameters a token (issue 47's
    18.3 GFLOP a trained token), 30.5B in all; the optimizer state goes to the host on 4 x 80 GB, not on 16 GPUs."""
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig

    from polyrl.learner.flops import matmul_params, training_flops
    from polyrl.learner.memory import GiB, ModelShape, optimizer_offload_choice

    cfg = Qwen3MoeConfig(vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                         num_experts=128, num_experts_per_tok=8, num_hidden_layers=48, num_attention_heads=32,
                         num_key_value_heads=4, head_dim=128, norm_topk_prob=True, tie_word_embeddings=False)
    trunk, head = matmul_params(cfg)
    assert abs((trunk + head) / 1e9 - 3.04) < 0.01
    assert abs(training_flops(cfg, [1]) / 1e9 - 18.25) < 0.05
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    shape = ModelShape.of(model)
    assert abs(shape.num_params / 1e9 - 30.53) < 0.01 and abs(shape.num_active / 1e9 - 3.35) < 0.01
    assert shape.moe_bytes_per_token > 0  # the routed copies in the grouped GEMMs add activation bytes
    assert optimizer_offload_choice(shape.num_trainable, total=80 * GiB, world_size=4).value
    assert not optimizer_offload_choice(shape.num_trainable, total=80 * GiB, world_size=16).value


def test_auto_offload_on_gpus_that_cannot_hold_the_state(monkeypatch, tmp_path):
    from polyrl.config import build_config
    from polyrl.learner import memory
    from polyrl.models.tiny import build_tiny_model
    from polyrl.trainer.config import PPOConfig

    model = build_tiny_model(tmp_path / "m", arch="qwen3_moe", hidden_size=32, layers=1, heads=2, kv_heads=1,
                             intermediate=64)
    n = memory.trainable_parameters_of(build_config(PPOConfig(), [f"actor_rollout_ref.model.path={model}"])
                                       .actor_rollout_ref.model)
    monkeypatch.setattr(memory, "device_memory", lambda device: (0, int(1.05 * 16 * n / 2 / memory.STATE_SHARE)))
    logs = []
    for world, want in ((1, "more than one GPU holds"), (2, False), (4, False)):
        cfg = build_config(PPOConfig(), [f"actor_rollout_ref.model.path={model}"])
        if world == 1:
            with pytest.raises(ConfigError, match=want):
                memory.resolve_optimizer_offload(cfg, world_size=1, device=torch.device("cuda"), log=logs.append)
            continue
        memory.resolve_optimizer_offload(cfg, world_size=world, device=torch.device("cuda"), log=logs.append)
        assert cfg.actor_rollout_ref.actor.fsdp_config.offload_policy is False  # fits on 2 (5% to spare)
    cfg = build_config(PPOConfig(), [f"actor_rollout_ref.model.path={model}"])
    monkeypatch.setattr(memory, "device_memory", lambda device: (0, int(16 * n / 3 / memory.STATE_SHARE)))
    memory.resolve_optimizer_offload(cfg, world_size=2, device=torch.device("cuda"), log=logs.append)
    assert cfg.actor_rollout_ref.actor.fsdp_config.offload_policy is True
    assert "go to host memory" in logs[-1] and "offload_policy=True" in logs[-1]
    cpu = build_config(PPOConfig(), [f"actor_rollout_ref.model.path={model}"])
    memory.resolve_optimizer_offload(cpu, world_size=2, device=torch.device("cpu"))
    assert cpu.actor_rollout_ref.actor.fsdp_config.offload_policy is False


def test_training_routes_grouped_mm_through_autocast():
    """HF's grouped_mm experts under the actor's bf16 autocast: bf16 GEMMs on CUDA once MoERouting is set up (torch
    leaves `_grouped_mm` off autocast's list, so fp32 master weights ran fp32 GEMMs). Checked at the dispatcher."""
    from polyrl.models import moe

    moe.grouped_mm_under_autocast()
    moe.grouped_mm_under_autocast()  # once per process: a second call is a no-op, not a duplicate registration
    assert torch._C._dispatch_has_kernel_for_dispatch_key("aten::_grouped_mm", "AutocastCUDA")


def test_lora_target_parameters_list_is_kept_under_all_linear():
    """peft's all-linear adapts an MoE's expert tensors by itself: `target_parameters=[]` must still mean no experts
    (routers and attention keep their adapters), and the explicit default list must equal leaving it unset."""
    from polyrl.models.loader import apply_lora
    from polyrl.models.moe import expert_parameter_targets

    def trained(params):
        model = _moe()
        wanted = expert_parameter_targets(model) if params == "default" else params
        lora = apply_lora(model, rank=4, alpha=8, target_modules="all-linear", target_parameters=wanted)
        return sorted(n for n, p in lora.named_parameters() if p.requires_grad)

    unset, empty, default = trained(None), trained([]), trained("default")
    assert any(".experts." in n for n in unset) and unset == default
    assert not any(".experts." in n for n in empty)
    assert {n for n in unset if ".experts." not in n} == set(empty)  # attention and routers keep theirs
    assert any(".gate." in n for n in empty) and any("q_proj" in n for n in empty)


def test_grouped_experts_run_bf16_grouped_gemms_compiled_over_fp32_masters():
    """Under torch.compile with fp32 weights, HF's grouped_mm experts fall back to a Python loop of per-expert fp32
    matmuls (the MoE update's 4% MFU on GPUs). polyrl's experts forward runs `_grouped_mm` in the autocast dtype,
    matches HF's numbers, trains the fp32 masters, and leaves fp32 forwards (no autocast) to HF's own code."""
    from polyrl.models.moe import grouped_experts

    hf, ours = _moe(), _moe()
    assert grouped_experts(ours) == 2 and grouped_experts(ours) == 0  # once per module
    ids = torch.randint(4, 90, (2, 12))
    with torch.no_grad():
        assert torch.equal(hf(ids).logits, ours(ids).logits)  # fp32, no autocast: HF's forward
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want, got = hf(ids).logits.float(), ours(ids).logits.float()
    assert (want - got).abs().max() < 2e-2 * want.abs().max()
    got.square().mean().backward()
    grad = ours.model.layers[0].mlp.experts.gate_up_proj.grad
    assert grad is not None and grad.dtype == torch.float32 and grad.abs().sum() > 0

    experts = copy.deepcopy(ours).model.layers[1].mlp.experts  # a deep copy keeps the forward, bound to itself
    x, top, w = torch.randn(10, 32), torch.randint(0, 8, (10, 2)), torch.rand(10, 2)
    with torch.profiler.profile() as prof, torch.autocast("cpu", dtype=torch.bfloat16):
        torch.compile(experts, dynamic=True)(x, top, w).float().sum().backward()
    ops = {e.key for e in prof.key_averages()}
    assert "aten::_grouped_mm" in ops and not any("fallback" in k for k in ops)


def test_grouped_experts_carry_lora_on_the_expert_tensors():
    """peft's LoRA on the experts (`target_parameters`) parametrizes `gate_up_proj` / `down_proj`; polyrl's experts
    forward reads them the same way, so with equal adapters it matches transformers' forward and trains them."""
    from polyrl.models.loader import apply_lora
    from polyrl.models.moe import grouped_experts

    hf, ours = _moe(), _moe()
    grouped_experts(ours)
    hf, ours = (apply_lora(m, rank=4, alpha=8, target_modules="all-linear") for m in (hf, ours))
    g = torch.Generator().manual_seed(3)
    for (name, a), (_, b) in zip(hf.named_parameters(), ours.named_parameters()):
        if "lora_" in name:  # equal, non-zero adapters (lora_B starts at zero)
            a.data.copy_(torch.randn(a.shape, generator=g) * 0.1)
            b.data.copy_(a.data)
    ids = torch.randint(4, 90, (2, 12))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want, got = hf(ids).logits.float(), ours(ids).logits.float()
    assert (want - got).abs().max() < 2e-2 * want.abs().max()
    got.square().mean().backward()
    grads = [p.grad for n, p in ours.named_parameters() if ".experts." in n and "lora_" in n]
    assert len(grads) == 8 and all(gr is not None and gr.abs().sum() > 0 for gr in grads)
