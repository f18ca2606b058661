"""The readiness ledger as pure state: counts in, launchable buckets out, with a fake
autograd engine and no process group (like ``plan_launches``'s tests)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from fxzero.optim.gradients.ledger import LateGradient, Ledger
from fxzero.optim.layout.param_table import ParamRow, ParamTable


class FakeEngine:
    """A backward is running when ``task`` is not -1; it executes the nodes in ``runs``."""

    def __init__(self) -> None:
        self.task, self.runs = -1, set()

    def task_id(self) -> int:
        return self.task

    def will_execute(self, node: Any) -> bool:
        return node in self.runs


class Node:  # autograd nodes are held weakly: a plain object stands in
    pass


def ledger(bucket_of_slot=(0, 0, 1, 2), buckets=3) -> tuple[Ledger, FakeEngine]:
    engine = FakeEngine()
    rows = [ParamRow(s, torch.nn.Parameter(torch.zeros(1)), f"p{s}", 0, b) for s, b in enumerate(bucket_of_slot)]
    return Ledger(ParamTable(rows), buckets, engine=engine), engine


def compiled(book: Ledger, bucket: int, *slots: int) -> Any:
    """A compiled backward hands over the gradients of ``slots``, all in ``bucket``."""
    return book.compiled_grads(bucket, len(slots), torch.tensor(slots))


def test_eager_buckets_launch_in_order_once_every_lower_bucket_launched() -> None:
    book, _ = ledger()
    assert book.eager_grad(3) == range(0)  # bucket 2 ready, bucket 0 not
    assert book.eager_grad(2) == range(0)  # bucket 1 ready, bucket 0 not
    assert book.eager_grad(0) == range(0)
    assert book.eager_grad(1) == range(0, 3)  # bucket 0 ready: all three, in order
    assert book.launched == (True, True, True)
    assert bytes(book.presence) == b"\x01" * 4 and book.written


def test_a_repeated_eager_gradient_counts_once() -> None:
    book, _ = ledger()
    assert book.eager_grad(0) == range(0)
    assert book.eager_grad(0) is None
    assert book.pending(0) == 1


def test_a_late_gradient_names_the_param() -> None:
    book, _ = ledger()
    book.eager_grad(0), book.eager_grad(1)
    with pytest.raises(LateGradient, match=r"param 'p1' of the DistributedOptimizer over p0, p1, … \(4 params\) received a gradient after its bucket 0"):
        book.eager_grad(1)


def test_end_of_backward_launches_the_rest_and_ends_learning() -> None:
    book, _ = ledger()
    book.compiled_graph([2])
    assert book.learning and book.pending(1) == 0
    assert book.eager_grad(0) is not None and book.eager_grad(1) == range(0)  # learning: no launch
    assert book.end_of_backward() == range(0, 3) and not book.learning
    assert book.rest() == range(3, 3)


def test_compiled_forwards_add_what_their_backward_delivers() -> None:
    book, engine = ledger()
    book.compiled_graph([0, 1])
    book.end_of_backward(), book.start_step()
    node = Node()
    book.forward_ran([(0, 2)], node)
    assert book.pending(0) == 2
    engine.task, engine.runs = 7, {node}
    assert compiled(book, 0, 0, 1) == range(0, 1)


def test_a_forward_whose_backward_does_not_run_is_taken_out() -> None:
    book, engine = ledger()
    book.compiled_graph([0, 1])
    book.end_of_backward(), book.start_step()
    validation, train = Node(), Node()
    book.forward_ran([(0, 2)], validation)  # its backward never runs
    book.forward_ran([(0, 2)], train)
    assert book.pending(0) == 4
    engine.task, engine.runs = 1, {train}
    assert compiled(book, 0, 0, 1) == range(0, 1)  # the validation forward's 2 were taken out
    book.start_step()
    assert book.pending(0) == 0  # it stays out while its graph lives and does not run


def test_no_sync_counts_nothing_and_launches_nothing() -> None:
    book, _ = ledger()
    with book.no_sync():
        assert book.accumulating
        assert all(book.eager_grad(s) is None for s in range(4))
    assert book.launched == (False, False, False) and book.pending(0) == 2 and not book.accumulating
    assert book.eager_grad(0) == range(0) and book.eager_grad(1) == range(0, 1)


def test_a_mixed_param_is_expected_eagerly_from_its_discovery_on() -> None:
    book, _ = ledger()
    book.compiled_graph([3])
    assert book.eager_grad(3) is None  # discovered: not counted this step
    book.end_of_backward(), book.start_step()
    assert book.pending(2) == 1  # its eager gradient is expected from now on


def test_start_step_and_zeroed_reset_what_they_name() -> None:
    book, _ = ledger()
    book.eager_grad(0), book.eager_grad(1)
    book.start_step()
    assert book.launched == (False, False, False) and bytes(book.presence) == bytes(4) and book.written
    book.zeroed()
    assert not book.written


def test_a_second_backward_through_a_retained_graph_counts_its_gradients_again() -> None:
    """A2C: one compiled forward, the actor loss's backward (retain_graph) under no_sync, then the
    critic loss's through the same graph: the second backward delivers the forward's gradients
    again, so each bucket waits for all of them (it once launched at the first, then raised LateGradient)."""
    book, engine = ledger()
    book.compiled_graph([0, 1, 2])
    book.end_of_backward(), book.start_step()
    node = Node()
    book.forward_ran([(0, 2), (1, 1)], node)
    engine.runs = {node}
    engine.task = 1
    with book.no_sync():
        assert compiled(book, 1, 2) is None and compiled(book, 0, 0, 1) is None
    engine.task = 2
    assert compiled(book, 1, 2) == range(0)  # bucket 0 still waits for its two
    assert book.pending(0) == 2
    assert compiled(book, 0, 0, 1) == range(0, 2)
    book.start_step()
    assert book.pending(0) == 0 and book.pending(1) == 0  # consumed: not expected again


def test_a_forward_run_by_a_backward_is_not_taken_out_by_a_reentrant_one_inside_it() -> None:
    """Reentrant checkpointing runs a backward (another task) inside the backward: the outer
    forward, half delivered, keeps its remaining counts."""
    book, engine = ledger()
    book.compiled_graph([0, 1])
    book.end_of_backward(), book.start_step()
    node = Node()
    book.forward_ran([(0, 2)], node)
    engine.task, engine.runs = 1, {node}
    assert compiled(book, 0, 0) == range(0)
    engine.task, engine.runs = 2, set()  # the inner backward: an eager gradient of bucket 2
    assert book.eager_grad(3) == range(0)
    engine.task, engine.runs = 1, {node}  # back in the outer one
    assert compiled(book, 0, 1) == range(0, 1)


def test_compiled_gradients_mark_their_params_present_by_span_or_by_slots() -> None:
    book, _ = ledger()
    book.compiled_graph([0, 1, 2, 3])
    book.compiled_grads(0, 2, torch.tensor([0, 1]), slice(0, 2))  # consecutive: one memcpy
    assert bytes(book.presence) == b"\x01\x01\x00\x00"
    compiled(book, 2, 3)  # by slot: one index_fill_
    assert bytes(book.presence) == b"\x01\x01\x00\x01" and book.presence_tensor.tolist() == [1, 1, 0, 1]


def test_its_state_is_read_only_outside_its_methods() -> None:
    """Callers report events; only the ledger writes its flags (tests/test_ledger_writes.py checks the source)."""
    book, _ = ledger()
    for name in ("presence", "presence_tensor", "compiled", "written", "learning", "accumulating", "num_buckets", "launched"):
        with pytest.raises(AttributeError):
            setattr(book, name, None)
    with pytest.raises(TypeError):
        book.presence[0] = 1
    with pytest.raises(TypeError):
        book.compiled[0] = 1


def test_a_hand_assigned_gradient_marks_the_buffers_written() -> None:
    book, _ = ledger()
    book.grad_assigned()
    assert book.written
    book.zeroed()
    assert not book.written


def test_no_sync_nests_and_restores_the_enclosing_state() -> None:
    book, _ = ledger()
    with book.no_sync():
        with book.no_sync():
            pass
        assert book.accumulating
    assert not book.accumulating
    with pytest.raises(KeyError), book.no_sync():
        raise KeyError
    assert not book.accumulating


def test_buckets_are_the_param_tables() -> None:
    book, _ = ledger(bucket_of_slot=(1, 0, 0, 2))
    assert [book.bucket(s) for s in range(4)] == [1, 0, 0, 2]
