"""fp32 LoRA adapters on a bf16 DiT: computed in bf16, stepped as fp32 masters, checkpointed as fp32 (one process)."""

import torch

from polyrl.trainer import flow_quickstart
from polyrl.models.diffusion import tiny
from polyrl.trainer.flow_config import FlowConfig
from polyrl.trainer.flow_grpo import FlowGRPOTrainer


def _trainer(run_dir, steps, resume="disable", lora=True):
    """LoRA r4 in fp32 over a bf16 tiny DiT; `lora=False`: full fine-tuning of fp32 weights with a KL reference."""
    cfg = FlowConfig()
    ro, actor = cfg.actor_rollout_ref.rollout, cfg.actor_rollout_ref.actor
    ro.n, ro.pipeline.num_inference_steps = 2, 3
    ro.algo.sde_window_size, ro.algo.sde_window_range = 1, [0, 2]
    cfg.data.train_batch_size, actor.ppo_mini_batch_size, actor.ppo_micro_batch_size_per_gpu = 2, 2, 4
    actor.optim.lr, actor.diffusion_loss.clip_ratio = 1e-3, 0.5
    if lora:
        cfg.actor_rollout_ref.model.lora_rank, cfg.actor_rollout_ref.model.lora_alpha = 4, 8
    else:
        cfg.actor_rollout_ref.model.lora_rank = 0
        actor.use_kl_loss, actor.kl_loss_coef = True, 0.05
    t = cfg.trainer
    t.total_training_steps, t.save_freq, t.test_freq, t.val_before_train = steps, steps, 0, False
    t.run_dir, t.default_local_dir, t.progress_bar = str(run_dir / "run"), str(run_dir / "checkpoints"), False
    t.resume_mode = resume
    torch.manual_seed(0)
    transformer = tiny.build_transformer(seed=0)
    policy = flow_quickstart.make_policy(cfg, transformer.to(torch.bfloat16) if lora else transformer,
                                         tiny.CharPromptEncoder(seed=0))  # fmt: skip
    if lora:
        for p in policy.trainable_parameters():  # what a real run does: LoRA in fp32 over the bf16 base
            p.data = p.data.float()
    prompts = [(tiny.prompt_for(d), {"digit": d}) for d in range(4)]
    reward = lambda images, prompts, metadata: images.float().mean(dim=(1, 2, 3))  # noqa: E731
    return FlowGRPOTrainer(cfg, policy, reward, prompts, prompts[:2])


def test_lora_masters_are_fp32_and_the_module_computes_in_bf16(tmp_path):
    trainer = _trainer(tmp_path, steps=2)
    mw = trainer.master
    assert mw is not None and all(m.dtype == torch.float32 for m in mw.master)
    start = [m.detach().clone() for m in mw.master]
    trainer.fit()
    lora = dict(trainer.policy.transformer.named_parameters())
    moved = max(float((m.detach() - s).abs().max()) for m, s in zip(mw.master, start))
    assert moved > 1e-4
    for name, m in zip(mw.names, mw.master):  # the module holds the masters rounded to bf16, no stale grads
        assert lora[name].dtype == torch.bfloat16 and torch.equal(lora[name], m.detach().to(torch.bfloat16)), name
        assert lora[name].grad is None
    # the checkpoint keeps fp32 masters and their Adam state; a new trainer resumes them exactly
    fresh = _trainer(tmp_path, steps=2, resume="auto")  # resumes in its constructor
    assert fresh.global_step == 2
    for a, b in zip(fresh.master.master, mw.master):
        assert torch.equal(a, b)
    # Adam state came back for every master that had one (the last block's text-stream adapters get no gradient)
    had = [(a, b) for a, b in zip(fresh.master.master, mw.master) if b in trainer.optimizer.state]
    assert len(had) >= len(mw.master) - 4
    for a, b in had:
        got, want = fresh.optimizer.state[a], trainer.optimizer.state[b]
        assert got["exp_avg"].dtype == torch.float32 and torch.equal(got["exp_avg_sq"], want["exp_avg_sq"])


