"""Image rewards: flow_grpo's OCR formula, rapidocr on rendered strings, custom-by-path and weighted sums."""

import numpy as np
import pytest
import torch

from polyrl.errors import RewardError
from polyrl.rewards import image_rewards


def test_ocr_formula():
    assert image_rewards.ocr_score("Take With Food", "take with food") == 1.0
    assert image_rewards.ocr_score("label: TAKEWITHFOOD!", "Take With Food") == 1.0  # gt contained -> distance 0
    assert image_rewards.ocr_score("Take Wth Food", "Take With Food") == pytest.approx(1 - 1 / 12)
    assert image_rewards.ocr_score("", "abc") == 0.0
    assert image_rewards.ocr_score("completely different text", "abc") == 0.0  # distance capped at |gt|
    assert image_rewards.ground_truth_of('a sign that reads "Hello 42" on a wall', {}) == "Hello 42"
    with pytest.raises(RewardError, match="quoted"):
        image_rewards.ground_truth_of("no quotes", {})


def _render(text: str, size=(160, 48)) -> torch.Tensor:
    from PIL import Image, ImageDraw, ImageFont

    img = Image.new("RGB", size, "white")
    ImageDraw.Draw(img).text((8, 10), text, fill="black", font=ImageFont.load_default(size=24))
    return torch.from_numpy(np.array(img)).permute(2, 0, 1).float() / 255


def test_rapidocr_reads_rendered_strings():
    pytest.importorskip("rapidocr")
    pytest.importorskip("onnxruntime")
    ocr = image_rewards.OCRReward()
    texts = ["Hello 123", "CAT 42", "polyrl"]
    images = torch.stack([_render(t) for t in texts])
    prompts = [f'a card that reads "{t}"' for t in texts]
    scores = ocr(images, prompts, [{}] * 3)
    assert scores == [1.0, 1.0, 1.0]
    wrong = ocr(images, ['reads "zzzzzzzz"'] * 3, [{}] * 3)
    assert max(wrong) < 0.5
    blank = ocr(torch.ones(1, 3, 48, 160), ['reads "abc"'], [{}])
    assert blank == [0.0]


def test_custom_reward_by_path_and_weighted_sum(tmp_path):
    f = tmp_path / "my_reward.py"
    f.write_text("def brightness(images, prompts, metadata):\n    return images.mean(dim=(1, 2, 3)).tolist()\n")
    fn = image_rewards.load_custom(str(f), "brightness")
    images = torch.stack([torch.zeros(1, 4, 4), torch.ones(1, 4, 4)])
    assert fn(images, ["a", "b"], [{}, {}]) == [0.0, 1.0]
    combo = image_rewards.build_reward({"const": 0.5, "custom": 2.0}, custom_path=str(f), custom_name="brightness",
                                 extra={"const": lambda im, p, m: [1.0] * len(p)})  # fmt: skip
    torch.testing.assert_close(combo(images, ["a", "b"], [{}, {}]), torch.tensor([0.5, 2.5]))
    assert combo.last_components == {"reward/const": 1.0, "reward/custom": 0.5}
    with pytest.raises(RewardError, match="Function .nope. is not defined .* set reward.custom_reward_function.name"):
        image_rewards.load_custom(str(f), "nope")
    with pytest.raises(RewardError, match="unknown reward"):
        image_rewards.build_reward({"nope": 1.0})
    bad = image_rewards.WeightedReward({"short": lambda im, p, m: [1.0]}, {})
    with pytest.raises(RewardError, match="1 scores for 2 images"):
        bad(images, ["a", "b"], [{}, {}])
