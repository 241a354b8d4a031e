"""The exception classes (made in rust/python/errors.rs): a class with fields takes them in its
constructor after the message and reads them back; ``str`` is the message; ``pickle`` and
``copy`` keep the class and the fields; the fields cannot be assigned."""

from __future__ import annotations

import copy
import pickle

import pytest
import torch

from plusequals import (
    DonationConsumed,
    OwnershipError,
    RustBlock,
    StaleBlock,
    UnsupportedBlockError,
    UseAfterDonation,
    WeightsChanged,
)
from support.boundary import small_block, small_inputs

FIELDS = {
    OwnershipError: ("arg", "why", "count", "modes"),
    UseAfterDonation: ("op",),
}

EXAMPLES = [
    OwnershipError("x is a view", "x", "view"),
    OwnershipError("x has other handles", "x", "other_handles", 2),
    OwnershipError("a mode is active", "x", "dispatch_modes", modes=("LoggingMode",)),
    UseAfterDonation("use of a donated tensor (sum)", "sum"),
    DonationConsumed("x was donated and its buffer consumed"),
    UnsupportedBlockError("feed-forward chunking is not supported"),
    StaleBlock("the module changed since it was read"),
    WeightsChanged("a weight was written in place"),
]


def fields(error: BaseException) -> tuple:
    return tuple(getattr(error, name) for name in FIELDS.get(type(error), ()))


def test_the_fields_are_the_constructors_arguments_after_the_message():
    e = OwnershipError("x has other handles", "x", "other_handles", 2, ["M"])
    assert (e.arg, e.why, e.count, e.modes) == ("x", "other_handles", 2, ["M"])
    assert str(e) == "x has other handles"
    e = OwnershipError("x is a view", arg="x", why="view")
    assert (e.arg, e.why, e.count, e.modes) == ("x", "view", None, [])
    u = UseAfterDonation("use of a donated tensor (sum)", "sum")
    assert (u.op, str(u)) == ("sum", "use of a donated tensor (sum)")
    assert isinstance(u, DonationConsumed) and isinstance(u, RuntimeError)
    with pytest.raises(TypeError):
        OwnershipError("no fields")  # arg and why are required
    with pytest.raises(AttributeError):
        e.arg = "context"  # type: ignore[misc]


@pytest.mark.parametrize("error", EXAMPLES, ids=lambda e: type(e).__name__)
def test_pickle_and_copy_keep_the_class_the_message_and_the_fields(error):
    for again in (pickle.loads(pickle.dumps(error)), copy.copy(error), copy.deepcopy(error)):
        assert type(again) is type(error)
        assert (str(again), fields(again), again.args) == (str(error), fields(error), error.args)


def test_an_error_raised_by_rust_has_its_fields_and_survives_pickle():
    block = RustBlock.from_torch(small_block())
    x, context = small_inputs()
    with torch.no_grad(), pytest.raises(OwnershipError) as info:
        block.forward_owned(x[:, 1:], context, donate=True)
    error = info.value
    assert (error.arg, error.why) == ("x", "view"), error
    again = pickle.loads(pickle.dumps(error))
    assert (str(again), again.arg, again.why, again.count) == (str(error), "x", "view", error.count)
