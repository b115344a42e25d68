"""Memory-aware defaults and out-of-memory handling on CPU (training/memory.py, trainer/oom.py, utils/oom_hook.py).

OOMs are injected with the POLYRL_INJECT_OOM test hook. Tolerance for "identical update": the retry only changes
the micro-batch split, which the SGD split-invariance test bounds at 1e-6 (test_trainer_on_cpu).
"""

import copy
import hashlib

import pytest
import torch

from polyrl.cli import main as cli_main
from polyrl.models.loader import load_causal_lm
from polyrl.rollout.base import SamplingParams
from polyrl.trainer.config import PPOConfig
from polyrl.trainer.oom import OOMGuard, OutOfMemoryStop, StageContext
from polyrl.learner import memory
from polyrl.learner.actor import compute_logprobs
from polyrl.utils.oom_hook import INJECT_ENV, oom_point

from test_flow_pipeline_on_cpu import pipe_dir  # noqa: F401 (fixture)
from test_trainer_on_cpu import _actor, _batch, _settings

GiB = 2**30
QWEN_1_5B = memory.ModelShape(hidden=1536, intermediate=8960, num_layers=28, vocab=151936,
                              kv_bytes_per_token=28 * 2 * 2 * 128 * 2, num_params=1_543_714_304,
                              num_trainable=1_543_714_304, param_bytes=4)


def _choose(free_gib, **kw):
    args = dict(device=torch.device("cuda"), free=int(free_gib * GiB), total=int(80 * GiB), max_seq_len=1152,
                num_rollout_rows=256, engine_on_device=True, extra_static=0, world_size=1, compile_layers=None,
                checkpointing=None)
    args.update(kw)
    return memory.choose(QWEN_1_5B, **args)


def test_auto_choices_follow_free_memory(monkeypatch):
    roomy = _choose(74)  # an H100 with the 1.5B policy loaded
    assert roomy["compile"].value is True and roomy["checkpointing"].value is False
    assert 16384 <= roomy["update_tokens"].value <= memory.MAX_UPDATE_TOKENS
    tight = _choose(30)  # the same with another job's 44 GiB on the device
    assert tight["checkpointing"].value is True
    assert 1152 <= tight["update_tokens"].value < roomy["update_tokens"].value
    # the engine gets its KV for 256 rows, not half the device; and never more than is left beside the trainer
    assert roomy["engine"].value < 0.3 and tight["engine"].value < roomy["engine"].value
    cpu = _choose(8, device=torch.device("cpu"), engine_on_device=False)
    assert cpu["compile"].value is False and "engine" not in cpu
    # several processes cannot retry an OOM: they plan with a margin
    margin = _choose(50, world_size=2)["update_tokens"].value
    monkeypatch.setattr(memory, "MULTI_PROCESS_SAFETY", 1.0)
    none = _choose(50, world_size=2)["update_tokens"].value
    assert margin <= 0.76 * none + 1024 and margin < none
    # explicit user values are not choices
    assert set(_choose(74, compile_layers=False, checkpointing=True)) == {"update_tokens", "logprob_tokens", "engine",
                                                                           "free_cache", "seats"}


def test_long_sequences_train_without_checkpointing_when_one_whole_sequence_fits():
    """Seed 002's shape (28,672-token context, 2 H200s, 64 rollout rows per GPU): one sequence per micro-batch is
    already a large GEMM batch, so checkpointing (a re-run of every layer) stays off while one fits; it goes on
    when not even one does."""
    args = dict(total=int(140 * GiB), max_seq_len=28672, num_rollout_rows=64, world_size=2)
    long = _choose(129.6, **args)
    assert long["checkpointing"].value is False, long["checkpointing"].reason
    assert 28672 <= long["update_tokens"].value <= memory.MAX_UPDATE_TOKENS
    assert _choose(40, **args)["checkpointing"].value is True  # not even one whole sequence fits without it
    assert _choose(74)["checkpointing"].value is False  # short sequences: unchanged


