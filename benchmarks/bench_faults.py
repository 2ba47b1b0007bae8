"""Fault table: kills, concurrent writers and bad inputs against real processes, then a re-run.

Every scenario ends the way a user would recover: the same command run again to completion.
Then it counts, against the zoo itself:

- rows lost: good checkpoints of the zoo that are not models of the catalog;
- duplicate rows: rows of the ``models`` view beyond one per model_id, plus nodes beyond the
  models' own ``num_nodes`` (a graph stored twice);
- graph = Parquet: whether the embedded Ladybug store holds exactly the catalog's models;
- notes: exit codes and what was refused.

    .venv/bin/python benchmarks/bench_faults.py            # quick: about 3-5 minutes
    .venv/bin/python benchmarks/bench_faults.py --trials 10
    .venv/bin/python benchmarks/bench_faults.py --hostile-only   # the hostile-input table alone

The hostile-input table (issue #29) runs every command over the hostile corpus of
tests/hostile (TorchScript and pickle payloads, archive bombs, hostile .pt2 graphs, SQL and
Cypher that try to write, run ids that are paths) and counts files written by payloads, catalog
bytes changed by queries, crashes (exit >= 128) and tracebacks, with the number of attacks tried.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).parent))

from _zoos import base_zoo  # noqa: E402

ENV = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), "NEO4J_URI": ""}
PY = sys.executable

PAUSE_IN_COMMIT = r"""
import os, signal, sys
import graphstore.catalog as catalog
original = catalog.pq.write_table
def write_table(*args, **kwargs):
    catalog.pq.write_table = original
    os.kill(os.getpid(), signal.SIGSTOP)
    return original(*args, **kwargs)
catalog.pq.write_table = write_table
from pipeline.cli import main
main(sys.argv[1:], prog_name="pipeline")
"""

# Training whose write-back is killed (SIGKILL) after its K-th file (artifacts and results alike).
KILL_IN_WRITE_BACK = r"""
import os, signal, sys, pathlib
import graphstore.catalog as catalog
k = int(os.environ["KILL_AFTER"])
count = [0]
def counted(fn):
    def wrapper(*args, **kwargs):
        out = fn(*args, **kwargs)
        count[0] += 1
        if count[0] >= k:
            os.kill(os.getpid(), signal.SIGKILL)
        return out
    return wrapper
catalog.pq.write_table = counted(catalog.pq.write_table)
pathlib.Path.write_bytes = counted(pathlib.Path.write_bytes)
from jobs.cli import main
main(sys.argv[1:], prog_name="jobs")
"""


def run(args, env=None):
    return subprocess.run(args, env=env or ENV, capture_output=True, text=True, timeout=600)


def ingest_cmd(zoo, cat, *extra):
    return [PY, "-m", "pipeline.cli", "ingest", str(zoo), "--catalog", str(cat), *extra]


def names_of(zoo: Path, files=None) -> set[tuple[str, str]]:
    return {(zoo.name, p.name if isinstance(p, Path) else p) for p in (files or zoo.glob("*.safetensors"))}


def state(cat: Path, zoo: Path, good: set[tuple[str, str]] | None = None) -> dict:
    """Rows lost, duplicate rows and graph/Parquet agreement of ``cat`` against ``zoo``."""
    code = r"""
import json, sys
from graphstore import duck
from graphstore.metadata.ladybug_store import LadybugStore
cat = sys.argv[1]
con = duck.connect(cat)
names = [list(r) for r in con.execute("SELECT zoo, checkpoint FROM models").fetchall()]
ids = con.execute("SELECT count(*), count(DISTINCT model_id), coalesce(sum(num_nodes), 0) FROM models").fetchone()
nodes = con.execute("SELECT count(*) FROM nodes").fetchone()[0]
con.close()
store = LadybugStore(cat + "/graph.lbug")
try:
    graph = {r[0] for r in store.run("MATCH (m:Model) RETURN m.model_id").rows}
except Exception:          # no Model table: nothing was ever written to the graph
    graph = set()
