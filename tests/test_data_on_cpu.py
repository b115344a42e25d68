import json
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from polyrl.data import DataConfig, PromptSampler, load_rl_dataset, load_sft_dataset, make_rows, write_parquet
from polyrl.data.cli import main as data_main
from polyrl.data.gsm8k import INSTRUCTION, convert_jsonl
from polyrl.data.synthetic import TASKS, is_heldout
from polyrl.errors import DataError
from polyrl.models.tiny import build_char_tokenizer


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def _row(prompt, gt="1", source="polyrl/addition", **kw):
    return {"data_source": source, "prompt": prompt, "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": gt}, "extra_info": {"index": 0}, **kw}


def _write(tmp_path, rows, name="d.parquet"):
    return str(write_parquet(rows, tmp_path / name))


def _cfg(**kw):
    return DataConfig(**kw)


# ------------------------------------------------------------------------------------------------ schema + template


def test_chat_template_applied_at_load_and_fields_kept(tmp_path, tok):
    path = _write(tmp_path, [_row([{"role": "user", "content": "12+3="}], gt="15")])
    (s,) = load_rl_dataset(path, tok, _cfg())
    assert tok.decode(s.prompt_ids) == "<|im_start|>user\n12+3=<|im_end|>\n<|im_start|>assistant\n"
    assert s.raw_prompt == [{"role": "user", "content": "12+3="}]
    assert (s.data_source, s.ground_truth, s.ability, s.index) == ("polyrl/addition", "15", "math", 0)
    assert s.extra_info == {"index": 0}


def test_plain_string_prompt_is_wrapped_as_user_turn(tmp_path, tok):
    path = _write(tmp_path, [_row("hi")])
    (s,) = load_rl_dataset(path, tok, _cfg())
    assert s.raw_prompt == [{"role": "user", "content": "hi"}]


def test_multiple_files_concatenate_with_global_index(tmp_path, tok):
    a = _write(tmp_path, [_row("a"), _row("b")], "a.parquet")
    b = _write(tmp_path, [_row("c")], "b.parquet")
    samples = load_rl_dataset([a, b], tok, _cfg())
    assert [s.raw_prompt[0]["content"] for s in samples] == ["a", "b", "c"]
    assert [s.index for s in samples] == [0, 1, 2]


def test_apply_chat_template_kwargs_reach_the_template(tmp_path):
    from polyrl.models.tiny import CHAT_TEMPLATE

    tok = build_char_tokenizer(CHAT_TEMPLATE + "{% if suffix %}{{ suffix }}{% endif %}")
    path = _write(tmp_path, [_row("q")])
    (s,) = load_rl_dataset(path, tok, _cfg(apply_chat_template_kwargs={"suffix": "<think>"}))
    assert tok.decode(s.prompt_ids).endswith("assistant\n<think>")


def test_custom_prompt_key_and_optional_columns(tmp_path, tok):
    path = _write(tmp_path, [{"data_source": "x", "question": "q", "reward_model": {"ground_truth": "1"}}])
    (s,) = load_rl_dataset(path, tok, _cfg(prompt_key="question"))
    assert s.raw_prompt[0]["content"] == "q" and s.ability is None and s.extra_info == {}


# ------------------------------------------------------------------------------------------------ length handling

LONG = "0123456789" * 3  # 30 chars; templated prompt = 30 + 19 tokens


def _long_path(tmp_path):
    return _write(tmp_path, [_row("ok"), _row(LONG)])


def test_overlong_prompt_with_truncation_error_names_row_length_limit_and_fixes(tmp_path, tok):
    with pytest.raises(DataError) as e:
        load_rl_dataset(_long_path(tmp_path), tok, _cfg(max_prompt_length=40))
    msg = str(e.value)
    assert "Row 1 of" in msg and "49 tokens" in msg and "max_prompt_length=40" in msg
    assert "filter_overlong_prompts=True" in msg and "truncation=left" in msg


def test_filter_overlong_prompts_drops_rows(tmp_path, tok):
    samples = load_rl_dataset(_long_path(tmp_path), tok, _cfg(max_prompt_length=40, filter_overlong_prompts=True))
    assert [s.raw_prompt[0]["content"] for s in samples] == ["ok"]
    assert samples[0].index == 0


def test_all_filtered_is_an_error(tmp_path, tok):
    path = _write(tmp_path, [_row(LONG)])
    with pytest.raises(DataError, match="filtered out"):
        load_rl_dataset(path, tok, _cfg(max_prompt_length=10, filter_overlong_prompts=True))


