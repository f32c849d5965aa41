"""Overlapped k-step merging (``trainer.merging.overlap``: modules/optim/kstep_merging.py, a merge landing some steps
late) on gloo processes, against the formula computed with numpy: every rank's updates are drawn from seeds, so
each process computes what every rank holds after every step — the passes landed so far, merged, plus its own
steps since — without reading anything the merger wrote."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.distributed as dist

from tests.dist_utils import run_workers

DENSE = 6
TABLES = {"wide": (30, 1), "a": (20, 4)}
STEPS, K = 10, 3


def _updates(rank: int, step: int) -> tuple[np.ndarray, dict[str, tuple[np.ndarray, np.ndarray]]]:
    """Rank ``rank``'s update at ``step``: of the dense vector, and per table (rows looked up, their updates)."""
    rng = np.random.default_rng([rank, step])
    tables = {}
    for name, (rows, dim) in TABLES.items():
        ids = np.sort(rng.choice(rows, rows // 4, replace=False))
        tables[name] = (ids, rng.normal(size=(len(ids), dim)).astype(np.float32))
    return rng.normal(size=DENSE).astype(np.float32), tables


def _pass_updates(rank: int, steps: range) -> tuple[np.ndarray, dict[str, np.ndarray], dict[str, np.ndarray]]:
    """A rank's summed updates over ``steps``: dense, per table the rows' sums and which rows it looked up."""
    dense = np.zeros(DENSE)
    rows = {n: np.zeros(s) for n, s in TABLES.items()}
    hit = {n: np.zeros(s[0], bool) for n, s in TABLES.items()}
    for step in steps:
        d, t = _updates(rank, step)
        dense += d
        for name, (ids, v) in t.items():
            rows[name][ids] += v
            hit[name][ids] = True
    return dense, rows, hit


def _merged(world: int, steps: range) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """A pass's merge: the mean dense update; per row Σ_r δ_r / √n over the n ranks that looked it up."""
    parts = [_pass_updates(r, steps) for r in range(world)]
    dense = np.mean([p[0] for p in parts], axis=0)
    tables = {}
    for name in TABLES:
        n = np.sum([p[2][name] for p in parts], axis=0)
        tables[name] = np.sum([p[1][name] for p in parts], axis=0) / np.sqrt(np.maximum(n, 1))[:, None]
    return dense, tables


def _expected(rank: int, world: int, step: int, late: int, flushed: bool) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """What ``rank`` holds after ``step``: the passes that landed (``late`` steps after they ended) merged, its own
    steps since on top (after a final merge: every pass merged, the same everywhere)."""
    landed = (step - late) // K * K if not flushed else step  # the passes that ended at least `late` steps ago
    dense = np.zeros(DENSE)
    tables = {n: np.zeros(s) for n, s in TABLES.items()}
    for start in range(1, landed + 1, K):
        d, t = _merged(world, range(start, min(start + K, landed + 1)))
        dense += d
        for name in TABLES:
            tables[name] += t[name]
    d, t, _ = _pass_updates(rank, range(max(landed, 0) + 1, step + 1))
    return dense + d, {name: tables[name] + t[name] for name in TABLES}


PASSES = [range(start, min(start + K, STEPS + 1)) for start in range(1, STEPS + 1, K)]  # the last, the final merge


def _merge_bytes(world: int, steps: range, updates: str) -> int:
    """What one rank sends in a merge: the dense updates; the count of its rows (int64), its row ids padded to the
    longest rank's (int32); the rows' updates by the cheaper exchange (tests/test_sparse_merging.py)."""
    from tests.test_sparse_merging import update_bytes

    size = 4 if updates == "fp32" else 2
    hits = [_pass_updates(r, steps)[2] for r in range(world)]
    longest = max(sum(int(h[name].sum()) for name in TABLES) for h in hits)
    met = {name: np.stack([h[name] for h in hits]) for name in TABLES}
    return DENSE * size + 8 + 4 * longest + update_bytes(met, {n: s[1] for n, s in TABLES.items()}, size)


def _worker(rank: int, world: int, updates: str, late: int) -> None:
    from modules.comm_accounting import CommCounter, install
    from modules.optim.kstep_merging import KStepMerger, MergeConfig
    from modules.optim.sparse_merging import TableMerger

    dense = torch.nn.Parameter(torch.zeros(DENSE))
    tables = {name: torch.zeros(shape) for name, shape in TABLES.items()}
    merger = KStepMerger([dense], MergeConfig(k=K, overlap=late), tables=TableMerger(tables, updates), dense=updates)
    install()  # in this worker process, which ends with the test
    counter = CommCounter()
    tol = 1e-5 if updates == "fp32" else 5e-3  # fp16 keeps ~11 bits of an update (sums of ~N(0, 1) over a pass)
    for step in range(1, STEPS + 1):
        d, t = _updates(rank, step)
        with torch.no_grad():
            for name, (ids, v) in t.items():
                merger.tables.record(name, torch.from_numpy(ids))  # before the update, as the lookup
                tables[name][torch.from_numpy(ids)] += torch.from_numpy(v)
            dense += torch.from_numpy(d)
        counter.start()  # as the training callback counts: a step's window (the merge's thread sends after it)
        assert merger.after_step() == (step % K == 0)
        counter.stop()
        want_dense, want_tables = _expected(rank, world, step, late, flushed=False)
        np.testing.assert_allclose(dense.detach().numpy(), want_dense, rtol=0, atol=tol, err_msg=f"step {step}")
        for name in TABLES:
            np.testing.assert_allclose(tables[name].numpy(), want_tables[name], rtol=0, atol=tol,
                                       err_msg=f"{name}, step {step}")
    counter.start()
    merger.merge_if_dirty()
    counter.stop()
    want_dense, want_tables = _expected(rank, world, STEPS, late, flushed=True)
    np.testing.assert_allclose(dense.detach().numpy(), want_dense, rtol=0, atol=tol)
    for name in TABLES:
        np.testing.assert_allclose(tables[name].numpy(), want_tables[name], rtol=0, atol=tol)
    assert merger.in_flight is None and merger.merges == STEPS // K + 1
    assert counter.bytes["merge"] == sum(_merge_bytes(world, steps, updates) for steps in PASSES)
    ours = torch.cat([dense.detach().reshape(-1)] + [t.reshape(-1) for t in tables.values()])
    everyone = [torch.empty_like(ours) for _ in range(world)]
    dist.all_gather(everyone, ours)
    for other in everyone:  # after the final merge the replicas agree (to rounding: each adds the means itself)
        torch.testing.assert_close(other, ours, rtol=0, atol=1e-5)


@pytest.mark.parametrize("updates, late", [("fp32", K), ("fp16", K), ("fp32", 1)])
def test_overlapped_merges_land_late_and_the_final_merge_makes_replicas_agree(updates, late):
    """``late`` = k: a merge lands when the next leaves; 1: in the middle of the next pass, whose own updates are
    then measured from a base the landed merge moved too."""
    run_workers(_worker, 2, updates, late)


def _trained(rank: int, updates: str, late: int, save_every: int | None = None, restart_after: int | None = None
             ) -> tuple[torch.Tensor, bool]:
    """The dense vector and tables after STEPS steps and the final merge, as one flat tensor; and whether a merge was
    in flight at the restart. ``save_every``: the merger's state taken (and serialised) every so many steps, as a
    checkpoint does; ``restart_after``: after that step the state goes through ``torch.save`` into a new merger over
    new tensors (zeros: everything comes from the state), as a resumed run's."""
    import io

    from modules.optim.kstep_merging import KStepMerger, MergeConfig
    from modules.optim.sparse_merging import TableMerger

    def build(dense: torch.Tensor, tables: dict[str, torch.Tensor]) -> KStepMerger:
        return KStepMerger([dense], MergeConfig(k=K, overlap=late), tables=TableMerger(tables, updates), dense=updates)

    dense = torch.nn.Parameter(torch.zeros(DENSE))
    tables = {name: torch.zeros(shape) for name, shape in TABLES.items()}
    merger = build(dense, tables)
    in_flight = False
    for step in range(1, STEPS + 1):
        d, t = _updates(rank, step)
        with torch.no_grad():
            for name, (ids, v) in t.items():
                merger.tables.record(name, torch.from_numpy(ids))
                tables[name][torch.from_numpy(ids)] += torch.from_numpy(v)
            dense += torch.from_numpy(d)
        merger.after_step()
        if save_every and step % save_every == 0:
            torch.save(merger.state_dict(), io.BytesIO())
        if step == restart_after:
            in_flight = merger.in_flight is not None
            saved = io.BytesIO()
            torch.save(merger.state_dict(), saved)
            saved.seek(0)
            dense = torch.nn.Parameter(torch.zeros(DENSE))
            tables = {name: torch.zeros(shape) for name, shape in TABLES.items()}
            merger = build(dense, tables)
            merger.load_state_dict(torch.load(saved, weights_only=True))
    merger.merge_if_dirty()
    return torch.cat([dense.detach().reshape(-1)] + [t.reshape(-1) for t in tables.values()]), in_flight


def _checkpoint_worker(rank: int, world: int) -> None:
    for updates, late in RESTART_CASES:
        plain, _ = _trained(rank, updates, late)
        saved, _ = _trained(rank, updates, late, save_every=2)
        assert torch.equal(saved, plain), f"{updates}, late {late}: taking the merger's state changed the run"
        for restart in range(1, STEPS):  # every step, those with a merge in flight among them
            resumed, in_flight = _trained(rank, updates, late, restart_after=restart)
            assert in_flight == (late > 0 and restart % K < late and restart >= K), (updates, late, restart)
            assert torch.equal(resumed, plain), f"{updates}, late {late}, resumed after step {restart}: not the " \
                                                f"uninterrupted run's bits"


RESTART_CASES = [("fp16", 2), ("fp32", K), ("fp16", 0)]  # one pair of processes for all: spawning them is the cost


def test_a_checkpoint_changes_nothing_and_a_restart_at_any_step_keeps_the_bits():
    """The merger's state taken every 2 steps leaves the run's bits as they were, and a new merger given the state
    after any step — a merge in flight, the updates' base in fp16, the tables' pass under way — ends with the
    uninterrupted run's bits on every rank (issue 82: checkpoints used to force a merge); fp16 updates landing 2
    steps late, fp32 ones landing k steps late, fp16 ones not overlapped."""
    run_workers(_checkpoint_worker, 2)
