"""train_sft's length-grouped micro-batches (`by_length`) give the update of one padded batch."""

import copy

import torch

from polyrl.data.sft import SFTSample
from polyrl.trainer.sft import length_groups, train_sft


def _samples(num: int, lengths: tuple[int, ...], vocab: int) -> list[SFTSample]:
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(num):
        n = lengths[i % len(lengths)]
        ids = torch.randint(3, vocab, (n,), generator=g).tolist()
        out.append(SFTSample(input_ids=ids, loss_mask=[0] * (n // 3) + [1] * (n - n // 3)))
    return out


def test_length_groups_cut_where_padding_is_saved_and_keep_every_sample():
    batch = _samples(12, (30, 31, 100), vocab=50)
    groups = length_groups(batch, micro_batch_size=12)
    assert [len(g) for g in groups] == [8, 4]  # the short ones, then the long ones
    assert sorted(id(s) for g in groups for s in g) == sorted(id(s) for s in batch)
    small = length_groups(batch, micro_batch_size=3)
    assert all(len(g) <= 3 for g in small) and sum(map(len, small)) == 12
    assert all(len({len(s.input_ids) > 50 for s in g}) == 1 for g in length_groups(batch, 3, row_cost=0))
    assert len(length_groups(_samples(8, (20, 21), vocab=50), micro_batch_size=8)) == 1  # nothing worth a cut


def test_by_length_gives_the_padded_batch_update(tiny_qwen2):
    samples = _samples(16, (6, 7, 25), vocab=100)
    start = copy.deepcopy(tiny_qwen2)
    models = [tiny_qwen2, copy.deepcopy(tiny_qwen2)]
    losses = [train_sft(m, samples, pad_id=0, batch_size=8, micro_batch_size=8, lr=1e-2, steps=3,
                        device=torch.device("cpu"), by_length=by_length) for m, by_length in zip(models, (False, True))]
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-6)
    for a, b in zip(models[0].parameters(), models[1].parameters()):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-4)  # Adam divides rounding by tiny second moments
    assert max((a - b).abs().max() for a, b in zip(models[0].parameters(), start.parameters())) > 1e-3  # it trained