SMOLLM2_135M = memory.ModelShape(hidden=576, intermediate=1536, num_layers=30, vocab=49152,
                                 kv_bytes_per_token=30 * 2 * 3 * 64 * 2, num_params=134_515_008,
                                 num_trainable=134_515_008, param_bytes=4)


def test_compile_only_where_the_update_is_big_enough_to_repay_a_cold_compile():
    h100 = 989e12
    small = memory.compile_choice(SMOLLM2_135M, cuda=True, tokens_per_step=256 * 160, peak_flops=h100)
    assert small.value is False and "cold compile" in small.reason  # ~0.1 s of update per step
    big = memory.compile_choice(QWEN_1_5B, cuda=True, tokens_per_step=256 * 1152, peak_flops=h100)
    assert big.value is True and "s of update compute per step" in big.reason
    assert memory.compile_choice(SMOLLM2_135M, cuda=True, tokens_per_step=256, peak_flops=0.0).value is True  # unknown
    assert memory.compile_choice(QWEN_1_5B, cuda=False, tokens_per_step=10**6, peak_flops=h100).value is False


def test_the_engine_keeps_its_kv_cache_only_where_it_fits_beside_the_update():
    big = _choose(74)  # 1.5B: the update budget takes the spare memory, so the cache goes while training
    assert big["free_cache"].value is True and "do not fit together" in big["free_cache"].reason
    small = memory.choose(SMOLLM2_135M, device=torch.device("cuda"), free=78 * GiB, total=80 * GiB, max_seq_len=160,
                          num_rollout_rows=256, engine_on_device=True, extra_static=0, world_size=1,
                          compile_layers=None, checkpointing=None, peak_flops=989e12)
    assert small["free_cache"].value is False and "the cache stays" in small["free_cache"].reason
    assert small["compile"].value is False


def _cfg(**actor):
    cfg = PPOConfig()
    cfg.data.max_prompt_length, cfg.data.max_response_length = 16, 8
    for k, v in actor.items():
        setattr(cfg.actor_rollout_ref.actor, k, v)
    return cfg


def test_plan_memory_fills_auto_keys_logs_each_once_and_keeps_user_values(tiny_model_dir, monkeypatch):
    monkeypatch.setattr(memory, "device_memory", lambda device: (4 * GiB, 8 * GiB))
    model = load_causal_lm(str(tiny_model_dir))
    cfg, lines = _cfg(ppo_max_token_len_per_gpu=999, use_kl_loss=True), []
    memory.plan_memory(cfg, model, torch.device("cpu"), log=lines.append)
    arr = cfg.actor_rollout_ref
    assert arr.actor.ppo_max_token_len_per_gpu == 999 and not any("ppo_max_token_len" in s for s in lines)
    assert arr.actor.use_dynamic_bsz is True and arr.actor.use_torch_compile is False
    assert arr.model.enable_gradient_checkpointing is False
    assert arr.rollout.free_cache_engine is True  # no engine memory of its own on CPU: nothing to keep
    assert arr.rollout.log_prob_max_token_len_per_gpu >= 24 and arr.ref.log_prob_max_token_len_per_gpu >= 24
    for key in ("use_torch_compile=False", "enable_gradient_checkpointing=False",
                "rollout.log_prob_max_token_len_per_gpu=", "ref.log_prob_max_token_len_per_gpu="):
        assert sum(key in s for s in lines) == 1, (key, lines)
    assert all(s.startswith("polyrl: auto ") and "(" in s for s in lines)  # each with its reason
    # almost no memory: checkpointing goes on (on the model too) and the budget drops to one sequence
    head = 2048 * model.config.vocab_size * 8  # the LM head's chunk workspace, then room for ~20 tokens
    monkeypatch.setattr(memory, "device_memory", lambda device: (int(memory.HEADROOM * GiB) + head + 20 * 768, GiB))
    cfg = _cfg()
    memory.plan_memory(cfg, model, torch.device("cpu"), log=lines.append)
    assert cfg.actor_rollout_ref.model.enable_gradient_checkpointing is True and model.is_gradient_checkpointing
    assert cfg.actor_rollout_ref.actor.ppo_max_token_len_per_gpu == 24


