"""Rollout correction (verl's algorithm.rollout_correction.*) against hand-computed numbers, refusals, and the trainer.

Shared example, one row of three tokens: trainer log-probs old = [-1, -2, -0.5], rollout [-1.5, -2, -0.2], so the
log-ratio lr = old - rollout = [0.5, 0, -0.3] and the token ratios are [e^.5, 1, e^-.3] = [1.648721, 1, 0.740818].
"""

import json
import math

import pytest
import torch

from polyrl.algorithms import LossKnobs, policy_loss
from polyrl.algorithms.rollout_correction import RolloutCorrectionConfig as RC
from polyrl.algorithms.rollout_correction import compute_rollout_correction
from polyrl.errors import ConfigError

T = torch.tensor
OLD = T([[-1.0, -2.0, -0.5]])
ROLL = T([[-1.5, -2.0, -0.2]])
MASK = T([[1.0, 1.0, 1.0]])


def close(actual, expected, atol=1e-5):
    torch.testing.assert_close(torch.as_tensor(actual).float(), torch.as_tensor(expected).float(), atol=atol, rtol=0)


def test_token_tis_truncates_at_the_threshold():
    w, keep, m = compute_rollout_correction(OLD, ROLL, MASK, RC(rollout_is="token", rollout_is_threshold=1.5))
    close(w, [[1.5, 1.0, 0.740818]])  # e^.5 = 1.6487 truncated to 1.5
    close(keep, MASK)  # no rejection asked for
    close(m["rollout_corr/rollout_is_mean"], (1.5 + 1 + 0.740818) / 3)
    close(m["rollout_corr/rollout_is_max"], 1.5)
    close(m["rollout_corr/rollout_is_min"], 0.740818)
    close(m["rollout_corr/rollout_is_ratio_fraction_high"], 1 / 3)  # raw 1.6487 > 1.5
    close(m["rollout_corr/rollout_is_ratio_fraction_low"], 0.0)  # nothing below 1/1.5


def test_sequence_is_is_the_product_of_the_token_ratios_and_skips_padding():
    # row 0: sum lr = .2 -> e^.2 = 1.221403 on every token; row 1: lr [1, pad]: e^1 = 2.718 truncated at 2, pad 0
    old = torch.cat([OLD, T([[0.0, -5.0, 0.0]])])
    roll = torch.cat([ROLL, T([[-1.0, -1.0, 0.0]])])
    mask = torch.cat([MASK, T([[1.0, 0.0, 0.0]])])
    w, _, m = compute_rollout_correction(old, roll, mask, RC(rollout_is="sequence"))
    close(w, [[1.221403] * 3, [2.0, 0.0, 0.0]])
    close(m["rollout_corr/rollout_is_seq_mean"], (1.221403 + 2.0) / 2)
    assert not w.requires_grad


def test_icepop_band_zeroes_weights_outside_it_and_batch_normalize():
    w, _, m = compute_rollout_correction(OLD, ROLL, MASK, RC(rollout_is="token", rollout_is_threshold="0.8_1.2"))
    close(w, [[0.0, 1.0, 0.0]])  # 1.6487 > 1.2 and 0.7408 < 0.8
    close(m["rollout_corr/rollout_is_oob_ratio"], 2 / 3)
    w, _, m = compute_rollout_correction(OLD, ROLL, MASK, RC(rollout_is="token", rollout_is_threshold=1.5,
                                                             rollout_is_batch_normalize=True))
    close(m["rollout_corr/rollout_is_batch_norm_factor"], 1.080273)  # (1.5 + 1 + .740818) / 3
    close(w.mean(), 1.0)


@pytest.mark.parametrize("option, threshold, keep", [
    ("token_k1", 1.5, [0.0, 1.0, 1.0]),  # k1 = -lr = [-.5, 0, .3] inside [ln(1/1.5), ln 1.5] = [-.405, .405]?
    ("token_k1", "0.5_1.5", [1.0, 1.0, 1.0]),  # [ln .5, ln 1.5] = [-.693, .405]: all inside
    ("token_k2", 0.1, [0.0, 1.0, 1.0]),  # k2 = lr^2/2 = [.125, 0, .045]
    ("token_k3", 0.05, [0.0, 1.0, 1.0]),  # k3 = e^lr - 1 - lr = [.148721, 0, .040818]
    ("seq_mean_k2", 0.05, [0.0, 0.0, 0.0]),  # mean k2 = .056667 > .05: the whole row goes
    ("seq_mean_k2", 0.06, [1.0, 1.0, 1.0]),
    ("seq_sum_k3", 0.19, [1.0, 1.0, 1.0]),  # sum k3 = .189539
    ("seq_max_k3", 0.1, [0.0, 0.0, 0.0]),  # max k3 = .148721
    ("binary_kl", 0.12, [1.0, 1.0, 0.0]),  # token 3: max(KL(.6065||.8187), KL(.8187||.6065)) = .122987
    ("token_k2,token_k3", "1.0,0.03", [0.0, 1.0, 0.0]),  # one threshold per option; every option must pass
])
def test_rejection_masks(option, threshold, keep):
    _, mask, m = compute_rollout_correction(OLD, ROLL, MASK, RC(rollout_rs=option, rollout_rs_threshold=threshold))
    close(mask, [keep])
    close(m["rollout_corr/rollout_rs_masked_fraction"], 1 - sum(keep) / 3)
    close(m["rollout_corr/rollout_rs_seq_masked_fraction"], float(sum(keep) < 3))


def test_rejection_statistic_metrics():
    _, _, m = compute_rollout_correction(OLD, ROLL, MASK, RC(rollout_rs="token_k3", rollout_rs_threshold=1.0))
    close(m["rollout_corr/rollout_rs_token_k3_mean"], (0.148721 + 0.040818) / 3)
    close(m["rollout_corr/rollout_rs_token_k3_max"], 0.148721)
    close(m["rollout_corr/rollout_rs_token_k3_min"], 0.0)