@pytest.mark.parametrize("mode", ["left", "right", "middle"])
def test_truncation_modes(tmp_path, tok, mode):
    path = _long_path(tmp_path)
    full = load_rl_dataset(path, tok, _cfg())[1].prompt_ids
    ids = load_rl_dataset(path, tok, _cfg(max_prompt_length=41, truncation=mode))[1].prompt_ids
    assert len(ids) == 41
    expected = {"left": full[-41:], "right": full[:41], "middle": full[:20] + full[-21:]}[mode]
    assert ids == expected
    if mode == "left":  # keeping the end keeps the generation prompt
        assert tok.decode(ids).endswith("<|im_start|>assistant\n")


# ------------------------------------------------------------------------------------------------ bad input


def test_missing_file(tmp_path, tok):
    with pytest.raises(DataError, match=r"'.*nope\.parquet' does not exist"):
        load_rl_dataset(str(tmp_path / "nope.parquet"), tok, _cfg())


def test_no_files(tok):
    with pytest.raises(DataError, match="data.train_files"):
        load_rl_dataset([], tok, _cfg())


def test_corrupt_parquet_names_file(tmp_path, tok):
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(b"PAR1 this is not parquet at all")
    with pytest.raises(DataError, match=r"'.*bad\.parquet' is not a readable parquet file"):
        load_rl_dataset(str(bad), tok, _cfg())


def test_truncated_parquet_names_file(tmp_path, tok):
    good = _write(tmp_path, [_row("x")] * 10, "good.parquet")
    data = open(good, "rb").read()
    cut = tmp_path / "cut.parquet"
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(DataError, match="cut.parquet"):
        load_rl_dataset(str(cut), tok, _cfg())


def test_missing_column_names_it_and_lists_present(tmp_path, tok):
    path = _write(tmp_path, [{"data_source": "x", "question": "q", "reward_model": {"ground_truth": "1"}}])
    with pytest.raises(DataError) as e:
        load_rl_dataset(path, tok, _cfg())
    msg = str(e.value)
    assert "no 'prompt' column" in msg and "data_source, question, reward_model" in msg and "data.prompt_key" in msg


def test_missing_reward_model_column(tmp_path, tok):
    path = _write(tmp_path, [{"data_source": "x", "prompt": "q"}])
    with pytest.raises(DataError, match="no 'reward_model' column"):
        load_rl_dataset(path, tok, _cfg())


def test_empty_dataset(tmp_path, tok):
    schema = pa.schema([("data_source", pa.string()), ("prompt", pa.string())])
    path = tmp_path / "empty.parquet"
    pq.write_table(pa.Table.from_pylist([], schema=schema), path)
    with pytest.raises(DataError, match=r"'.*empty\.parquet' hold no rows"):
        load_rl_dataset(str(path), tok, _cfg())


@pytest.mark.parametrize(
    "row, culprit",
    [
        (_row(5), "column 'prompt' must be a chat list"),
        (_row([{"role": "user"}]), "column 'prompt' must be a chat list"),
        ({"data_source": "x", "prompt": "q", "reward_model": "72"}, "column 'reward_model' must be a dict"),
        ({"data_source": 3, "prompt": "q", "reward_model": {"ground_truth": "1"}}, "column 'data_source' must be"),
        ({**_row("q"), "extra_info": [1, 2]}, "column 'extra_info' must be a dict"),
    ],
)
def test_wrong_value_types_name_row_and_column(tmp_path, tok, row, culprit):
    # a parquet column has one type, so the wrong type fills the whole file
    path = _write(tmp_path, [row, row])
    with pytest.raises(DataError) as e:
        load_rl_dataset(path, tok, _cfg())
    assert "Row 0 of" in str(e.value) and "d.parquet" in str(e.value) and culprit in str(e.value)


def test_tokenizer_without_chat_template_names_model_dir(tmp_path):
    tok = build_char_tokenizer(chat_template=None)
    tok.save_pretrained(tmp_path / "model")
    from transformers import AutoTokenizer

    loaded = AutoTokenizer.from_pretrained(tmp_path / "model")
    path = _write(tmp_path, [_row("x")])
    with pytest.raises(DataError) as e:
        load_rl_dataset(path, loaded, _cfg())
    assert str(tmp_path / "model") in str(e.value) and "chat template" in str(e.value) and "data.tokenizer" in str(e.value)


# ------------------------------------------------------------------------------------------------ sampler


def _ints(n):
    return list(range(n))


def test_sampler_is_deterministic_and_shuffles_per_epoch():
    a = PromptSampler(_ints(10), 3, shuffle=True, seed=7)
    b = PromptSampler(_ints(10), 3, shuffle=True, seed=7)
    ea1, ea2 = list(a), list(a)
    assert ea1 == list(b) and ea2 == list(b)
    assert len(ea1) == 3 and all(len(x) == 3 for x in ea1)  # drop_last: 10 // 3 batches
    assert ea1 != ea2  # a new order each epoch
    assert len(set(sum(ea1, []))) == 9  # no repeats inside an epoch
    assert list(PromptSampler(_ints(10), 3, seed=8)) != ea1
    assert list(PromptSampler(_ints(6), 3, shuffle=False)) == [[0, 1, 2], [3, 4, 5]]