def _update_with_guard(base, batch, cfg, logs):
    model = copy.deepcopy(base)
    actor = _actor(model, sgd=True)
    a = cfg.actor_rollout_ref.actor
    guard = OOMGuard(cfg, optimizers=[actor.optimizer], log=logs.append)
    ctx = StageContext(batch, 8, model=model, progress=lambda: actor.mini_batches_applied)  # as ppo.py
    guard.run("update_actor", lambda: actor.update(batch, _settings(
        mini_batch_size=a.ppo_mini_batch_size, max_token_len=a.ppo_max_token_len_per_gpu,
        skip_mini_batches=ctx.done)), ctx=ctx)
    return torch.cat([p.detach().flatten() for p in model.parameters()]), guard


def test_injected_oom_in_update_retries_with_half_the_budget_and_gives_the_same_update(tiny_model_dir, monkeypatch):
    base = load_causal_lm(str(tiny_model_dir))
    batch = _batch(tiny_model_dir)
    batch["old_log_probs"] = compute_logprobs(base, batch, temperature=1.0, micro_batch_size=8) + 0.05
    batch["ref_log_probs"] = batch["old_log_probs"] - 0.1
    logs = []
    plain, _ = _update_with_guard(base, batch, _cfg(use_dynamic_bsz=True, ppo_max_token_len_per_gpu=64,
                                                    ppo_mini_batch_size=8), logs)
    monkeypatch.setenv(INJECT_ENV, "update_actor:1:3")  # the second micro-batch's forward, after one backward
    cfg = _cfg(use_dynamic_bsz=True, ppo_max_token_len_per_gpu=64, ppo_mini_batch_size=8)
    retried, guard = _update_with_guard(base, batch, cfg, logs)
    assert guard.num_retries == 1 and cfg.actor_rollout_ref.actor.ppo_max_token_len_per_gpu == 32
    assert len(logs) == 1 and "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=32" in logs[0]
    assert (plain - torch.cat([p.detach().flatten() for p in base.parameters()])).abs().max() > 1e-4
    torch.testing.assert_close(retried, plain, rtol=0, atol=1e-6)
    # two mini-batches (two optimizer steps): an OOM in the second resumes there, the first is not applied twice
    monkeypatch.delenv(INJECT_ENV)
    plain, _ = _update_with_guard(base, batch, _cfg(use_dynamic_bsz=True, ppo_max_token_len_per_gpu=512,
                                                    ppo_mini_batch_size=4), logs)
    monkeypatch.setenv(INJECT_ENV, "update_actor:1:3")  # the second mini-batch's forward
    retried, guard = _update_with_guard(base, batch, _cfg(use_dynamic_bsz=True, ppo_max_token_len_per_gpu=512,
                                                          ppo_mini_batch_size=4), logs)
    assert guard.num_retries == 1
    torch.testing.assert_close(retried, plain, rtol=0, atol=1e-6)
    # under several processes the other ranks would wait in a collective: stop with one sentence and the key to set
    monkeypatch.setenv(INJECT_ENV, "ref")
    cfg = _cfg()
    ref = cfg.actor_rollout_ref.ref
    ref.log_prob_use_dynamic_bsz, ref.log_prob_max_token_len_per_gpu = True, 96
    with pytest.raises(OutOfMemoryStop, match=r"several processes.*ref.log_prob_max_token_len_per_gpu=48 "):
        OOMGuard(cfg, distributed=True).run("ref", lambda: None, ctx=StageContext(batch))