store.close()
con = duck.connect(cat)
parquet = {r[0] for r in con.execute("SELECT model_id FROM models").fetchall()}
print(json.dumps({"names": names, "rows": ids[0], "distinct": ids[1], "expected_nodes": int(ids[2]),
                  "nodes": nodes, "graph_ok": graph == parquet, "graph": len(graph), "parquet": len(parquet)}))
"""
    res = run([PY, "-c", code, str(cat)])
    if res.returncode != 0:
        return {"lost": None, "dup": None, "graph_ok": False, "error": res.stderr.strip().splitlines()[-1:]}
    s = json.loads(res.stdout.strip().splitlines()[-1])
    good = good if good is not None else names_of(zoo)
    return {"lost": len(good - {tuple(n) for n in s["names"]}), "dup": (s["rows"] - s["distinct"]) + max(0, s["nodes"] - s["expected_nodes"]),
            "graph_ok": s["graph_ok"], "graph": s["graph"], "parquet": s["parquet"]}


class Table:
    def __init__(self):
        self.rows = []

    def add(self, scenario, trials, results, note=""):
        lost = [r["lost"] for r in results]
        dup = [r["dup"] for r in results]
        agree = sum(bool(r["graph_ok"]) for r in results)
        fmt = lambda xs: "error" if any(x is None for x in xs) else str(sum(xs))   # noqa: E731
        self.rows.append([scenario, str(trials), fmt(lost), fmt(dup), f"{agree}/{len(results)}", note])
        print(" | ".join(self.rows[-1]), flush=True)

    def show(self):
        head = ["scenario", "trials", "rows lost", "duplicate rows", "graph = Parquet after re-run", "notes"]
        widths = [max(len(r[i]) for r in [head] + self.rows) for i in range(len(head))]
        line = lambda r: "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"   # noqa: E731
        print("\n" + line(head))
        print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
        for r in self.rows:
            print(line(r))


def kill_during_ingest(zoo, work, trials, rng, table):
    full = work / "timing"
    t0 = time.perf_counter()
    res = run(ingest_cmd(zoo, full))
    whole = time.perf_counter() - t0
    assert res.returncode == 0, res.stderr
    results, codes = [], []
    for t in range(trials):
        cat = work / f"kill-ingest-{t}"
        proc = subprocess.Popen(ingest_cmd(zoo, cat), env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(rng.uniform(0.3, 1.0) * whole)
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
        proc.wait()
        again = run(ingest_cmd(zoo, cat))
        codes.append(again.returncode)
        results.append(state(cat, zoo))
        shutil.rmtree(cat, ignore_errors=True)
    table.add("kill -9 at a random moment of ingest", trials, results,
              f"re-run exit codes {sorted(set(codes))}; full ingest {whole:.1f}s")


def kill_during_write_back(catalog, zoo, work, trials, rng, table):
    results, notes = [], []
    tiny = ["--epochs", "1", "--hidden", "8", "--layers", "1", "--no-baselines", "--loader-workers", "1"]
    for t in range(trials):
        cat = work / f"kill-train-{t}"
        shutil.copytree(catalog, cat)
        k = rng.randint(1, 5)      # artifacts: metanet-0.pt, metanet.json; results: runs, predictions, embeddings
        run([PY, "-c", KILL_IN_WRITE_BACK, "train-heterognn", "--catalog", str(cat), *tiny],
                   env={**ENV, "KILL_AFTER": str(k)})
        check = run([PY, "-c", r"""