def test_sampler_state_round_trip_resumes_exactly():
    ref = PromptSampler(_ints(11), 4, seed=3)
    expected = [ref.next_batch() for _ in range(7)]  # crosses two epoch boundaries (2 batches per epoch)
    s = PromptSampler(_ints(11), 4, seed=3)
    got = [s.next_batch() for _ in range(3)]
    state = json.loads(json.dumps(s.state_dict()))  # must survive a plain JSON checkpoint
    assert state["epoch"] == 1 and state["offset"] == 1
    resumed = PromptSampler(_ints(11), 4, seed=3)
    resumed.load_state_dict(state)
    got += [resumed.next_batch() for _ in range(4)]
    assert got == expected


def test_sampler_refuses_mismatched_state_and_batch_too_big():
    s = PromptSampler(_ints(8), 4, seed=3)
    with pytest.raises(DataError, match="batch_size=2"):
        PromptSampler(_ints(8), 2, seed=3).load_state_dict(s.state_dict())
    with pytest.raises(DataError, match="has 8 prompts but the batch size is 9"):
        PromptSampler(_ints(8), 9)


# ------------------------------------------------------------------------------------------------ synthetic + cli


@pytest.mark.parametrize("task", sorted(TASKS))
def test_synthetic_rows_schema_splits_and_scorer(task):
    train = make_rows(task, 300, seed=1, split="train")
    val = make_rows(task, 50, seed=2, split="val")
    tp = {r["prompt"][0]["content"] for r in train}
    vp = {r["prompt"][0]["content"] for r in val}
    assert len(tp) == 300 and len(vp) == 50 and not tp & vp
    assert all(is_heldout(p) for p in vp) and not any(is_heldout(p) for p in tp)
    r = train[0]
    assert r["data_source"] == TASKS[task].data_source and r["reward_model"]["style"] == "rule"
    assert len(r["prompt"][0]["content"]) <= (48 if task == "word_addition" else 16)  # word_addition: chat models
    assert make_rows(task, 20, seed=1) == train[:20]  # deterministic in the seed
    assert make_rows(task, 20, seed=3) != train[:20]
    assert TASKS[task].score(" " + r["reward_model"]["ground_truth"] + "\n", r["reward_model"]["ground_truth"]) == 1.0
    assert TASKS[task].score("zz", r["reward_model"]["ground_truth"]) == 0.0


def test_addition_answers_are_right():
    for r in make_rows("addition", 30, seed=0):
        a, b = r["prompt"][0]["content"].rstrip("=").split("+")
        assert int(r["reward_model"]["ground_truth"]) == int(a) + int(b)


def test_word_addition_answers_and_last_number_scoring():
    for r in make_rows("word_addition", 30, seed=0):
        a, b = r["prompt"][0]["content"].removeprefix("What is ").split("?")[0].split(" + ")
        assert 1 <= int(a) <= 60 and 1 <= int(b) <= 60
        assert int(r["reward_model"]["ground_truth"]) == int(a) + int(b)
    score = TASKS["word_addition"].score
    assert score("12 + 30 = 42.", "42") == 1.0 and score("42, no: 43", "42") == 0.0 and score("forty-two", "42") == 0.0


def test_too_many_synthetic_rows_is_a_clear_error():
    with pytest.raises(DataError, match="distinct 'val' prompts"):
        make_rows("count", 100000, split="val")


def test_cli_synth_writes_loadable_parquet(tmp_path, tok):
    assert data_main(["synth", "--task", "reverse", "--out", str(tmp_path), "--train", "40", "--val", "8"]) == 0
    train = load_rl_dataset(str(tmp_path / "train.parquet"), tok, _cfg())
    val = load_rl_dataset(str(tmp_path / "val.parquet"), tok, _cfg())
    assert len(train) == 40 and len(val) == 8 and train[0].data_source == "polyrl/reverse"


def test_cli_bad_input_returns_nonzero(tmp_path, capsys):
    assert data_main(["gsm8k", "--input", str(tmp_path / "none.jsonl"), "--out", str(tmp_path)]) == 1
    assert "none.jsonl' does not exist" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------------ gsm8k