def test_injected_oom_in_rollout_halves_the_kv_cache_and_samples_the_same(monkeypatch):
    from test_native_rollout_on_cpu import _prompts, _tiny

    from polyrl.rollout.native import NativeEngine

    torch.set_num_threads(1)
    eng = NativeEngine.from_hf(_tiny(), dtype=torch.float32, num_kv_tokens=1024)
    cfg = PPOConfig()
    r = cfg.actor_rollout_ref.rollout
    r.n, r.response_length, r.gpu_memory_utilization = 2, 6, 0.5
    cfg.data.max_prompt_length = 10
    guard = OOMGuard(cfg, log=lambda s: None)
    sp = SamplingParams(n=2, temperature=1.0, max_new_tokens=6)

    def gen():
        eng.resume()
        out = eng.generate(_prompts([4, 9]), sp)
        oom_point()  # point 2: an OOM after the engine used up this call's seed
        return out

    blocks = eng.num_blocks
    first = guard.run("gen", gen, ctx=StageContext(engine=eng))
    eng.num_calls -= 1  # the same call again
    monkeypatch.setenv(INJECT_ENV, "gen:1:2")
    again = guard.run("gen", gen, ctx=StageContext(engine=eng))
    assert guard.num_retries == 1 and eng.num_blocks == blocks // 2 and r.gpu_memory_utilization < 0.5
    assert again.token_ids == first.token_ids and eng.num_calls == 1  # rewound, then used once


def _train(model_dir, data_dir, tmp_path, *extra):
    return cli_main([
        "train", "algorithm.adv_estimator=grpo", f"data.train_files={data_dir / 'train.parquet'}",
        "data.train_batch_size=2", "data.max_prompt_length=32", "data.max_response_length=4",
        f"actor_rollout_ref.model.path={model_dir}", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        "actor_rollout_ref.rollout.name=hf", "actor_rollout_ref.rollout.n=2", "trainer.logger=[console]",
        f"trainer.run_dir={tmp_path / 'run'}", f"trainer.default_local_dir={tmp_path / 'ckpt'}",
        "trainer.progress_bar=False", "trainer.val_before_train=False", *extra])


def test_repeated_oom_stops_with_one_sentence_exit_2_and_checkpoints_intact(tiny_model_dir, synth_data_dir, tmp_path,
                                                                            monkeypatch, capsys):
    assert _train(tiny_model_dir, synth_data_dir, tmp_path, "trainer.total_training_steps=1") == 0
    out = capsys.readouterr().out
    for key in ("actor.ppo_max_token_len_per_gpu=", "model.enable_gradient_checkpointing=",
                "actor.use_torch_compile=False", "rollout.log_prob_max_token_len_per_gpu="):
        assert out.count(f"polyrl: auto actor_rollout_ref.{key}") == 1, key  # each auto choice logged once
    ckpt = tmp_path / "ckpt"
    weights = ckpt / "global_step_1" / "model.safetensors"
    digest = hashlib.sha256(weights.read_bytes()).hexdigest()

    monkeypatch.setenv(INJECT_ENV, "update_actor:*")  # every attempt of the update fails
    assert _train(tiny_model_dir, synth_data_dir, tmp_path, "trainer.total_training_steps=2") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("polyrl: error: The update_actor stage ran out of GPU memory")
    assert err[-1].count(". ") == 0 and "data.max_response_length=2" in err[-1]  # one sentence, key and value
    warnings = [s for s in err if "retrying with actor_rollout_ref.actor.ppo_max_token_len_per_gpu" in s]
    assert len(warnings) == 1  # warned once, although the budget was halved several times
    assert any("retrying with actor_rollout_ref.model.enable_gradient_checkpointing=True" in s for s in err)
    assert not any("Traceback" in s for s in err)
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "1"
    assert not (ckpt / "global_step_2").exists()
    assert hashlib.sha256(weights.read_bytes()).hexdigest() == digest


