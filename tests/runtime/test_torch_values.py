"""The core's argument checks (``core/errors.py``) take torch scalars as they take numpy ones: a
0-d tensor is its number, a boolean or a 1-element tensor is not. Here, not in ``tests/core``: the
core's own tests run with torch unimportable (``make test-core``)."""

from __future__ import annotations

import torch

from minicb.core.errors import as_int, as_real


def test_as_int_takes_a_0d_integer_tensor_and_refuses_the_rest():
    assert as_int(torch.tensor(5)) == 5
    for no in (torch.tensor(True), torch.tensor([1]), torch.tensor(2.0)):
        assert as_int(no) is None, no


def test_as_real_takes_a_0d_tensor_and_refuses_the_rest():
    assert as_real(torch.tensor(2.5)) == 2.5 and as_real(torch.tensor(3)) == 3.0
    assert as_real(torch.tensor([1.0])) is None