def test_fp32_weights_compute_in_bf16_on_gpu_by_default_and_a_wider_param_dtype_is_refused():
    from types import SimpleNamespace

    import pytest

    from polyrl.distributed.dit_fsdp import compute_dtype
    from polyrl.errors import ConfigError

    fp32, bf16 = tiny.build_transformer(seed=0), tiny.build_transformer(seed=0).to(torch.bfloat16)
    ask = lambda dtype, compute="bfloat16": SimpleNamespace(  # noqa: E731
        mixed_precision={"param_dtype": dtype} if dtype else {}, dtype=compute)
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert compute_dtype(fp32, ask(None), cuda) == torch.bfloat16  # fsdp_config.dtype's default, as verl's
    assert compute_dtype(fp32, ask(None, compute="float32"), cuda) == torch.float32
    assert compute_dtype(fp32, ask(None), cpu) == torch.float32
    assert compute_dtype(bf16, ask(None, compute="float32"), cuda) == torch.bfloat16  # only fp32 weights default
    assert compute_dtype(fp32, ask("bf16"), cuda) == torch.bfloat16  # verl's full fine-tuning recipe
    assert compute_dtype(fp32, ask("bf16"), cpu) == torch.float32  # the CPU computes in the weights' dtype
    assert compute_dtype(bf16, ask("bfloat16"), cuda) == torch.bfloat16
    with pytest.raises(ConfigError, match=r"mixed_precision.param_dtype=fp32 is not a lower precision than the "
                                          r"transformer's bfloat16 weights; set actor_rollout_ref.model.dtype=float32"):
        compute_dtype(bf16, ask("fp32"), cuda)
    with pytest.raises(ConfigError, match="param_dtype=fp16 is not a lower precision"):
        compute_dtype(bf16, ask("fp16"), cuda)


def test_training_state_that_cannot_fit_the_gpu_is_refused_before_the_first_rollout(monkeypatch):
    import pytest

    from polyrl.errors import ConfigError
    from polyrl.learner import memory

    weights = torch.nn.Parameter(torch.zeros(1000))  # fp32: gradients + 2 AdamW moments = 12,000 bytes
    opt = torch.optim.AdamW([weights])
    cuda = torch.device("cuda")
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 3000)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 1000)  # 2,000 cached bytes are free too
    monkeypatch.setattr(memory, "device_memory", lambda device: (9000, 10**6))
    with pytest.raises(ConfigError, match=r"keeps their gradients and two AdamW moments, 0.0 GiB on each of the 2 GPUs"
                                          r".*train LoRA \(actor_rollout_ref.model.lora_rank=64\).*offload_policy=True"):
        memory.check_training_state_fits(opt, cuda, 2)
    memory.check_training_state_fits(opt, cuda, 2, offloaded=True)  # the state lives in host memory
    memory.check_training_state_fits(opt, torch.device("cpu"))  # host memory: nothing to check
    monkeypatch.setattr(memory, "device_memory", lambda device: (10000, 10**6))
    memory.check_training_state_fits(opt, cuda, 2)  # 10,000 + 2,000 free: fits exactly


def test_full_fine_tuning_of_fp32_weights_with_bf16_compute_in_one_process(tmp_path, monkeypatch):
    """What a GPU does by default (fsdp_config.dtype=bf16 over fp32 weights), forced on CPU: the module and the KL
    reference compute in bf16, the optimizer steps fp32 masters of every weight, and the run trains."""
    from polyrl.distributed import dit_fsdp

    monkeypatch.setattr(dit_fsdp, "compute_dtype", lambda module, cfg, device: torch.bfloat16)
    trainer = _trainer(tmp_path, steps=2, lora=False)
    policy = trainer.policy
    mw = trainer.master
    assert mw is not None and len(mw.master) == sum(1 for _ in policy.transformer.parameters())
    assert all(m.dtype == torch.float32 for m in mw.master)
    assert {p.dtype for p in policy.transformer.parameters()} == {torch.bfloat16} and policy.dtype == torch.bfloat16
    assert {p.dtype for p in policy._ref_copy.parameters()} == {torch.bfloat16}
    start = [m.detach().clone() for m in mw.master]
    history = trainer.fit()
    assert len(history["train"]) == 2 and all(torch.isfinite(torch.tensor(history["train"])))
    assert max(float((m.detach() - s).abs().max()) for m, s in zip(mw.master, start)) > 1e-4
    for p, m in zip(mw.compute, mw.master):  # the module holds the fp32 masters rounded to bf16
        assert torch.equal(p, m.detach().to(torch.bfloat16))