def _flow_step(pipe_dir, logs):
    from test_flow_pipeline_on_cpu import _config, brightness

    from polyrl.models.diffusion.pipeline import load_pipeline_policy
    from polyrl.trainer.flow_grpo import FlowGRPOTrainer

    torch.manual_seed(0)
    cfg = _config(1.0, True, False)
    p = cfg.actor_rollout_ref.rollout.pipeline
    policy = load_pipeline_policy(pipe_dir, height=p.height, width=p.width, max_sequence_length=p.max_sequence_length)
    policy.add_lora(4, 8, cfg.actor_rollout_ref.model.target_modules)
    prompts = [('a sign that reads "hi"', {}), ('a card that reads "ok"', {})]
    trainer = FlowGRPOTrainer(cfg, policy, brightness, prompts, prompts[:1])
    trainer.oom.log = logs.append
    trainer.step()
    return torch.cat([p.detach().flatten() for p in policy.trainable_parameters()]), trainer


def test_flow_update_oom_turns_checkpointing_on_and_gives_the_same_update(pipe_dir, monkeypatch):
    logs = []
    plain, trainer = _flow_step(pipe_dir, logs)
    assert trainer.cfg.actor_rollout_ref.model.enable_gradient_checkpointing is False and not logs  # auto: off
    monkeypatch.setenv(INJECT_ENV, "update_actor")
    retried, trainer = _flow_step(pipe_dir, logs)
    assert trainer.oom.num_retries == 1 and trainer.policy.transformer.gradient_checkpointing
    assert len(logs) == 1 and "actor_rollout_ref.model.enable_gradient_checkpointing=True" in logs[0]
    torch.testing.assert_close(retried, plain, rtol=0, atol=1e-6)


def test_first_update_calibration_lowers_an_auto_budget_that_the_next_step_would_not_fit():
    total, base, growth = 80 * GiB, 8 * GiB, 11 * GiB  # Adam's moments of a 1.5B fp32 policy appear after update 1
    assert memory.calibrated_budget(20480, base=base, peak=64 * GiB, growth=growth, total=total, floor=4224) is None
    new = memory.calibrated_budget(20480, base=base, peak=68 * GiB, growth=growth, total=total, floor=4224)
    per_token = (68 - 8) * GiB / 20480
    assert 4224 <= new < 20480 and new % 1024 == 0
    assert base + growth + per_token * new <= 0.95 * total < base + growth + per_token * (new + 1024)
    # never below one whole sequence, never above the budget it measured
    assert memory.calibrated_budget(20480, base=base, peak=79 * GiB, growth=70 * GiB, total=total, floor=4224) == 4224

    cfg, lines = PPOConfig(), []
    cfg.data.max_prompt_length, cfg.data.max_response_length = 128, 4096
    cfg.actor_rollout_ref.actor.ppo_max_token_len_per_gpu = 20480
    cal = memory.FirstUpdateCalibration(cfg, torch.device("cpu"), optimizer=None, dist=None, log=lines.append)
    assert not cal.pending  # measured on CUDA only
    assert cal.apply(base=base, peak=68 * GiB, growth=growth, total=total) == new
    assert cfg.actor_rollout_ref.actor.ppo_max_token_len_per_gpu == new
    assert len(lines) == 1
    assert lines[0].startswith(f"polyrl: auto actor_rollout_ref.actor.ppo_max_token_len_per_gpu={new} (")