def test_gsm8k_conversion_matches_verl(tmp_path, tok):
    lines = [
        {"question": "Tom has 3 apples and buys 4. How many?", "answer": "3+4=<<3+4=7>>7\n#### 7"},
        {"question": "A car costs $1,200 plus $300. Total?", "answer": "1200+300=1500\n#### 1,500"},
        {"question": "Temperature drops 5 from 2?", "answer": "2-5=-3\n#### -3"},
    ]
    src = tmp_path / "gsm8k.jsonl"
    src.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    assert data_main(["gsm8k", "--input", str(src), "--out", str(tmp_path / "out"), "--split", "test"]) == 0
    rows = pq.read_table(tmp_path / "out" / "test.parquet").to_pylist()
    assert [r["reward_model"]["ground_truth"] for r in rows] == ["7", "1500", "-3"]
    r = rows[1]
    assert r["data_source"] == "openai/gsm8k" and r["ability"] == "math"
    assert r["prompt"] == [{"role": "user", "content": lines[1]["question"] + " " + INSTRUCTION}]
    assert INSTRUCTION == 'Let\'s think step by step and output the final answer after "####".'
    assert r["reward_model"]["style"] == "rule"
    assert r["extra_info"] == {"split": "test", "index": 1, "answer": lines[1]["answer"], "question": lines[1]["question"]}
    samples = load_rl_dataset(str(tmp_path / "out" / "test.parquet"), tok, _cfg())
    assert samples[2].ground_truth == "-3"


def test_gsm8k_line_without_final_answer(tmp_path):
    src = tmp_path / "g.jsonl"
    src.write_text(json.dumps({"question": "q", "answer": "no marker"}) + "\n")
    with pytest.raises(DataError, match="Line 1 of .* no '#### N'"):
        convert_jsonl(src)


# ------------------------------------------------------------------------------------------------ sft


def _masked_text(tok, sample):
    return tok.decode([t for t, m in zip(sample.input_ids, sample.loss_mask) if m])


def test_sft_prompt_response_masks_only_response_and_eos(tmp_path, tok):
    a_path = _write(tmp_path, [{"prompt": "1+2=", "response": "3"}], "a.parquet")
    b_path = _write(tmp_path, [{"prompt": [{"role": "system", "content": "s"}, {"role": "user", "content": "9+9="}],
                                "response": "18"}], "b.parquet")
    a, b = load_sft_dataset([a_path, b_path], tok, max_length=64)
    assert tok.decode(a.input_ids) == "<|im_start|>user\n1+2=<|im_end|>\n<|im_start|>assistant\n3<|im_end|>\n"
    assert _masked_text(tok, a) == "3<|im_end|>"
    assert a.loss_mask[-1] == 0  # the newline after EOS is never generated
    assert _masked_text(tok, b) == "18<|im_end|>"


def test_sft_messages_multi_turn_masks_every_assistant_turn(tmp_path, tok):
    msgs = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "B"},
            {"role": "user", "content": "c"}, {"role": "assistant", "content": "DD"}]
    path = _write(tmp_path, [{"messages": msgs}])
    (s,) = load_sft_dataset(path, tok, max_length=128)
    assert _masked_text(tok, s) == "B<|im_end|>DD<|im_end|>"
    assert len(s.input_ids) == len(s.loss_mask)


def test_sft_errors(tmp_path, tok):
    path = _write(tmp_path, [{"prompt": "1+2=", "answer": "3"}])
    with pytest.raises(DataError, match="neither a 'messages' column nor 'prompt' \\+ 'response'"):
        load_sft_dataset(path, tok)
    path = _write(tmp_path, [{"prompt": "1+2=", "response": "3" * 50}], "long.parquet")
    with pytest.raises(DataError, match="Row 0 of .* over the max length 20"):
        load_sft_dataset(path, tok, max_length=20)
    (s,) = load_sft_dataset(path, tok, max_length=20, truncation="right")
    assert len(s.input_ids) == 20


def test_sft_mask_with_a_bpe_tokenizer(tmp_path):
    # BPE merges across text pieces; the mask comes from character offsets, so it must still cover the reply exactly
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from polyrl.models.tiny import CHAT_TEMPLATE

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|pad|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tk.train_from_iterator(["the answer is 42, hello world, user assistant"] * 50, trainer)
    bpe = PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<|pad|>", eos_token="<|im_end|>")
    bpe.chat_template = CHAT_TEMPLATE
    msgs = [{"role": "user", "content": "hello world"}, {"role": "assistant", "content": "the answer is 42"},
            {"role": "user", "content": "again"}, {"role": "assistant", "content": " hello"}]
    (s,) = load_sft_dataset(_write(tmp_path, [{"messages": msgs}]), bpe, max_length=200)
    assert any(len(bpe.decode([t])) > 2 for t in s.input_ids)  # really merged tokens
    assert _masked_text(bpe, s) == "the answer is 42<|im_end|> hello<|im_end|>"
