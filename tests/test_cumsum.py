import pytest
import torch

from cp_linattn.ops.common.cumsum import chunk_local_cumsum


def _reference(x, chunk, reverse, cu):
    y = torch.zeros_like(x, dtype=torch.float32)
    spans = [(b, 0, x.shape[1]) for b in range(x.shape[0])] if cu is None else [
        (0, int(cu[i]), int(cu[i + 1])) for i in range(len(cu) - 1)]
    for b, s, e in spans:
        for c in range(s, e, chunk):
            piece = x[b, c:min(c + chunk, e)].float()
            y[b, c:c + piece.shape[0]] = piece.flip(0).cumsum(0).flip(0) if reverse else piece.cumsum(0)
    return y


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("cu", [None, [0, 5, 5, 70, 100]])
def test_chunk_local_cumsum_matches_loop(reverse, cu):
    torch.manual_seed(0)
    B = 2 if cu is None else 1
    x = torch.randn(B, 100, 3, 20)
    cu_t = None if cu is None else torch.tensor(cu)
    y = chunk_local_cumsum(x, 16, reverse=reverse, cu_seqlens=cu_t)
    torch.testing.assert_close(y, _reference(x, 16, reverse, cu), rtol=1e-5, atol=1e-5)
