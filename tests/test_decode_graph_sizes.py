"""Which CUDA-graph size a decode step runs at (cuda_graph.DecodeGraphs.size_for): pure bookkeeping, no GPU."""

from polyrl.rollout.native.cuda_graph import CAPTURE_AFTER, DecodeGraphs, default_batch_sizes


def _graphs(captured=()):
    g = DecodeGraphs(forward=lambda bs: None, batch_sizes=default_batch_sizes(256))
    g.graphs = {s: object() for s in captured}  # stands in for captured graphs
    return g


def test_first_size_is_captured_at_once():
    assert _graphs().size_for(200) == 224


def test_captured_size_is_reused_exactly():
    assert _graphs(captured=[224, 256]).size_for(200) == 224


def test_new_small_size_replays_a_larger_graph_until_asked_often():
    g = _graphs(captured=[256])
    sizes = [g.size_for(100) for _ in range(CAPTURE_AFTER)]
    assert sizes[: CAPTURE_AFTER - 1] == [256] * (CAPTURE_AFTER - 1)
    assert sizes[-1] == 112  # asked CAPTURE_AFTER times: it gets its own graph


def test_no_larger_graph_means_capture_now():
    g = _graphs(captured=[16])
    assert g.size_for(100) == 112


def test_the_smallest_larger_graph_is_chosen():
    g = _graphs(captured=[64, 128, 256])
    assert g.size_for(20) == 64
    assert g.size_for(65) == 128


def test_counts_start_again_in_each_call():
    g = _graphs(captured=[256])
    for _ in range(CAPTURE_AFTER - 1):
        assert g.size_for(100) == 256
    g.new_call()
    assert g.size_for(100) == 256  # 1 ask in this call, not CAPTURE_AFTER in all
