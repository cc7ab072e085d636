"""examples/pbt.py at a reduced size is population-based training: the members
train at the same time, round after round, and the bottom of each round copy
(and perturb) the top, as the example's own event log shows.

The whole run is deterministic (seeded data, weights, minibatches and copies;
the rounds line the members up), so what these tests read does not depend on
timing except the overlap of the members' training, which 4 processes on 2
cores cannot avoid.
"""

from __future__ import annotations

import json
import math
import re
import sys

import pytest
from support.examples import EXAMPLES, assert_png, run_example

POPULATION, ROUNDS, STEPS = 4, 5, 100
CUT = 1  # --fraction 0.25 of 4 members


@pytest.fixture(scope="module")
def pbt_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("pbt")
    events, plot = tmp / "events.json", tmp / "pbt.png"
    out = run_example(
        "pbt.py",
        *("--population", str(POPULATION), "--rounds", str(ROUNDS)),
        *("--steps", str(STEPS), "--fraction", "0.25"),
        *("--events-json", str(events), "--plot", str(plot)),
    )
    with open(events) as f:
        log = json.load(f)
    return out, log, plot


def by_member_and_round(log: dict) -> dict:
    return {(e["member"], e["round"]): e for e in log["events"]}


@pytest.mark.timeout(240)
def test_every_member_reports_every_round_and_the_table_has_a_row_per_round(pbt_run):
    out, log, _ = pbt_run
    assert (log["population"], log["rounds"]) == (POPULATION, ROUNDS)
    assert sorted((e["member"], e["round"]) for e in log["events"]) == [
        (m, r) for m in range(POPULATION) for r in range(ROUNDS + 1)
    ]
    rows = re.findall(r"^ +(\d+) +(\d+) +(?:[\d.]+|diverged) +m\d+ ", out, re.M)
    assert [(int(r), int(s)) for r, s in rows] == [
        (r, r * STEPS) for r in range(ROUNDS + 1)
    ]
    assert re.search(r"^best: member \d+ validation loss [\d.]+ ", out, re.M), out


@pytest.mark.timeout(240)
def test_members_train_concurrently_in_lined_up_rounds(pbt_run):
    """Not one member running all its steps before the others report (the
    old example's flaw): every round, members train at the same time, and no
    member starts a round before the whole population finished the last one."""
    _, log, _ = pbt_run
    at = by_member_and_round(log)
    members = range(POPULATION)
    for r in range(1, ROUNDS):
        finished = max(at[m, r]["end"] for m in members)
        assert finished <= min(at[m, r + 1]["start"] for m in members), r
    for r in range(1, ROUNDS + 1):
        spans = sorted((at[m, r]["start"], at[m, r]["end"]) for m in members)
        assert all(start < end for start, end in spans), spans
        # sorted by start, some pair overlaps iff some neighbouring pair does
        pairs = zip(spans[:-1], spans[1:], strict=True)
        assert any(b[0] < a[1] for a, b in pairs), (r, spans)


@pytest.mark.timeout(240)
def test_bottom_members_copy_top_members_and_perturb_their_hyperparameters(pbt_run):
    _, log, _ = pbt_run
    at = by_member_and_round(log)
    copies = [e for e in log["events"] if e["copied"] is not None]
    for r in range(ROUNDS + 1):
        ranked = sorted(range(POPULATION), key=lambda m: (at[m, r]["loss"], m))
        plan = {e["member"]: e["copied"] for e in copies if e["round"] == r}
        if r in (0, ROUNDS):  # nothing trained yet / no round to follow
            assert plan == {}, r
            continue
        assert set(plan) == set(ranked[-CUT:]), (r, plan, ranked)
        assert set(plan.values()) <= set(ranked[:CUT]), (r, plan, ranked)
    assert all(e["copied"] != e["member"] for e in copies)  # never itself
    assert len({e["member"] for e in copies}) >= 2, copies  # across the population
    improved = 0
    for e in copies:
        source = at[e["copied"], e["round"]]
        after = at[e["member"], e["round"] + 1]
        # explore: the source's hyperparameters, each times 0.8 or 1.2
        assert (after["lr"], after["momentum"]) == (e["new_lr"], e["new_momentum"])
        assert any(math.isclose(after["lr"], source["lr"] * f) for f in (0.8, 1.2))
        assert any(
            math.isclose(after["momentum"], min(0.99, source["momentum"] * f))
            for f in (0.8, 1.2)
        ), (source, after)
        improved += after["loss"] < e["loss"]
    # exploit: with a top member's weights a bottom member usually does better
    assert improved > len(copies) / 2, copies


@pytest.mark.timeout(240)
def test_pbt_plot_is_a_png(pbt_run):
    out, _, plot = pbt_run
    assert f"plot: {plot}\n" in out
    width, height = assert_png(str(plot))
    assert width > height  # the 2 x 2 panels, 11 x 8 inches


def test_pbt_without_matplotlib_says_it_skipped_the_plot(monkeypatch, tmp_path):
    import importlib.util

    spec = importlib.util.spec_from_file_location("pbt_example", f"{EXAMPLES}/pbt.py")
    pbt = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pbt)
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    args = pbt.parse_args(["--population", "2", "--rounds", "1"])
    why = pbt.save_plot([], args, str(tmp_path / "never.png"))
    assert why == "matplotlib is not installed (pip install matplotlib)"
    assert not (tmp_path / "never.png").exists()