def test_optimizer_state_bytes_counts_the_moments_adam_creates_at_its_first_step():
    p = torch.nn.Parameter(torch.zeros(10, 10))
    opt = torch.optim.AdamW([p])
    assert memory.optimizer_state_bytes(opt) == 0
    p.grad = torch.ones_like(p)
    opt.step()
    assert memory.optimizer_state_bytes(opt) == 0  # CPU tensors are not device memory
    if torch.cuda.is_available():
        q = torch.nn.Parameter(torch.zeros(10, 10, device="cuda"))
        opt = torch.optim.AdamW([q])
        q.grad = torch.ones_like(q)
        opt.step()
        assert memory.optimizer_state_bytes(opt) == 2 * 100 * 4


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_first_update_calibration_measures_the_peak_and_the_optimizer_state_on_cuda(monkeypatch):
    cfg = PPOConfig()
    cfg.actor_rollout_ref.actor.ppo_max_token_len_per_gpu = 8192
    q = torch.nn.Parameter(torch.zeros(1024, 1024, device="cuda"))
    opt = torch.optim.AdamW([q])
    cal = memory.FirstUpdateCalibration(cfg, torch.device("cuda"), opt, dist=None)
    calls = []
    monkeypatch.setattr(cal, "apply", lambda **kw: calls.append(kw))
    with cal.around_update():
        transient = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")  # 256 MiB of "activations"
        q.grad = torch.ones_like(q)
        del transient
        opt.step()
    (seen,) = calls
    assert seen["peak"] - seen["base"] >= 256 * 2**20
    assert seen["growth"] == 2 * 1024 * 1024 * 4 and seen["total"] > 2**30
    with cal.around_update():  # only the first update is measured
        pass
    assert len(calls) == 1


def test_an_update_that_runs_out_of_memory_first_lets_a_kept_kv_cache_go():
    from polyrl.trainer.oom import shrink_update

    class Engine:
        released = 0

        def release_memory(self):
            self.released += 1

    cfg, engine = PPOConfig(), Engine()
    cfg.actor_rollout_ref.rollout.free_cache_engine = False  # as memory.py chooses for a small model
    cfg.actor_rollout_ref.actor.use_dynamic_bsz, cfg.actor_rollout_ref.actor.ppo_max_token_len_per_gpu = True, 8192
    first = shrink_update(cfg, StageContext(engine=engine))
    assert (first.key, first.old, first.new) == ("actor_rollout_ref.rollout.free_cache_engine", False, True)
    assert engine.released == 1 and cfg.actor_rollout_ref.rollout.free_cache_engine is True
    second = shrink_update(cfg, StageContext(engine=engine))  # then the token budget, as before
    assert second.key == "actor_rollout_ref.actor.ppo_max_token_len_per_gpu" and second.new == 4096
    assert engine.released == 1


def test_auto_seats_decode_every_row_of_a_call_at_once_where_the_cache_holds_them():
    """512 rows on one GPU (the off-policy rollout) get 512 seats instead of two waves at verl's 256; a cache too
    small for them at full length keeps fewer seats, never below 256; more than 1024 rows stop at 1024."""
    assert _choose(74, num_rollout_rows=512)["seats"].value == 512
    assert _choose(74, num_rollout_rows=64)["seats"].value == 256
    assert _choose(74, num_rollout_rows=4096)["seats"].value == 1024
    squeezed = _choose(74, num_rollout_rows=1024, max_seq_len=32768)["seats"].value
    assert 256 <= squeezed < 1024


def test_one_gpu_fp8_rollout_is_planned_at_its_fp8_weight_bytes(tiny_model_dir, monkeypatch):
    """TP 1 with rollout.quantization=fp8: the engine holds e4m3 layer weights, not a bf16 replica (the planner once
    counted the bf16 replica there)."""
    seen = []

    class Stop(Exception):
        pass

    def spy(shape, **kw):
        seen.append((shape, kw["engine_bytes"]))
        raise Stop

    monkeypatch.setattr(memory, "device_memory", lambda device: (4 * GiB, 8 * GiB))
    monkeypatch.setattr(memory, "choose", spy)
    model = load_causal_lm(str(tiny_model_dir))
    for quant in (None, "fp8"):
        cfg = _cfg()
        cfg.actor_rollout_ref.rollout.quantization = quant
        with pytest.raises(Stop):
            memory.plan_memory(cfg, model, torch.device("cpu"), log=lambda s: None)
    (shape, bf16), (_, fp8) = seen
    tied = bool(model.config.tie_word_embeddings)
    assert bf16 is None  # choose() counts a bf16 replica
    assert fp8 == memory.engine_weight_bytes(shape, 1, fp8=True, tied=tied) < shape.num_params * 2
