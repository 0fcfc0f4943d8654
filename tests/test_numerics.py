"""`tests.numerics.rel_err`, the norm-relative error the tests hold to docs/design.md §3's tolerances."""
import math

import pytest
import torch

from tests.numerics import rel_err


def test_rel_err_is_the_norm_of_the_difference_over_the_norm_of_the_reference():
    a, b = torch.tensor([3.0, 4.0]), torch.tensor([0.0, 8.0])
    assert rel_err(a, b) == pytest.approx(5 / 8)
    # samples of different lengths: all their tokens concatenated, not the worst sample
    got, want = [torch.tensor([1.0]), torch.tensor([2.0, 2.0])], [torch.tensor([2.0]), torch.tensor([2.0, 2.0])]
    assert rel_err(got, want) == pytest.approx(1 / math.sqrt(12))
    assert rel_err(torch.zeros(3), torch.zeros(3)) == 0.0 and rel_err(torch.ones(3), torch.zeros(3)) > 1e20


def test_rel_err_refuses_tensors_that_would_broadcast():
    with pytest.raises(ValueError, match=r"one shape, got \(3, 1\) and \(3,\)"):
        rel_err(torch.ones(3, 1), torch.ones(3))