import json, sys
from graphstore import duck
from graphstore.catalog import Catalog
c = Catalog(sys.argv[1]); c.clean_incomplete()
con = duck.connect(sys.argv[1])
runs = [r[0] for r in con.execute("SELECT run_id FROM runs").fetchall()]
preds = con.execute("SELECT count(*) FROM predictions").fetchone()[0]
models = con.execute("SELECT count(*) FROM models").fetchone()[0]
arts = [p.name for p in c.artifacts_dir.iterdir()] if c.artifacts_dir.exists() else []
partial = [a for a in arts if not (c.artifacts_dir / a / "metanet.json").exists()]
print(json.dumps({"runs": runs, "preds": preds, "models": models, "partial": partial}))
""", str(cat)])
        s = json.loads(check.stdout.strip().splitlines()[-1])
        # a run is there entirely (one row per model) or not at all; no artifact folder is partial
        whole = (len(s["runs"]) == 0 and s["preds"] == 0) or (len(s["runs"]) == 1 and s["preds"] == s["models"])
        again = run([PY, "-m", "jobs.cli", "train-heterognn", "--catalog", str(cat), *tiny])
        after = run([PY, "-c", "import sys; from graphstore import duck; con = duck.connect(sys.argv[1]); "
                     "print(con.execute('SELECT count(*), count(DISTINCT run_id) FROM runs').fetchone()[1], "
                     "con.execute('SELECT count(*) - count(DISTINCT (run_id, model_id, method)) FROM predictions')"
                     ".fetchone()[0])", str(cat)])
        n_runs, dups = (int(x) for x in after.stdout.split())
        r = state(cat, zoo)
        r["lost"] = (0 if whole and not s["partial"] else 1) + (0 if again.returncode == 0 else 1)
        r["dup"] += dups
        results.append(r)
        notes.append(f"k={k}:{'whole' if whole and not s['partial'] else 'PARTIAL'}")
        shutil.rmtree(cat, ignore_errors=True)
    table.add("kill -9 during training write-back", trials, results,
              "killed after file k of 5: " + ", ".join(notes) + " (rows lost counts partial runs)")


def concurrent_writers(zoo, work, trials, table):
    results, codes = [], []
    for t in range(trials):
        cat = work / f"concurrent-{t}"
        procs = [subprocess.Popen(ingest_cmd(zoo, cat, "--no-graph"), env=ENV, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True) for _ in range(2)]
        codes += [p.wait() for p in procs]
        again = run(ingest_cmd(zoo, cat))
        codes.append(again.returncode)
        results.append(state(cat, zoo))
        shutil.rmtree(cat, ignore_errors=True)
    table.add("two concurrent ingest writers (same zoo)", trials, results, f"exit codes {sorted(set(codes))}")


def paused_writer_and_cleaner(zoo, other, work, trials, table):
    results, notes = [], []
    for t in range(trials):
        cat = work / f"paused-{t}"
        writer = subprocess.Popen([PY, "-c", PAUSE_IN_COMMIT, "ingest", str(zoo), "--catalog", str(cat), "--no-graph"],
                                  env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.time() + 300
        while time.time() < deadline and open(f"/proc/{writer.pid}/stat").read().rsplit(")", 1)[1].split()[0] != "T":
            time.sleep(0.05)
        cleaner = run(ingest_cmd(other, cat, "--no-graph"))
        writer.send_signal(signal.SIGCONT)
        writer.wait()
        # both ingests ran without the graph store: the user re-runs both, and each repairs its own models
        again = run(ingest_cmd(zoo, cat))
        again_other = run(ingest_cmd(other, cat))
        notes.append(f"writer {writer.returncode}, cleaner {cleaner.returncode}, "
                     f"re-runs {again.returncode}/{again_other.returncode}")
        r = state(cat, zoo, names_of(zoo) | names_of(other))
        results.append(r)
        shutil.rmtree(cat, ignore_errors=True)
    table.add("one paused writer (SIGSTOP in commit) + a second ingest", trials, results, "; ".join(sorted(set(notes))))


def bad_inputs(zoo, work, table):
    def copy(name, n=6):
        dst = work / name
        dst.mkdir()
        files = sorted(zoo.glob("*.safetensors"))[:n]
        for p in files:
            shutil.copy(p, dst / p.name)
            shutil.copy(p.with_suffix(".json"), dst / p.with_suffix(".json").name)
        lines = (zoo / "metrics.csv").read_text().splitlines()
        keep = [lines[0]] + [ln for ln in lines[1:] if ln.split(",")[0] in {p.name for p in files}]
        (dst / "metrics.csv").write_text("\n".join(keep) + "\n")
        return dst, names_of(dst, [p.name for p in files])

    cases = []
    z, good = copy("na-value")
    lines = (z / "metrics.csv").read_text().splitlines()
    header = lines[0].split(",")
    col = header.index("test_accuracy") if "test_accuracy" in header else 1
    cells = lines[1].split(",")
    cells[col] = "n/a"
    lines[1] = ",".join(cells)
    (z / "metrics.csv").write_text("\n".join(lines) + "\n")
    cases.append(("bad input: n/a in a numeric metrics.csv column", z, good))
    z, good = copy("bad-spec")
    victim = sorted(z.glob("*.json"))[0]
    side = json.loads(victim.read_text())
    next(x for x in side["architecture"]["layers"] if x["type"] == "linear")["out_features"] = 100_000_000
    victim.write_text(json.dumps(side))
    cases.append(("bad input: spec declaring out_features 1e8", z, good - {(z.name, victim.with_suffix(".safetensors").name)}))
    z, good = copy("latin1-csv")
    text = (z / "metrics.csv").read_text().splitlines()
    text[0] = text[0] + ",note"
    text[1:] = [ln + ",caf\u00e9" for ln in text[1:]]
    (z / "metrics.csv").write_bytes(("\n".join(text) + "\n").encode("latin-1"))
    # a metrics.csv that is not UTF-8 refuses the whole zoo before anything is written: nothing is expected
    cases.append(("bad input: non-UTF-8 metrics.csv (zoo refused)", z, set()))
    for label, z, good in cases:
        cat = work / f"cat-{z.name}"
        first = run(ingest_cmd(z, cat))
        again = run(ingest_cmd(z, cat))
        err = ([ln for ln in first.stderr.strip().splitlines() if "%|" not in ln] or [""])[-1][:110]
        r = state(cat, z, good) if (cat / "parts").exists() else {"lost": len(good), "dup": 0, "graph_ok": not good}
        table.add(label, 1, [r], f"exit {first.returncode}/{again.returncode}" + (f": {err}" if err else "")
                  + ("; Traceback" if "Traceback" in first.stderr else ""))


def hostile_inputs(work: Path) -> None:
    """Every command over the hostile corpora (tests.hostile.attacks, and round two's eight classes
    in tests.hostile.round2), as real processes: what the payloads wrote, what queries changed in
    the catalog, crashes, tracebacks, timeouts and memory, by attack."""
    from tests.hostile import attacks, round2

    for title, outcomes, summary, describe in (
            ("round one: every command", attacks.run_attacks(work / "hostile"), attacks.summary,
             lambda o: f"{o.name}: exit {o.exit_code}, canaries {o.canaries}, changed {o.catalog_changed}"),
            ("round two: configs, the Cypher gate, programs, columns, links, bounds, hangs, poisoning",
             round2.run_round2(work / "hostile2"), round2.summary, round2.describe)):
        print(f"\nhostile inputs, {title} (real processes):")
        counts = summary(outcomes)
        width = max(len(k) for k in counts)
        for key, value in counts.items():
            print(f"  {key:<{width}}  {value}")
        for o in outcomes:
            if not o.clean:
                print(f"  NOT CLEAN {describe(o)}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trials", type=int, default=4, help="trials per kill / concurrency scenario (quick: 4)")
    ap.add_argument("--models", type=int, default=24, help="models in the MLP zoo")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--hostile-only", action="store_true", help="only the hostile-input tables (about five minutes)")
    args = ap.parse_args()
    if args.hostile_only:
        with tempfile.TemporaryDirectory(prefix="bench-hostile-") as tmp:
            hostile_inputs(Path(tmp))
        return
    rng = random.Random(args.seed)
    started = time.perf_counter()
    zoo = base_zoo("mlp", args.models, 0)
    other = base_zoo("mlp", 4, 1)
    table = Table()
    with tempfile.TemporaryDirectory(prefix="bench-faults-") as tmp:
        work = Path(tmp)
        kill_during_ingest(zoo, work, args.trials, rng, table)
        trained = work / "trained"
        assert run(ingest_cmd(zoo, trained)).returncode == 0
        kill_during_write_back(trained, zoo, work, max(2, args.trials // 2), rng, table)
        concurrent_writers(zoo, work, max(2, args.trials // 2), table)
        paused_writer_and_cleaner(zoo, other, work, max(1, args.trials // 4), table)
        bad_inputs(zoo, work, table)
        table.show()
        hostile_inputs(work)
    print(f"\n{args.models}-model MLP zoo, {args.trials} trials, {time.perf_counter() - started:.0f}s")


if __name__ == "__main__":
    main()