def test_offpolicy_metrics_kl_perplexity_chi2():
    _, _, m = compute_rollout_correction(OLD, ROLL, MASK, RC(rollout_is="token"))
    close(m["rollout_corr/kl"], -0.2 / 3)  # mean(rollout - old) = mean(-.5, 0, .3)
    close(m["rollout_corr/k3_kl"], (0.148721 + 0.040818) / 3)
    close(m["rollout_corr/training_ppl"], math.exp(3.5 / 3))  # exp(-mean old)
    close(m["rollout_corr/rollout_ppl"], math.exp(3.7 / 3), atol=1e-4)
    close(m["rollout_corr/log_ppl_diff"], -0.2 / 3)  # mean rollout - mean old = log(training ppl / rollout ppl)
    close(m["rollout_corr/ppl_ratio"], math.exp(-0.2 / 3))
    close(m["rollout_corr/chi2_token"], (math.e + 1 + math.exp(-0.6)) / 3 - 1)  # E[rho^2] - 1
    close(m["rollout_corr/chi2_seq"], math.exp(0.4) - 1)  # (prod rho)^2 - 1


def test_is_weights_multiply_the_vanilla_loss():
    # on-policy (ratio 1), A = [1, -1]: per-token losses [-1, 1]; weights [2, .5] -> token-mean (-2 + .5)/2 = -.75
    logp = T([[-1.0, -1.0]], requires_grad=True)
    loss, _ = policy_loss("vanilla", old_log_prob_BT=logp.detach(), log_prob_BT=logp, advantages_BT=T([[1.0, -1.0]]),
                          response_mask_BT=T([[1.0, 1.0]]), loss_agg_mode="token-mean", cfg=LossKnobs(),
                          rollout_is_weights_BT=T([[2.0, 0.5]]))
    close(loss, -0.75)
    (grad,) = torch.autograd.grad(loss, logp)
    close(grad, [[-1.0, 0.25]])  # -A * w / 2


@pytest.mark.parametrize("cfg, words", [
    (RC(rollout_is="tok"), "rollout_is='tok'"),
    (RC(rollout_is="token", rollout_is_threshold="abc"), "rollout_is_threshold='abc'"),
    (RC(rollout_is="token", rollout_is_threshold="2_1"), "lower bound exceeds"),
    (RC(rollout_is="token", rollout_is_threshold=-1.0), "must be positive"),
    (RC(rollout_rs="token_k9", rollout_rs_threshold=1.0), "unknown option 'token_k9'"),
    (RC(rollout_rs="token_k3"), "rollout_rs_threshold is null"),
    (RC(rollout_rs="token_k3,seq_max_k2", rollout_rs_threshold="1,2,3"), "3 values for 2"),
    (RC(rollout_rs="token_k1", rollout_rs_threshold=0.5), "keep nothing"),
    (RC(rollout_rs="token_k2", rollout_rs_threshold="0.1_2"), "one upper bound"),
    (RC(loss_type="reinforce"), "bypass mode only"),
    (RC(bypass_mode=True, loss_type="pg"), "loss_type='pg'"),
])
def test_bad_values_are_refused_with_one_sentence(cfg, words):
    with pytest.raises(ConfigError, match="algorithm.rollout_correction") as e:
        compute_rollout_correction(OLD, ROLL, MASK, cfg)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_rollout_correction_keys_reach_the_trainer(tiny_model_dir, synth_data_dir, tmp_path):
    """Decoupled token-TIS + token_k3 rejection, then bypass REINFORCE: both run a step and log rollout_corr/*."""
    from test_trainer_on_cpu import _train_args

    from polyrl.cli import main as cli_main

    rc = "algorithm.rollout_correction"
    for name, keys in {
        "decoupled": [f"{rc}.rollout_is=token", f"{rc}.rollout_rs=token_k3", f"{rc}.rollout_rs_threshold=1.0"],
        "bypass": [f"{rc}.bypass_mode=True", f"{rc}.loss_type=reinforce", f"{rc}.rollout_is=sequence"],
    }.items():
        run = tmp_path / name
        run.mkdir()
        assert cli_main(_train_args(tiny_model_dir, synth_data_dir, run, *keys, "trainer.total_training_steps=1")) == 0
        rows = [json.loads(x) for x in (run / "run" / "metrics.jsonl").read_text().splitlines()]
        train = [r for r in rows if "actor/pg_loss" in r]
        assert train and all(math.isfinite(r["actor/pg_loss"]) for r in train)
        assert "rollout_corr/rollout_is_mean" in train[-1] and "rollout_corr/kl" in train[-1]
        assert ("timing_s/old_log_prob" in train[-1]) == (name == "decoupled")  # bypass skips the pass


def test_sum_pi_squared_matches_the_full_logits(tiny_model_dir):
    """The OTB estimators' sum_v pi_v^2 per response position, against the model's own forward (another code path)."""
    from test_trainer_on_cpu import _batch

    from polyrl.models.loader import load_causal_lm
    from polyrl.learner.actor import compute_sum_pi_squared

    model = load_causal_lm(str(tiny_model_dir))
    batch = _batch(tiny_model_dir)
    got = compute_sum_pi_squared(model, batch, temperature=0.7, micro_batch_size=3)
    T_len = batch["responses"].shape[1]
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                       position_ids=batch["position_ids"]).logits[:, -T_len - 1:-1]
    want = torch.softmax(logits.float() / 0.7, -1).square().sum(-1) * batch["response_mask"]
    close(got, want)
    assert float(got.max()) <= 1.0 and float(got[batch["response_mask"] > 0].min()) > 0
