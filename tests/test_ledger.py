"""The readiness ledger as pure state: counts in, launchable buckets out, with a fake
autograd engine and no process group (like ``plan_launches``'s tests)."""

from __future__ import annotations

from typing import Any

import pytest

from fxzero.optim.gradients.ledger import LateGradient, Ledger


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
    return Ledger(bucket_of_slot, buckets, label=lambda s: f"p{s}", engine=engine), engine


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
    with pytest.raises(LateGradient, match="param p1 received a gradient after bucket 0"):
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
    assert book.compiled_grads(0, 2, [0, 1]) == range(0, 1)


def test_a_forward_whose_backward_does_not_run_is_taken_out() -> None:
    book, engine = ledger()
    book.compiled_graph([0, 1])
    book.end_of_backward(), book.start_step()
    validation, train = Node(), Node()
    book.forward_ran([(0, 2)], validation)  # its backward never runs
    book.forward_ran([(0, 2)], train)
    assert book.pending(0) == 4
    engine.task, engine.runs = 1, {train}
    assert book.compiled_grads(0, 2, [0, 1]) == range(0, 1)  # the validation forward's 2 were taken out
    book.start_step()
    assert book.pending(0) == 0  # it stays out while its graph lives and does not run


def test_no_sync_counts_nothing_and_launches_nothing() -> None:
    book, _ = ledger()
    book.accumulating = True
    assert all(book.eager_grad(s) is None for s in range(4))
    assert book.launched == (False, False, False) and book.pending(0) == 2
    book.accumulating = False
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
    engine.task, book.accumulating = 1, True
    assert book.compiled_grads(1, 1, [2]) is None and book.compiled_grads(0, 2, [0, 1]) is None
    book.accumulating = False
    engine.task = 2
    assert book.compiled_grads(1, 1, [2]) == range(0)  # bucket 0 still waits for its two
    assert book.pending(0) == 2
    assert book.compiled_grads(0, 2, [0, 1]) == range(0, 2)
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
    assert book.compiled_grads(0, 1, [0]) == range(0)
    engine.task, engine.runs = 2, set()  # the inner backward: an eager gradient of bucket 2
    assert book.eager_grad(3) == range(0)
    engine.task, engine.runs = 1, {node}  # back in the outer one
    assert book.compiled_grads(0, 1, [1]) == range(0, 1)
