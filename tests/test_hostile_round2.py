"""Hostile inputs, round 2: eight classes of attack on every reader, as real CLI processes.

The attacks (tests/hostile/round2.py) were written from the docs, the CLIs' --help and the first
round's harness, without reading the readers. Each payload that can be shown to work is shown
live first (the remote code writes its canary when transformers builds the model, the engine
reads the secret file past a naive gate, torch allocates 16 GiB for the dead nodes, ...). Then
the sweep runs every attack as a user would (stdin closed, a timeout, a memory cap on the whole
process tree) and each class's test asserts every outcome is clean: exit code 1 (a follow-up
that must still work: 0; an option value: click's exit 2 also), one message, no traceback, no
crash, no canary, no secret or file outside the zoo read, no query changing a catalog byte, and
the catalog readable afterwards. A failure lists each unclean outcome: name, exit code, problems
and the last 3 lines of output.
"""
from __future__ import annotations

import importlib.util
import os
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.hostile.round2 import CLASSES, build_round2, control_attack, describe, run_process, run_round2, summary

# The whole sweep is ~170 CLI processes (torch and the project imported in each), minutes on 2
# cores: `benchmarks/bench_faults.py --hostile-only` runs it, and so does this file with
# ZOOGRAPH_HOSTILE_FULL=1. The suite runs every class through the attacks below (the issue's
# example of most classes and attacks that got through while the readers were being fixed); the
# unit tests of each reader cover the rest of each class in-process.
pytestmark = pytest.mark.slow
HAVE_HF = importlib.util.find_spec("transformers") is not None       # the hf extra; else class 1 is skipped
FULL = os.environ.get("ZOOGRAPH_HOSTILE_FULL") == "1"
IN_THE_SUITE = {
    "hf_backbone_dir_trust_remote_code", "hf_gpt2_million_layers", "limit_digit_load",
    "unwind_billion_default_timeout", "pt2_dead_sparse_to_dense", "metrics_column__file", "symlink_member_folder",
    "symlink_sidecar_json", "pt_stride0_65536_squared", "scz_layout_start_inf", "pt2_sym_size_9_pow_9_pow_9",
    "fifo_metrics_csv", "poison_code_swap",
}


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    work = tmp_path_factory.mktemp("round2")
    attacks = build_round2(work)
    if not FULL:
        chosen = [a for a in attacks if a.name in IN_THE_SUITE]
        assert {a.name for a in chosen} == IN_THE_SUITE, IN_THE_SUITE - {a.name for a in chosen}
        attacks = chosen
    return work, attacks


@pytest.fixture(scope="module")
def outcomes(built):
    work, attacks = built
    return run_round2(work, attacks)


def _assert_clean(outcomes, klass: int) -> None:
    mine = [o for o in outcomes if o.klass == klass]
    assert mine, f"no outcomes for class {klass}"
    bad = [describe(o) for o in mine if not o.clean]
    assert not bad, (f"class {klass} ({CLASSES[klass]}): {len(bad)} of {len(mine)} outcomes not clean:\n  "
                     + "\n  ".join(bad))


def test_the_payloads_are_live(built):
    """Loaded the unsafe way (transformers building the model, the graph engine without the gate,
    torch.export.load and running the program, plain pickle then torch.load), the payloads do
    what they are built to do: the refusals in the sweep are refusals of working attacks."""
    _, attacks = built
    live = [a for a in attacks if a.live is not None]
    with ThreadPoolExecutor(2) as pool:
        answers = list(pool.map(lambda a: (a, a.live()), live))
    dead = [f"{a.name}: {why}" for a, why in answers if why]
    assert not dead, "payloads that did not work the unsafe way:\n  " + "\n  ".join(dead)
    assert {a.klass for a in live} >= {2, 3, 6, 7, 8} | ({1} if HAVE_HF else set())


def test_class1_hugging_face_configs_naming_code_paths_or_hub_ids(outcomes):
    pytest.importorskip("transformers")
    _assert_clean(outcomes, 1)


def test_class2_cypher_gate_walkarounds_and_limits(outcomes):
    _assert_clean(outcomes, 2)


def test_class3_pt2_dead_nodes_and_a_later_zoo_of_that_architecture(outcomes):
    _assert_clean(outcomes, 3)


def test_class4_metrics_with_reserved_column_names(outcomes):
    _assert_clean(outcomes, 4)


def test_class5_members_that_are_symlinks_out_of_the_zoo(outcomes):
    _assert_clean(outcomes, 5)


def test_class6_readers_without_bounds(outcomes):
    _assert_clean(outcomes, 6)


def test_class7_hangs(outcomes):
    _assert_clean(outcomes, 7)


def test_class8_state_poisoning_of_the_unpickler(outcomes):
    _assert_clean(outcomes, 8)


def test_the_summary_counts_every_outcome(outcomes):
    counts = summary(outcomes)
    assert counts["attacks"] == len(outcomes) >= ((150 if HAVE_HF else 120) if FULL else len(IN_THE_SUITE) - 5)
    assert {o.klass for o in outcomes} == set(CLASSES) - (set() if HAVE_HF else {1})


def test_the_checks_see_a_leak_a_hang_and_a_memory_hog(built):
    """The harness itself: a query past the gate (--write) that prints a secret file outside the
    catalog is not clean, for the printed secret and for the file opened; a process past its
    timeout and one past its memory cap are killed and reported."""
    work, _ = built
    control = run_round2(work, [control_attack(work)])[0]
    assert not control.clean
    assert any("secret" in p for p in control.problems), control.problems
    assert any("secret.txt" in p and "opened" in p for p in control.problems), control.problems
    slow = run_process(["python3", "-c", "import time; time.sleep(30)"], timeout=1)
    assert slow["killed"] == "timeout" and slow["seconds"] < 10
    hog = run_process(["python3", "-c", "import time; b = b'x' * (768 << 20); time.sleep(30)"], cap=256 << 20)
    assert hog["killed"] == "memory" and hog["peak"] > 256 << 20
