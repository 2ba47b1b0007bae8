"""Round 2 of hostile inputs: eight classes of attack, each run as a real process of the CLI.

Written from the docs, the CLIs' ``--help`` and the first round's harness (``tests.hostile.attacks``,
``tests.hostile.corpus``), without reading the project's readers. ``build_round2(work)`` writes
every hostile file and returns the attacks; ``run_round2(work)`` runs them and returns one
``Outcome2`` per process; ``summary(outcomes)`` counts them like ``attacks.summary``.

The classes (``Attack2.klass``):

1. Hugging Face folders whose ``config.json`` names code, paths or hub ids (backbones, nested
   sub-configs, ``auto_map``, ``_name_or_path``, ``trust_remote_code``) or asks for huge tensors.
2. Cypher gate walk-arounds on the embedded store (``LIMIT 1LOAD``, comments, unicode spaces,
   string escapes), a billion-row ``UNWIND``, and non-finite ``--timeout`` / ``--memory-limit``.
3. ``.pt2`` archives with dead nodes that allocate gigabytes from constants, and a later zoo of
   the same architecture run through ``jobs merge`` / ``jobs layer-equivariance``.
4. ``metrics.csv`` columns named like the catalog's own (``_file``, ``_rn``, ``model_id``, ...).
5. Members that are symlinks out of the zoo (files, folders, HF files, ``/dev/zero``), also with
   a relative zoo path.
6. Readers without bounds: stride-0 and out-of-bounds tensors in ``data.pkl``, deflate bombs in
   ``data/0`` and ``byteorder``, a gzip row of gigabytes, sparse ``weights.npy``/JSON/CSV files
   of gigabytes, ``layout.csv`` offsets of ``inf``.
7. Hangs: ``9**9**9`` in a ``.pt2``'s symbolic shapes, 40,000 nested ``getattr(`` in its module
   stack, deep JSON, FIFOs where files are expected.
8. State poisoning: a ``data.pkl`` that rewrites globals of torch through BUILD on an allowed
   global, then a good checkpoint in the same process.

What a clean outcome is (``Outcome2.clean``): exit code exactly 1 (or 0 for the follow-ups that
must still work; for option values, exit 2 with click's ``Usage:``/``Error:`` lines is accepted
too, since click refuses them before the command runs; for reserved metrics columns and a folder
cycle inside the zoo, 0 or 1), no ``Traceback``, no crash (signal), every process done within its
timeout and with the resident memory of its whole process tree under ``MEMORY_CAP``, one message
(a query's refusal is one line on stderr; an ingest prints a line per failure, none over 4,000
characters), no canary file, no secret in the output or in a catalog, no file outside the zoo
opened (inotify), no hub request, no ``trust_remote_code`` prompt, no catalog byte changed by a
query, and the catalog readable afterwards (``pipeline sql "SELECT count(*) FROM models"`` exits
0). Every process runs with stdin closed.

Attacks run in lanes, two lanes at a time: the queries on the shared catalog one after another
(so a changed byte names its query), and the ingests of a class into one catalog per lane (as a
user adds zoos to one catalog), checked for secrets after each attack and for readability at the
end of the lane. ``control_attack`` is a leak on purpose, to show the checks see one.

The memory cap is a watchdog, not ``RLIMIT_AS``: the embedded graph store (Ladybug) reserves
8 TiB of address space when it opens and the SQL worker sets its own limit, so an address-space
or data-segment limit makes every store open and every SQL query fail (measured). The watchdog
sums the resident memory of the command's process tree every 50 ms and kills the tree past the
cap; such an outcome is not clean.

Hostile files are sparse or small on disk: the multi-gigabyte files are ``truncate``d (no blocks
used) and the bombs are deflate streams of a few megabytes.
"""
from __future__ import annotations

import ctypes
import http.server
import io
import itertools
import json
import os
import re
import secrets
import shutil
import signal
import struct
import subprocess
import tempfile
import threading
import time
import zipfile
import zlib
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np
import psutil

from tests.hostile.attacks import PY, ROOT, Outcome, _env, changed_files, tree_digest
from tests.hostile.attacks import summary as round1_summary
from tests.hostile.corpus import _export_bytes, _raw_zip, _rewrite_zip, _stored, _torch_save_bytes

MEMORY_CAP = 6 << 30            # resident bytes of a command's whole process tree
TIMEOUT = 30.0                  # seconds per process (a refusal takes a few; jobs get more)
LANES = 2                       # attacks run two at a time (each in its own folders)
MAX_LINE, MAX_LINES = 4000, 30  # a refusal is one line per failure, not a dump
CLASSES = {1: "Hugging Face configs naming code, paths or hub ids; huge configs",
           2: "Cypher gate walk-arounds, unbounded queries, non-finite limits",
           3: ".pt2 dead nodes computing on constants; a later zoo of the same architecture",
           4: "metrics.csv with the catalog's reserved column names",
           5: "members that are symlinks out of the zoo",
           6: "readers without bounds",
           7: "hangs",
           8: "state poisoning of the restricted unpickler"}
PROMPT = "Do you wish to run the custom code"
CLI = ("pipeline", "graphstore", "jobs")


# --------------------------------------------------------------------------
# records
# --------------------------------------------------------------------------
@dataclass
class Outcome2(Outcome):
    """``attacks.Outcome`` with the class, what exit was expected, and the problems found by
    the checks beyond the first round's (memory, time, secrets, reads outside, prompts)."""
    klass: int = 0
    expect: str = "refused"          # refused: exit 1; ok: exit 0; either: 0 or 1; usage: 1, or click's 2
    problems: list[str] = field(default_factory=list)
    peak_rss: int = 0
    timed_out: bool = False
    over_memory: bool = False
    stderr: str = ""

    @property
    def usage_error(self) -> bool:
        """click's refusal of an option value: exit 2, a ``Usage:`` and an ``Error:`` line."""
        return self.exit_code == 2 and "Usage:" in self.stderr and "Error:" in self.stderr

    @property
    def clean(self) -> bool:
        ok = {"refused": self.exit_code == 1, "ok": self.exit_code == 0, "either": self.exit_code in (0, 1),
              "usage": self.exit_code == 1 or self.usage_error}[self.expect]
        return ok and not (self.crashed or self.traceback or self.canaries or self.catalog_changed or self.problems
                           or self.timed_out or self.over_memory)

    def tail(self, n: int = 3) -> list[str]:
        return _message_lines(self.output)[-n:]


@dataclass
class Step:
    """One process. ``args`` starts with pipeline/graphstore/jobs (run as ``python -m X.cli``),
    else it is a whole argv; it may be a function returning the list (evaluated when run)."""
    name: str
    args: list[str] | Callable[[], list[str]]
    expect: str = "refused"
    cwd: Path | None = None
    timeout: float = TIMEOUT
    frozen: Path | None = None                  # a catalog whose bytes this step may not change
    frozen_ignore: tuple[str, ...] = ()
    env: dict = field(default_factory=dict)
    one_line: bool = False                      # a refusal is one line on stderr
    check: Callable[[str], list[str]] | None = None
    requires: Path | None = None                # skipped when this path does not exist


@dataclass
class Attack2:
    klass: int
    name: str
    description: str
    steps: list[Step]
    canaries: list[Path] = field(default_factory=list)      # files a payload would create
    secrets: list[str] = field(default_factory=list)        # strings no output and no catalog may hold
    outside: list[Path] = field(default_factory=list)       # folders no process may open a file of
    catalogs: list[Path] = field(default_factory=list)      # checked readable (and for secrets) afterwards
    hub_ids: list[str] = field(default_factory=list)        # repo ids no request may name
    live: Callable[[], str] | None = None                   # shows the payload works: returns "" or why not
    lane: str = ""                                          # attacks of one lane run one after another
    scan: list[Path] = field(default_factory=list)          # more catalogs no secret may reach
    lane_catalog: Path | None = None                        # shared by the lane: checked readable at its end


# --------------------------------------------------------------------------
# running
# --------------------------------------------------------------------------
_PROGRESS = re.compile(r"\d+%\||\d+/\d+ \[|it/s\]|model/s\]|s/model\]")


def _message_lines(text: str) -> list[str]:
    """The lines of ``text`` without tqdm's progress bars (which redraw with carriage returns)."""
    lines = []
    for raw in text.replace("\r", "\n").split("\n"):
        if raw.strip() and not _PROGRESS.search(raw):
            lines.append(raw.rstrip())
    return lines


class _OpenWatch:
    """inotify watches on folders outside every zoo and catalog: which of their files anyone
    opened or read. Only files count (listing or stat-ing a folder is not reading it)."""
    IN_ACCESS, IN_OPEN, IN_ISDIR, IN_Q_OVERFLOW = 0x1, 0x20, 0x40000000, 0x4000

    def __init__(self):
        self.lock = threading.Lock()
        self.wds: dict[int, Path] = {}
        self.opened: set[Path] = set()
        self.overflow = False
        try:
            self.libc = ctypes.CDLL(None, use_errno=True)
            self.fd = self.libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        except (OSError, AttributeError):
            self.fd = -1

    @property
    def available(self) -> bool:
        return self.fd >= 0

    def watch(self, root: Path) -> None:
        if not self.available or not root.exists():
            return
        folders = [root] if root.is_dir() else [root.parent]
        if root.is_dir():
            folders += [p for p in root.rglob("*") if p.is_dir() and not p.is_symlink()]
        for folder in folders:
            wd = self.libc.inotify_add_watch(self.fd, str(folder).encode(), self.IN_ACCESS | self.IN_OPEN)
            if wd >= 0:
                self.wds[wd] = folder

    def drain(self) -> None:
        if not self.available:
            return
        with self.lock:
            while True:
                try:
                    data = os.read(self.fd, 1 << 16)
                except BlockingIOError:
                    return
                i = 0
                while i + 16 <= len(data):
                    wd, mask, _, size = struct.unpack_from("iIII", data, i)
                    name = data[i + 16:i + 16 + size].rstrip(b"\0").decode(errors="replace")
                    i += 16 + size
                    if mask & self.IN_Q_OVERFLOW:
                        self.overflow = True
                    elif not mask & self.IN_ISDIR and wd in self.wds and name:
                        self.opened.add(self.wds[wd] / name)

    def opened_under(self, root: Path) -> list[str]:
        self.drain()
        with self.lock:
            return sorted(str(p) for p in self.opened if p == root or root in p.parents)

    def close(self) -> None:
        if self.available:
            os.close(self.fd)
            self.fd = -1


class _HubRecorder(http.server.ThreadingHTTPServer):
    """A stand-in for the Hugging Face hub (``HF_ENDPOINT``): answers 404 and records every path
    asked for, so a reader that reaches for a hub id is seen doing so."""
    daemon_threads = True

    def __init__(self):
        self.hits: list[str] = []
        recorder = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                recorder.hits.append(self.path)
                self.send_response(404)
                self.send_header("Content-Length", "0")
                self.end_headers()

            do_HEAD = do_POST = do_GET

            def log_message(self, *args):
                pass

        super().__init__(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def stop(self) -> None:
        self.shutdown()
        self.server_close()


def _tree(proc: psutil.Process) -> list[psutil.Process]:
    try:
        return [proc, *proc.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _rss(procs: list[psutil.Process]) -> int:
    total = 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    return total


def _kill_tree(pid: int, procs: list[psutil.Process]) -> None:
    """SIGKILL the command we started and every descendant it has, by id."""
    for p in procs:
        try:
            p.kill()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            pass
    try:
        os.killpg(pid, signal.SIGKILL)              # the session we started it in
    except (ProcessLookupError, PermissionError):
        pass


def _argv(args: list[str]) -> list[str]:
    return [PY, "-m", f"{args[0]}.cli", *args[1:]] if args[0] in CLI else list(args)


def run_process(args: list[str], *, cwd: Path | None = None, env: dict | None = None,
                timeout: float = TIMEOUT, cap: int = MEMORY_CAP) -> dict:
    """Run one command as a user would (stdin closed), with the memory watchdog and the timeout.
    Returns exit code, stdout, stderr, seconds, peak resident bytes of the tree, and why it was
    killed if it was."""
    started = time.monotonic()
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(_argv(args), stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                env={**_env(), **(env or {})}, cwd=cwd or ROOT, start_new_session=True)
        ps = psutil.Process(proc.pid)
        peak, killed = 0, ""
        while proc.poll() is None:
            procs = _tree(ps)
            peak = max(peak, _rss(procs))
            if peak > cap:
                killed = "memory"
            elif time.monotonic() - started > timeout:
                killed = "timeout"
            if killed:
                _kill_tree(proc.pid, procs)
                break
            time.sleep(0.05)
        code = proc.wait()
        out.seek(0)
        err.seek(0)
        stdout, stderr = (f.read().decode(errors="replace") for f in (out, err))
    return {"code": code, "stdout": stdout, "stderr": stderr, "seconds": time.monotonic() - started,
            "peak": peak, "killed": killed}


class _Runner:
    def __init__(self, work: Path, ctx: dict, progress=None):
        self.work, self.ctx, self.progress = work, ctx, progress
        self.watch = _OpenWatch()
        self.hub = _HubRecorder()
        self.env = {"HF_HOME": str(ctx["hf_home"]), "HF_ENDPOINT": self.hub.url, "HF_HUB_DISABLE_TELEMETRY": "1"}
        self.lock = threading.Lock()

    def step(self, attack: Attack2, step: Step, label: str) -> Outcome2 | None:
        if step.requires is not None and not step.requires.exists():
            return None
        args = step.args() if callable(step.args) else step.args
        before = tree_digest(step.frozen) if step.frozen is not None and step.frozen.exists() else None
        r = run_process(args, cwd=step.cwd, env={**self.env, **step.env}, timeout=step.timeout)
        changed = []
        if before is not None:
            changed = [f for f in changed_files(before, tree_digest(step.frozen)) if f not in step.frozen_ignore]
        o = Outcome2(label, [str(a) for a in args], r["code"], r["seconds"], r["stdout"] + r["stderr"],
                     catalog_changed=changed, expect_refused=step.expect == "refused", klass=attack.klass,
                     expect=step.expect, peak_rss=r["peak"], timed_out=r["killed"] == "timeout",
                     over_memory=r["killed"] == "memory", stderr=r["stderr"])
        if o.timed_out:
            o.problems.append(f"still running after {step.timeout:g} s (killed)")
        if o.over_memory:
            o.problems.append(f"process tree over {MEMORY_CAP >> 30} GiB resident (killed)")
        if PROMPT in o.output:
            o.problems.append("prompted to trust remote code")
        if "MemoryError" in o.output or "bad_alloc" in o.output:
            o.problems.append("ran out of memory (MemoryError)")
        for s in attack.secrets:
            if s in o.output:
                o.problems.append("printed the secret of a file outside the zoo")
        if step.one_line and step.expect in ("refused", "usage") and not o.usage_error:
            lines = _message_lines(o.stderr)
            if len(lines) != 1:
                o.problems.append(f"refusal is {len(lines)} lines on stderr, not one")
        if step.expect in ("refused", "either") and args[0] in CLI:
            lines = _message_lines(o.output)
            longest = max((len(line) for line in lines), default=0)
            if longest > MAX_LINE:
                o.problems.append(f"a message line of {longest:,} characters")
            if len(lines) > MAX_LINES:
                o.problems.append(f"{len(lines)} lines of output, not one message per failure")
        if step.check is not None:
            o.problems += step.check(o.output)
        return o

    def attack(self, attack: Attack2) -> list[Outcome2]:
        outcomes = []
        for i, step in enumerate(attack.steps):
            o = self.step(attack, step, attack.name if i == 0 else f"{attack.name}/{step.name}")
            if o is not None:
                outcomes.append(o)
        for cat in attack.catalogs:
            o = self.step(attack, Step("readable", ["pipeline", "sql", "--catalog", str(cat), "--timeout", "60",
                                                    "SELECT count(*) FROM models"], expect="ok",
                                       requires=cat / "parts"), f"{attack.name}/readable")
            if o is not None:
                outcomes.append(o)
        if not outcomes:
            return outcomes
        first = outcomes[0]
        first.canaries = sorted(str(c) for c in attack.canaries if c.exists() or c.is_symlink())
        for root in attack.outside:
            for path in self.watch.opened_under(root):
                first.problems.append(f"opened {path}, outside the zoo")
        for cat in attack.catalogs + attack.scan:
            for s in attack.secrets:
                if _catalog_holds(cat, s):
                    first.problems.append(f"the catalog {cat.name} holds the secret of a file outside the zoo")
        for repo in attack.hub_ids:
            hits = [h for h in list(self.hub.hits) if repo in h]
            if hits:
                first.problems.append(f"asked the hub for {hits[0]}")
        if self.progress:
            for o in outcomes:
                self.progress(o)
        return outcomes


def _catalog_holds(cat: Path, secret: str) -> bool:
    if not cat.exists():
        return False
    import pyarrow.parquet as pq

    needle = secret.encode()
    for f in cat.rglob("*"):
        if not f.is_file():
            continue
        if needle in f.read_bytes():
            return True
        if f.suffix == ".parquet":
            try:
                if secret in repr(pq.read_table(f).to_pylist()):
                    return True
            except Exception:       # a part that does not read is the readable check's concern
                pass
    return False


def run_round2(work: Path, attacks: list[Attack2] | None = None, progress=None) -> list[Outcome2]:
    """Build (unless given) and run every attack; attacks of one lane run in order, lanes two
    at a time. Returns the outcomes in the order of the attacks."""
    work = Path(work)
    if attacks is None:
        attacks = build_round2(work)
    ctx = _context(work)
    runner = _Runner(work, ctx, progress)
    for a in attacks:
        for root in a.outside:
            runner.watch.watch(root)
    runner.watch.drain()
    runner.watch.opened.clear()
    lanes: dict[str, list[Attack2]] = defaultdict(list)
    for a in attacks:
        lanes[a.lane or a.name].append(a)
    results: dict[str, list[Outcome2]] = {}

    def run_lane(lane: list[Attack2]) -> None:
        for a in lane:
            results[a.name] = runner.attack(a)
        for cat in dict.fromkeys(a.lane_catalog for a in lane if a.lane_catalog is not None):
            last = lane[-1]
            step = Step("readable", ["pipeline", "sql", "--catalog", str(cat), "--timeout", "60",
                                     "SELECT count(*) FROM models"], expect="ok", requires=cat / "parts")
            o = runner.step(last, step, f"{last.lane}/readable_after_the_lane")
            if o is not None:
                results[last.name].append(o)
                if progress:
                    progress(o)

    try:
        ordered = sorted(lanes.values(), key=len, reverse=True)      # the long lane starts first
        with ThreadPoolExecutor(LANES) as pool:
            list(pool.map(run_lane, ordered))
    finally:
        runner.hub.stop()
        runner.watch.close()
    return [o for a in attacks for o in results.get(a.name, [])]


def summary(outcomes: list[Outcome2]) -> dict[str, int]:
    """``attacks.summary``'s counts, and this round's."""
    return {**round1_summary(outcomes),
            "timeouts": sum(getattr(o, "timed_out", False) for o in outcomes),
            "over the memory cap": sum(getattr(o, "over_memory", False) for o in outcomes),
            "other problems (secrets, reads outside, prompts, hub)": sum(bool(getattr(o, "problems", []))
                                                                         for o in outcomes)}


def describe(o: Outcome2) -> str:
    """One readable line per outcome: name, exit code, problems and the last 3 output lines."""
    why = "; ".join(o.problems)
    extra = f" canaries={o.canaries}" if o.canaries else ""
    extra += f" catalog changed={o.catalog_changed}" if o.catalog_changed else ""
    return (f"{o.name}: exit {o.exit_code} (expected {o.expect}) {o.seconds:.1f}s peak {o.peak_rss >> 20} MiB"
            f"{extra}{' [' + why + ']' if why else ''} | " + " / ".join(o.tail(3)))


# --------------------------------------------------------------------------
# shared material: a small real catalog and real zoos of every format, made once
# --------------------------------------------------------------------------
def _context(work: Path) -> dict:
    base = Path(work) / "base"
    return {"base": base, "mlp": base / "mlp", "pt2": base / "pt2", "catalog": base / "catalog",
            "hf": base / "hf", "scz": base / "scz", "mz": base / "mz", "hf_home": Path(work) / "hf-home",
            "outside": Path(work) / "outside", "canaries": Path(work) / "canaries", "zoos": Path(work) / "zoos",
            "cats": Path(work) / "cats"}


def _have_transformers() -> bool:
    try:
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


def _make_base(ctx: dict) -> None:
    """The main catalog (3 real MLPs, ingested with the embedded graph store by the CLI), a pair
    of .pt2 MLPs of one architecture (for jobs merge), and fixture zoos of the published formats."""
    from pipeline.zoo.make import make_zoo

    from tests.fixtures.model_zoos import write_model_zoo
    from tests.fixtures.small_cnn_zoo import write_small_cnn_zoo

    if not (ctx["catalog"] / "parts").exists():
        make_zoo("mlp", ctx["mlp"], n=3, seed=3, workers=1, progress=False)
        r = run_process(["pipeline", "ingest", str(ctx["mlp"]), "--catalog", str(ctx["catalog"])], timeout=300)
        assert r["code"] == 0, r["stdout"] + r["stderr"]
    if not list(ctx["pt2"].glob("*.pt2")):
        make_zoo("mlp", ctx["pt2"], n=2, seed=5, fmt="pt2", replicas=2, workers=1, progress=False)
    if not ctx["scz"].exists():
        write_small_cnn_zoo(ctx["scz"], n_runs=2, crashed_runs=0)
    if not ctx["mz"].exists():
        write_model_zoo(ctx["mz"], kind="CNN", n_models=2, epochs=(0, 1), seed=1)
    if _have_transformers() and not ctx["hf"].exists():
        from tests.fixtures.hf_zoo import write_hf_zoo

        write_hf_zoo(ctx["hf"], n_per_arch=1, archs=("gpt2", "vit"), sharded=0, seed=1)
    ctx["hf_home"].mkdir(parents=True, exist_ok=True)


class _Kit:
    """Per-attack folders: a zoo, a catalog, an outside folder, a canary and a secret. With
    ``shared``, the catalog is the lane's: the attacks of a lane ingest into one catalog one
    after another (as a user adds zoos to one catalog), secrets are looked for in it after each
    attack and its readability is checked at the end of the lane (one process, not one per attack)."""

    def __init__(self, ctx: dict, klass: int, name: str, shared: str | None = None):
        self.ctx, self.klass, self.name, self.shared = ctx, klass, name, shared
        self.zoo = ctx["zoos"] / name
        self.cat = ctx["cats"] / (shared or name)
        self.out = ctx["outside"] / name
        self.canary = ctx["canaries"] / f"{name}.canary"
        self.secret = "ZGSECRET" + secrets.token_hex(8)
        for d in (self.zoo, self.out, ctx["canaries"]):
            d.mkdir(parents=True, exist_ok=True)
        self.cat.parent.mkdir(parents=True, exist_ok=True)

    def secret_file(self, name: str = "secret.txt") -> Path:
        path = self.out / name
        path.write_text(f"zg:{self.secret}:x\n")
        return path

    def ingest(self, *extra: str, zoo: Path | str | None = None, expect: str = "refused", **kw) -> Step:
        return Step("ingest", ["pipeline", "ingest", str(zoo or self.zoo), "--catalog", str(self.cat), *extra],
                    expect=expect, **kw)

    def attack(self, description: str, steps: list[Step], **kw) -> Attack2:
        kw.setdefault("canaries", [self.canary])
        kw.setdefault("secrets", [self.secret])
        kw.setdefault("outside", [self.out])
        if self.shared:
            kw.setdefault("lane", self.shared)
            kw.setdefault("lane_catalog", self.cat)
            kw["scan"] = [*kw.get("scan", []), *kw.pop("catalogs", [self.cat])]
            kw["catalogs"] = []
        kw.setdefault("catalogs", [self.cat])
        return Attack2(self.klass, self.name, description, steps, **kw)


def _lanes(klass: int) -> Callable[[], str]:
    """Names of two shared lanes of a class, alternating."""
    count = itertools.count()
    return lambda: f"class{klass}-{'ab'[next(count) % 2]}"


def _mlp_members(ctx: dict) -> list[Path]:
    return sorted(ctx["mlp"].glob("*.safetensors"))


def _copy_member(src: Path, dst_dir: Path, stem: str | None = None) -> Path:
    """A checkpoint and its JSON sidecar, under a new stem."""
    stem = stem or src.stem
    dst_dir.mkdir(parents=True, exist_ok=True)
    dst = dst_dir / f"{stem}{src.suffix}"
    shutil.copy(src, dst)
    shutil.copy(src.with_suffix(".json"), dst_dir / f"{stem}.json")
    return dst


def _metrics(zoo: Path, names: list[str], column: str = "checkpoint") -> None:
    (zoo / "metrics.csv").write_text(f"{column},test_accuracy\n" + "".join(f"{n},0.5\n" for n in names))


def _sparse(path: Path, content: bytes, size: int) -> Path:
    """``content`` then zeros up to ``size`` bytes, as a sparse file (no blocks for the zeros)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content)
    os.truncate(path, size)
    return path


def _run_python(code: str, *args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([PY, "-c", code, *args], capture_output=True, text=True, timeout=timeout,
                          stdin=subprocess.DEVNULL, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})


def _live_canary(code: str, canary: Path, env: dict | None = None) -> str:
    """Run ``code`` the unsafe way in a fresh interpreter; '' when it wrote ``canary``."""
    canary.unlink(missing_ok=True)
    with tempfile.TemporaryDirectory() as home:
        r = _run_python(code, env={"HF_HOME": home, "HF_HUB_OFFLINE": "1", **(env or {})})
    if canary.exists():
        canary.unlink()
        return ""
    return f"no canary: {(r.stdout + r.stderr).strip()[-300:]}"


# --------------------------------------------------------------------------
# 1. Hugging Face configs
# --------------------------------------------------------------------------
_EVIL_CODE = '''import pathlib
pathlib.Path({canary!r}).touch()
from transformers import PretrainedConfig, PreTrainedModel


class EvilConfig(PretrainedConfig):
    model_type = "zg_evil"


class EvilModel(PreTrainedModel):
    config_class = EvilConfig
'''
_AUTO_MAP = {"AutoConfig": "zg_evil_code.EvilConfig", "AutoModel": "zg_evil_code.EvilModel",
             "AutoBackbone": "zg_evil_code.EvilModel", "AutoModelForCausalLM": "zg_evil_code.EvilModel"}


def _remote_code(folder: Path, canary: Path, config: dict | None = None) -> Path:
    """A folder transformers loads remote code from: a config.json with an ``auto_map`` and the
    python file it names, which creates ``canary`` when imported."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "zg_evil_code.py").write_text(_EVIL_CODE.format(canary=str(canary)))
    (folder / "config.json").write_text(json.dumps(config or {"model_type": "zg_evil", "auto_map": _AUTO_MAP}))
    return folder


def _hf_member(zoo: Path, member: str, config: dict, weights_from: Path | None = None) -> Path:
    """A member folder: the config, and either a real member's weights or one tiny tensor."""
    from safetensors.numpy import save_file

    folder = zoo / member
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    if weights_from is not None:
        shutil.copy(weights_from, folder / "model.safetensors")
    else:
        save_file({"x": np.zeros(1, np.float32)}, str(folder / "model.safetensors"))
    (zoo / "metrics.csv").write_text(f"model,test_accuracy\n{member},0.5\n")
    return folder


def _hf_cache_repo(hf_home: Path, repo: str, canary: Path) -> None:
    """``repo`` in the hub cache of ``hf_home`` as huggingface_hub lays it out, holding remote
    code: what an offline machine resolves a hub id to."""
    sha = "0" * 39 + "1"
    root = hf_home / "hub" / ("models--" + repo.replace("/", "--"))
    (root / "refs").mkdir(parents=True, exist_ok=True)
    (root / "refs" / "main").write_text(sha)
    _remote_code(root / "snapshots" / sha, canary)


_TINY_VIT = {"model_type": "vit", "hidden_size": 16, "num_hidden_layers": 1, "num_attention_heads": 2,
             "intermediate_size": 32, "image_size": 8, "patch_size": 4, "num_channels": 1}
_TINY_CLIP_VISION = {"model_type": "clip_vision_model", "hidden_size": 16, "intermediate_size": 32,
                     "num_hidden_layers": 1, "num_attention_heads": 2, "image_size": 8, "patch_size": 4,
                     "projection_dim": 16}

_LIVE_BACKBONE = """
from transformers import UperNetConfig, UperNetForSemanticSegmentation
import json, sys
cfg = json.load(open({config!r}))
cfg.pop("architectures", None); cfg.pop("model_type", None)
try:
    UperNetForSemanticSegmentation(UperNetConfig.from_dict(cfg))
except Exception as exc:
    print(type(exc).__name__, exc)
"""
_LIVE_DECODER = """
from transformers import AutoConfig, AutoModelForCausalLM
import json
cfg = AutoConfig.for_model(**json.load(open({config!r})))
try:
    AutoModelForCausalLM.from_config(cfg.{sub}, trust_remote_code=True)
except Exception as exc:
    print(type(exc).__name__, exc)
"""
_LIVE_PROMPT = """
from transformers import AutoConfig, {cls}
import json
cfg = AutoConfig.for_model(**json.load(open({config!r})))
try:
    {cls}(cfg)
except Exception as exc:
    print(type(exc).__name__, exc)
"""


def _live_prompt(config: Path, cls: str) -> str:
    r = _run_python(_LIVE_PROMPT.format(config=str(config), cls=cls), env={"HF_HUB_OFFLINE": "1"})
    return "" if PROMPT in r.stdout + r.stderr else f"no prompt: {(r.stdout + r.stderr)[-300:]}"


def _live_hub(config: Path) -> str:
    rec = _HubRecorder()
    try:
        _run_python(_LIVE_BACKBONE.format(config=str(config)), env={"HF_ENDPOINT": rec.url, "HF_HUB_OFFLINE": "0",
                                                                        "TRANSFORMERS_OFFLINE": "0"})
        return "" if rec.hits else "no hub request"
    finally:
        rec.stop()


def _live_numel(config: Path, cls: str) -> str:
    code = (f"import json, torch\nfrom transformers import AutoConfig, {cls}\n"
            f"cfg = AutoConfig.for_model(**json.load(open({str(config)!r})))\n"
            f"with torch.device('meta'):\n    m = {cls}(cfg)\n"
            "print(sum(p.numel() for p in m.parameters()) * 4)\n")
    r = _run_python(code, timeout=300)
    try:
        return "" if int(r.stdout.split()[-1]) > MEMORY_CAP else f"only {r.stdout.split()[-1]} bytes"
    except (ValueError, IndexError):
        return f"no size: {(r.stdout + r.stderr)[-300:]}"


def _class1(ctx: dict) -> list[Attack2]:
    if not _have_transformers():
        return []
    attacks = []
    lane = _lanes(1)
    gpt2_cfg = json.loads((ctx["hf"] / "gpt2_00" / "config.json").read_text())
    gpt2_weights = ctx["hf"] / "gpt2_00" / "model.safetensors"

    def hf(name, description, config_of, *, weights=False, env=None, hub=(), live=None, prep=None):
        k = _Kit(ctx, 1, name, shared=lane())
        bb = _remote_code(k.out / "code", k.canary)
        config = config_of(k, bb)
        folder = _hf_member(k.zoo, "m", config, gpt2_weights if weights else None)
        if prep:
            prep(k, folder)
        step = k.ingest("--format", "hf-folders", env=env or {})
        attacks.append(k.attack(description, [step], hub_ids=list(hub),
                                live=(lambda: live(k, folder / "config.json")) if live else None))

    backbone = {"architectures": ["UperNetForSemanticSegmentation"], "model_type": "upernet",
                "use_pretrained_backbone": False, "use_timm_backbone": False, "backbone_config": None,
                "backbone_kwargs": {"trust_remote_code": True}}
    hf("hf_backbone_dir_trust_remote_code",
       "UperNet config whose backbone is an absolute folder with an auto_map and python code, with "
       "backbone_kwargs trust_remote_code: building the model runs the code (load_backbone).",
       lambda k, bb: {**backbone, "backbone": str(bb)},
       live=lambda k, c: _live_canary(_LIVE_BACKBONE.format(config=str(c)), k.canary))
    hf("hf_backbone_config_auto_map",
       "UperNet whose backbone_config is a dict (a ViT, which has no local backbone class) carrying an auto_map "
       "and a _name_or_path of the code folder: transformers prompts for trust_remote_code when building it.",
       lambda k, bb: {**{x: v for x, v in backbone.items() if x != "backbone_kwargs"},
                      "backbone_config": {**_TINY_VIT, "auto_map": _AUTO_MAP, "_name_or_path": str(bb)}},
       live=lambda k, c: _live_prompt(c, "UperNetForSemanticSegmentation"))
    hf("hf_detr_backbone_dir",
       "DETR config whose (non-timm) backbone is the code folder, trust_remote_code in backbone_kwargs.",
       lambda k, bb: {"architectures": ["DetrForObjectDetection"], "model_type": "detr", "use_timm_backbone": False,
                      "use_pretrained_backbone": False, "backbone": str(bb), "backbone_config": None,
                      "backbone_kwargs": {"trust_remote_code": True}, "num_queries": 2, "d_model": 16,
                      "encoder_layers": 1, "decoder_layers": 1},
       live=lambda k, c: _live_canary(_LIVE_PROMPT.format(config=str(c), cls="DetrForObjectDetection"), k.canary))
    hf("hf_backbone_hub_id",
       "UperNet backbone 'zg-evil/hub-backbone' (a hub id) with trust_remote_code: transformers asks the "
       "hub (HF_ENDPOINT is a local recorder).",
       lambda k, bb: {**backbone, "backbone": "zg-evil/hub-backbone"}, hub=["zg-evil/hub-backbone"],
       live=lambda k, c: _live_hub(c))
    hf("hf_backbone_hub_id_cached_offline",
       "UperNet backbone 'zg-evil/cached-backbone', which the offline machine's hub cache holds with remote "
       "code (HF_HUB_OFFLINE=1): resolved from the cache and imported.",
       lambda k, bb: {**backbone, "backbone": "zg-evil/cached-backbone"}, env={"HF_HUB_OFFLINE": "1"},
       prep=lambda k, f: _hf_cache_repo(ctx["hf_home"], "zg-evil/cached-backbone", k.canary),
       live=lambda k, c: _live_cached(k, c))
    dec = lambda k, bb: {"model_type": "vit", **{x: v for x, v in _TINY_VIT.items() if x != "model_type"},  # noqa: E731
                         "auto_map": _AUTO_MAP, "_name_or_path": str(bb), "name_or_path": str(bb), "is_decoder": True}
    hf("hf_encoder_decoder_decoder_auto_map",
       "VisionEncoderDecoderModel whose decoder sub-config carries an auto_map and a _name_or_path of the code "
       "folder (decoder type without a local causal-LM class): transformers prompts for trust_remote_code "
       "(with trust, the code runs).",
       lambda k, bb: {"architectures": ["VisionEncoderDecoderModel"], "model_type": "vision-encoder-decoder",
                      "is_encoder_decoder": True, "encoder": dict(_TINY_VIT), "decoder": dec(k, bb)},
       live=lambda k, c: _live_prompt(c, "VisionEncoderDecoderModel")
       or _live_canary(_LIVE_DECODER.format(config=str(c), sub="decoder"), k.canary))
    hf("hf_llava_text_config_auto_map",
       "LLaVA whose text_config carries an auto_map and a _name_or_path of the code folder.",
       lambda k, bb: {"architectures": ["LlavaForConditionalGeneration"], "model_type": "llava",
                      "vision_config": dict(_TINY_CLIP_VISION), "text_config": {**dec(k, bb), "vocab_size": 50}},
       live=lambda k, c: _live_canary(_LIVE_DECODER.format(config=str(c), sub="text_config"), k.canary))
    hf("hf_llava_vision_config_auto_map",
       "LLaVA whose vision_config carries an auto_map and a _name_or_path of the code folder (transformers "
       "itself prefers its local class here: not live, refused for naming code all the same).",
       lambda k, bb: {"architectures": ["LlavaForConditionalGeneration"], "model_type": "llava",
                      "vision_config": {**_TINY_CLIP_VISION, "auto_map": _AUTO_MAP, "_name_or_path": str(bb)},
                      "text_config": {"model_type": "gpt2", "n_embd": 16, "n_layer": 1, "n_head": 2,
                                      "vocab_size": 50, "n_positions": 16}})
    hf("hf_name_or_path_code_dir",
       "A real GPT-2 member whose config adds _name_or_path/name_or_path of the code folder and an auto_map.",
       lambda k, bb: {**gpt2_cfg, "_name_or_path": str(bb), "name_or_path": str(bb), "auto_map": _AUTO_MAP},
       weights=True)
    hf("hf_top_level_trust_remote_code",
       "A real GPT-2 member with trust_remote_code: true and an auto_map naming python code in its own folder.",
       lambda k, bb: {**gpt2_cfg, "trust_remote_code": True, "auto_map": _AUTO_MAP},
       weights=True, prep=lambda k, f: shutil.copy(k.out / "code" / "zg_evil_code.py", f / "zg_evil_code.py"))
    hf("hf_auto_map_without_model_type",
       "Real GPT-2 weights, a config with an auto_map to code in the member folder and no model_type "
       "(AutoConfig would prompt, or with trust run it); architectures names the remote class.",
       lambda k, bb: {**{x: v for x, v in gpt2_cfg.items() if x != "model_type"}, "auto_map": _AUTO_MAP,
                      "architectures": ["EvilModel"]},
       weights=True, prep=lambda k, f: shutil.copy(k.out / "code" / "zg_evil_code.py", f / "zg_evil_code.py"))
    hf("hf_auto_map_hub_prefixed",
       "Real GPT-2 member whose auto_map names 'zg-evil/prefixed--zg_evil_code.EvilConfig' (code from a hub repo).",
       lambda k, bb: {**gpt2_cfg, "auto_map": {c: "zg-evil/prefixed--" + v for c, v in _AUTO_MAP.items()}},
       weights=True, hub=["zg-evil/prefixed"])
    # resources: tiny weights, a config asking for gigabytes
    hf("hf_gpt2_vocab_40M",
       "GPT-2 config with vocab_size 40,000,000 and n_embd 64 (10 GB of embeddings), weights of one tiny tensor.",
       lambda k, bb: {**gpt2_cfg, "vocab_size": 40_000_000, "n_embd": 64, "n_head": 2},
       live=lambda k, c: _live_numel(c, "GPT2LMHeadModel"))
    hf("hf_vit_image_size_20000",
       "ViT config with image_size 20000 and patch_size 2 (10^8 position embeddings of 32), tiny weights.",
       lambda k, bb: {"architectures": ["ViTForImageClassification"], **_TINY_VIT, "image_size": 20000,
                      "patch_size": 2, "hidden_size": 32},
       live=lambda k, c: _live_numel(c, "ViTForImageClassification"))
    hf("hf_gpt2_million_layers",
       "GPT-2 config with n_layer 1,000,000 (a million modules to build), tiny weights.",
       lambda k, bb: {**gpt2_cfg, "n_layer": 1_000_000, "n_embd": 8, "n_head": 2, "n_inner": 8})
    hf("hf_config_int_of_5000_digits",
       "GPT-2 config whose vocab_size is an integer of 5,000 digits (past Python's int-string limit).",
       lambda k, bb: {**gpt2_cfg, "vocab_size": 0}, weights=True,
       prep=lambda k, f: (f / "config.json").write_text(
           (f / "config.json").read_text().replace('"vocab_size": 0', '"vocab_size": ' + "9" * 5000)))
    return attacks


def _live_cached(k: _Kit, config: Path) -> str:
    with tempfile.TemporaryDirectory() as home:
        _hf_cache_repo(Path(home), "zg-evil/cached-backbone", k.canary)
        return _live_canary(_LIVE_BACKBONE.format(config=str(config)), k.canary,
                            env={"HF_HOME": home, "HF_HUB_OFFLINE": "1"})


# --------------------------------------------------------------------------
# 2. Cypher gate walk-arounds, unbounded queries, option values
# --------------------------------------------------------------------------
_LADYBUG_PROBE = """
import json, shutil, sys, tempfile, ladybug
src, queries = sys.argv[1], json.loads(sys.argv[2])
with tempfile.TemporaryDirectory() as tmp:
    copy = tmp + "/graph.lbug"
    shutil.copy(src, copy)
    conn = ladybug.Connection(ladybug.Database(copy, read_only=True))
    out = {}
    for name, q in queries.items():
        try:
            r = conn.execute(q)
            rows = []
            while r.has_next():
                rows.append(r.get_next())
            out[name] = repr(rows)
        except Exception as exc:
            out[name] = "ERROR " + str(exc).splitlines()[0]
    print(json.dumps(out))
"""


class _LadybugLive:
    """Runs the registered queries straight on the engine (a copy of the catalog's graph, opened
    read-only, as the embedded store is), in one child: which of them read the secret file."""

    def __init__(self, graph: Path):
        self.graph, self.queries, self.answers = graph, {}, None

    def add(self, name: str, query: str, secret: str) -> Callable[[], str]:
        self.queries[name] = (query, secret)

        def live() -> str:
            if self.answers is None:
                r = _run_python(_LADYBUG_PROBE, str(self.graph),
                                json.dumps({n: q for n, (q, _) in self.queries.items()}))
                try:
                    self.answers = json.loads(r.stdout.strip().splitlines()[-1])
                except (ValueError, IndexError):
                    self.answers = {n: f"probe failed: {(r.stdout + r.stderr)[-200:]}" for n in self.queries}
            answer = self.answers.get(name, "")
            return "" if secret in answer else f"the engine did not read the file: {answer[:200]}"
        return live


def _class2(ctx: dict) -> list[Attack2]:
    cat = ctx["catalog"]
    attacks: list[Attack2] = []
    engine = _LadybugLive(cat / "graph.lbug")
    all_secrets: list[str] = []

    def cypher(name, description, query_of, *, extra=(), expect="refused", timeout=TIMEOUT, live=False, check=None):
        k = _Kit(ctx, 2, name)
        secret_path, stolen = k.secret_file(), k.out / "stolen.csv"
        query = query_of(str(secret_path), str(stolen))
        all_secrets.append(k.secret)
        step = Step("cypher", ["graphstore", "cypher", "--catalog", str(cat), *extra, query], expect=expect,
                    timeout=timeout, frozen=cat, one_line=True, check=check)
        attacks.append(k.attack(description, [step], canaries=[k.canary, stolen], catalogs=[], scan=[cat],
                                lane="main", live=engine.add(name, query, k.secret) if live else None))

    def load(s):
        return f"LOAD FROM '{s}' (header=false, delim=':', file_format='csv') RETURN *"

    walkarounds = {
        "limit_digit_load": ("LIMIT 1LOAD: the number's digits end the token, the keyword follows with no space",
                             lambda s, c: f"WITH 1 AS x LIMIT 1{load(s)}"),
        "limit_exponent_load": ("LIMIT 1e5LOAD", lambda s, c: f"WITH 1 AS x LIMIT 1e5{load(s)}"),
        "limit_float_load": ("LIMIT 1.0LOAD", lambda s, c: f"WITH 1 AS x LIMIT 1.0{load(s)}"),
        "skip_digit_load": ("SKIP 0LOAD", lambda s, c: f"WITH 1 AS x SKIP 0{load(s)}"),
        "limit_paren_load": ("LIMIT (1)LOAD", lambda s, c: f"WITH 1 AS x LIMIT (1){load(s)}"),
        "lowercase_limit_load": ("with ... limit 1load", lambda s, c: f"with 1 as x limit 1{load(s).lower()}"
                                 .replace(s.lower(), s)),
        "block_comment_load": ("LIMIT 1/* c */LOAD", lambda s, c: f"WITH 1 AS x LIMIT 1/* c */{load(s)}"),
        "line_comment_load": ("LIMIT 1// c<newline>LOAD", lambda s, c: f"WITH 1 AS x LIMIT 1// c\n{load(s)}"),
        "nbsp_load": ("LIMIT 1<U+00A0>LOAD", lambda s, c: f"WITH 1 AS x LIMIT 1\u00a0{load(s)}"),
        "em_space_load": ("LIMIT 1<U+2003>LOAD", lambda s, c: f"WITH 1 AS x LIMIT 1\u2003{load(s)}"),
        "ideographic_space_load": ("LIMIT 1<U+3000>LOAD", lambda s, c: f"WITH 1 AS x LIMIT 1\u3000{load(s)}"),
        "bom_then_load": ("a byte-order mark before the query", lambda s, c: f"\ufeffWITH 1 AS x LIMIT 1 {load(s)}"),
        "escaped_quote_hides_load": ("'a\\'' : a tokenizer without backslash escapes sees LOAD inside a string",
                                     lambda s, c: f"WITH 'a\\'' AS x LIMIT 1 {load(s)}"),
        "escaped_dquote_hides_load": ('"\\"" : the same with double quotes',
                                      lambda s, c: f'WITH "\\"" AS x LIMIT 1 {load(s)}'),
        "comment_quote_hides_load": ("/* ' */ : a tokenizer blind to comments sees LOAD inside a string",
                                     lambda s, c: f"WITH 1 AS x /* ' */ LIMIT 1 {load(s)}"),
        "line_comment_quote_hides_load": ("// ' : the same with a line comment",
                                          lambda s, c: f"WITH 1 AS x // '\nLIMIT 1 {load(s)}"),
        "backtick_quote_hides_load": ("`'` : a quote inside a back-quoted name",
                                      lambda s, c: f"WITH 1 AS `'` LIMIT 1 {load(s)}"),
        "string_comment_opener_hides_load": ("'/*' : a comment opener inside a string, closed after LOAD",
                                             lambda s, c: f"WITH '/*' AS x LIMIT 1 {load(s)} // */"),
    }
    for name, (what, query_of) in walkarounds.items():
        cypher(name, f"Cypher gate walk-around, {what}; the secret file outside the catalog must not be read.",
               query_of, live=True)
    writes = {
        "limit_hex_copy": lambda s, c: f"WITH 1 AS x LIMIT 0x1COPY (MATCH (m:Model) RETURN m.model_id) TO '{c}'",
        "limit_digit_copy": lambda s, c: f"MATCH (m:Model) WITH m LIMIT 1COPY (MATCH (m:Model) RETURN m.model_id) "
                                         f"TO '{c}'",
        "limit_digit_create": lambda s, c: "WITH 1 AS x LIMIT 1CREATE (:Zoo {name: 'zg_x'})",
        "limit_digit_merge": lambda s, c: "WITH 1 AS x LIMIT 1MERGE (:Zoo {name: 'zg_x'})",
        "limit_digit_set": lambda s, c: "MATCH (m:Model) WITH m LIMIT 1SET m.test_accuracy = 0.0123",
        "limit_digit_detach_delete": lambda s, c: "MATCH (m:Model) WITH m LIMIT 1DETACH DELETE m",
        "limit_digit_call_read_csv": lambda s, c: f"WITH 1 AS x LIMIT 1CALL read_csv_serial('{s}') RETURN *",
        "limit_exponent_call_setting": lambda s, c: "WITH 1 AS x LIMIT 1e5CALL threads = 1",
    }
    for name, query_of in writes.items():
        cypher(name, "Cypher gate walk-around: a write, COPY or CALL glued to a number.", query_of)
    cypher("unwind_billion_timeout_10",
           "UNWIND range(1, 1000000000) AS i RETURN count(i) with --timeout 10: stops on the memory limit or "
           "the timeout, exit 1, without gigabytes.",
           lambda s, c: "UNWIND range(1, 1000000000) AS i RETURN count(i)", extra=["--timeout", "10"], timeout=60)
    cypher("unwind_billion_default_timeout",
           "The same with the default --timeout (60 s).",
           lambda s, c: "UNWIND range(1, 1000000000) AS i RETURN count(i)", timeout=TIMEOUT)
    cypher("return_size_of_billion_range", "RETURN size(range(1, 1000000000)) with --timeout 10.",
           lambda s, c: "RETURN size(range(1, 1000000000))", extra=["--timeout", "10"], timeout=60)
    # option values: a one-line refusal (click's usage error, exit 2, is accepted)
    for command in ("cypher", "sql"):
        for value in ("nan", "inf", "-inf", "-1", "1e309", "NaN"):
            query = "RETURN 1" if command == "cypher" else "SELECT 1"
            cli = ["graphstore", "cypher"] if command == "cypher" else ["pipeline", "sql"]
            slug = value.replace("-", "minus_").replace(".", "_")
            k = _Kit(ctx, 2, f"{command}_timeout_{slug}")
            attacks.append(k.attack(f"{' '.join(cli)} --timeout {value}: refused in one line.",
                                    [Step("option", [*cli, "--catalog", str(cat), "--timeout", value, query],
                                          expect="usage", frozen=cat, one_line=True)],
                                    canaries=[], secrets=[], outside=[], catalogs=[], lane="main"))
    for value in ("-1GB", "nanGB", "infGB", "1e400GB", "-5%"):
        slug = value.replace("-", "minus_").replace("%", "pct").replace(".", "_")
        k = _Kit(ctx, 2, f"sql_memory_limit_{slug}")
        attacks.append(k.attack(f"pipeline sql --memory-limit {value}: refused in one line.",
                                [Step("option", ["pipeline", "sql", "--catalog", str(cat), "--memory-limit", value,
                                                 "SELECT 1"], expect="usage", frozen=cat, one_line=True)],
                                canaries=[], secrets=[], outside=[], catalogs=[], lane="main"))
    # afterwards: the catalog and its graph answer, unchanged
    k = _Kit(ctx, 2, "main_catalog_afterwards")

    def no_zoo_node(out: str) -> list[str]:
        return [] if re.search(r'"n":\s*0\b', out) else ["a Zoo node 'zg_x' exists, or the count failed"]

    def three_models(out: str) -> list[str]:
        return [] if re.search(r'"n":\s*3\b', out) else ["the graph no longer holds the 3 models"]

    attacks.append(k.attack(
        "After every query of the lane: pipeline sql and graphstore cypher still answer, the graph holds no "
        "node a query created and all its models, and no secret reached the catalog.",
        [Step("sql", ["pipeline", "sql", "--catalog", str(cat), "SELECT count(*) FROM models"], expect="ok",
              frozen=cat),
         Step("cypher_zoo", ["graphstore", "cypher", "--catalog", str(cat), "--format", "json",
                             "MATCH (z:Zoo) WHERE z.name = 'zg_x' RETURN count(z) AS n"], expect="ok", frozen=cat,
              check=no_zoo_node),
         Step("cypher_models", ["graphstore", "cypher", "--catalog", str(cat), "--format", "json",
                                "MATCH (m:Model) RETURN count(m) AS n"], expect="ok", frozen=cat,
              check=three_models)],
        canaries=[], secrets=all_secrets, outside=[], catalogs=[], scan=[cat], lane="main"))
    return attacks


# --------------------------------------------------------------------------
# 3. .pt2 dead nodes
# --------------------------------------------------------------------------
class _Graph:
    """The serialized program of a .pt2 archive, to add nodes to (in torch 2.2.1's schema)."""
    MEMBER = "serialized_exported_program.json"

    def __init__(self, pt2: bytes):
        self.pt2 = pt2
        with zipfile.ZipFile(io.BytesIO(pt2)) as z:
            self.member = next(n for n in z.namelist() if n.endswith(self.MEMBER))
            self.prog = json.loads(z.read(self.member))
        self.g = self.prog["graph_module"]["graph"]
        self.arg_template = self.g["nodes"][0]["inputs"][0]["arg"]
        self.meta_template = next(iter(self.g["tensor_values"].values()))
        self.sym_template = self.meta_template["sizes"][0]

    def arg(self, kind: str, value) -> dict:
        a = dict.fromkeys(self.arg_template)
        a[kind] = value
        return a

    def _sym(self, n: int) -> dict:
        s = dict.fromkeys(self.sym_template)
        s["as_int"] = n
        return s

    def node(self, target: str, inputs: list[tuple[str, str, object]], out: str, sizes: list[int],
             dtype: int = 7, layout: int = 7) -> str:
        """Append ``torch.ops.aten.<target>`` with ``inputs`` (name, as_kind, value) -> ``out``."""
        self.g["nodes"].append({"target": f"torch.ops.aten.{target}",
                                "inputs": [{"name": n, "arg": self.arg(kind, v)} for n, kind, v in inputs],
                                "outputs": [self.arg("as_tensor", {"name": out})], "metadata": {}})
        strides, acc = [], 1
        for n in reversed(sizes):
            strides.insert(0, acc)
            acc *= max(n, 1)
        meta = dict(self.meta_template)
        meta.update(dtype=dtype, layout=layout, sizes=[self._sym(n) for n in sizes],
                    strides=[self._sym(s) for s in strides], storage_offset=0)
        self.g["tensor_values"][out] = meta
        return out

    def output_name(self) -> str:
        return self.g["outputs"][0]["as_tensor"]["name"]

    def set_output(self, name: str) -> None:
        old = self.output_name()
        self.g["outputs"][0]["as_tensor"]["name"] = name
        for spec in self.prog["graph_module"]["signature"]["output_specs"]:
            arg = spec.get("user_output", {}).get("arg", {}).get("as_tensor")
            if arg and arg.get("name") == old:
                arg["name"] = name

    def bytes(self) -> bytes:
        out = io.BytesIO()
        _rewrite_zip(self.pt2, out, {self.MEMBER: json.dumps(self.prog).encode()})
        return out.getvalue()


_T = lambda name: ("as_tensor", {"name": name})  # noqa: E731
_GIB16 = 1 << 32        # float32 elements in 16 GiB


def _dead_sparse(g: _Graph) -> None:
    g.node("full.default", [("size", "as_ints", [1, 1]), ("fill_value", "as_int", _GIB16 - 1),
                            ("dtype", "as_scalar_type", 5)], "zg_idx", [1, 1], dtype=5)
    g.node("full.default", [("size", "as_ints", [1]), ("fill_value", "as_float", 1.0)], "zg_val", [1])
    g.node("_sparse_coo_tensor_with_dims_and_tensors.default",
           [("sparse_dim", "as_int", 1), ("dense_dim", "as_int", 0), ("size", "as_ints", [_GIB16]),
            ("indices", *_T("zg_idx")), ("values", *_T("zg_val")), ("dtype", "as_scalar_type", 7),
            ("layout", "as_layout", 1)], "zg_sparse", [_GIB16], layout=1)
    g.node("_to_dense.default", [("self", *_T("zg_sparse"))], "zg_dense", [_GIB16])


def _dead_full(g: _Graph) -> None:
    g.node("full.default", [("size", "as_ints", [65536, 65536]), ("fill_value", "as_float", 1.0)],
           "zg_full", [65536, 65536])


def _dead_arange(g: _Graph) -> None:
    g.node("arange.start_step", [("start", "as_int", 0), ("end", "as_int", _GIB16), ("step", "as_int", 1),
                                 ("dtype", "as_scalar_type", 7)], "zg_range", [_GIB16])


def _dead_expand_clone(g: _Graph) -> None:
    g.node("full.default", [("size", "as_ints", [1]), ("fill_value", "as_float", 1.0)], "zg_one", [1])
    g.node("expand.default", [("self", *_T("zg_one")), ("size", "as_ints", [65536, 65536])], "zg_wide",
           [65536, 65536])
    g.node("clone.default", [("self", *_T("zg_wide"))], "zg_copy", [65536, 65536])


def _live_zero_added(g: _Graph) -> None:
    """Not dead: 16 GiB of zeros, summed and added to the output (which it leaves unchanged), so
    dead-code elimination does not remove it."""
    out = g.output_name()
    sizes = [s["as_int"] for s in g.g["tensor_values"][out]["sizes"]]
    g.node("full.default", [("size", "as_ints", [65536, 65536]), ("fill_value", "as_float", 0.0)],
           "zg_zeros", [65536, 65536])
    g.node("sum.default", [("self", *_T("zg_zeros"))], "zg_sum", [])
    g.set_output(g.node("add.Tensor", [("self", *_T(out)), ("other", *_T("zg_sum"))], "zg_out", sizes))


_LIVE_PT2 = """
import resource, sys, torch
resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))
ep = torch.export.load(sys.argv[1])
try:
    ep(torch.randn(*{shape}))
    print("ran")
except BaseException as exc:
    print(type(exc).__name__, str(exc).splitlines()[0])
"""


def _live_pt2_alloc(path: Path) -> str:
    """Run the archive's program as torch does (under a 4 GiB address-space cap): it tries to
    allocate gigabytes."""
    r = _run_python(_LIVE_PT2.format(shape=_pt2_input_shape(path.read_bytes())), str(path))
    return "" if "allocate" in r.stdout + r.stderr else f"no allocation failure: {(r.stdout + r.stderr)[-300:]}"


def _pt2_input_shape(pt2: bytes) -> list[int]:
    g = _Graph(pt2)
    user = [s["user_input"]["arg"]["as_tensor"]["name"] for s in g.prog["graph_module"]["signature"]["input_specs"]
            if s.get("user_input")]
    return [d["as_int"] if d.get("as_int") is not None else 2 for d in g.g["tensor_values"][user[0]]["sizes"]]


def _class3(ctx: dict) -> list[Attack2]:
    attacks = []
    lane = _lanes(3)
    base = _export_bytes()          # torch.export.save of a small Sequential MLP (tests.hostile.corpus)
    variants = {
        "pt2_dead_sparse_to_dense": (_dead_sparse, "dead aten.full -> _sparse_coo_tensor_with_dims_and_tensors "
                                                   "(size 2^32) -> _to_dense: 16 GiB from two constants"),
        "pt2_dead_full_16GiB": (_dead_full, "a dead aten.full of 65536 x 65536"),
        "pt2_dead_arange_16GiB": (_dead_arange, "a dead aten.arange of 2^32 floats"),
        "pt2_dead_expand_clone": (_dead_expand_clone, "a dead full(1) -> expand(65536, 65536) -> clone"),
        "pt2_zero_block_added_to_output": (_live_zero_added, "16 GiB of zeros, summed into the output (not dead)"),
    }
    for name, (inject, what) in variants.items():
        k = _Kit(ctx, 3, name, shared=lane())
        g = _Graph(base)
        inject(g)
        path = k.zoo / "model.pt2"
        path.write_bytes(g.bytes())
        steps = [k.ingest()]
        if name == "pt2_dead_sparse_to_dense":
            steps.append(Step("convert", ["pipeline", "convert", str(path)]))
        shown = name in ("pt2_dead_sparse_to_dense", "pt2_zero_block_added_to_output")   # the others alike
        attacks.append(k.attack(f".pt2 (torch.export.save of an MLP) with {what}: ingest refuses it.", steps,
                                canaries=[], outside=[],
                                live=(lambda p=path: _live_pt2_alloc(p)) if shown else None))
    # the same architecture later: a refused program must not be what a later zoo's models run
    k = _Kit(ctx, 3, "pt2_hostile_program_then_same_architecture")
    members = sorted(ctx["pt2"].glob("*.pt2"))
    hostile_zoo, legit_zoo = k.zoo / "hostile", k.zoo / "legit"
    g = _Graph(members[0].read_bytes())
    _dead_full(g)
    _live_zero_added(g)
    hostile_zoo.mkdir(parents=True)
    (hostile_zoo / "hostile.pt2").write_bytes(g.bytes())
    shutil.copytree(ctx["pt2"], legit_zoo)
    merged = k.zoo / "merged" / "merged.pt2"
    merged.parent.mkdir()

    def pair() -> list[str]:
        r = run_process(["pipeline", "sql", "--catalog", str(k.cat), "--format", "json",
                         "SELECT model_id FROM models WHERE zoo = 'legit' ORDER BY checkpoint"], timeout=120)
        try:
            ids = [row["model_id"] for row in json.loads(r["stdout"])]
        except ValueError:
            ids = []
        return ["jobs", "merge", *(ids + ["missing-a", "missing-b"])[:2], "--method", "weights", "--points", "2",
                "--out", str(merged), "--catalog", str(k.cat)]

    attacks.append(k.attack(
        "A .pt2 of the pt2 MLP zoo's architecture with a dead 16 GiB aten.full and 16 GiB of zeros added to its "
        "output is ingested first (refused); then the legit zoo of that architecture is ingested, merged "
        "(jobs merge --method weights) and analysed (jobs layer-equivariance): no process may run the hostile "
        "program (memory cap, no crash).",
        [k.ingest("--zoo-name", "hostile", zoo=hostile_zoo),
         k.ingest("--zoo-name", "legit", zoo=legit_zoo, expect="ok"),
         Step("merge", pair, expect="ok", timeout=240),
         Step("layer_equivariance", ["jobs", "layer-equivariance", "--catalog", str(k.cat), "--where", "zoo = 'legit'",
                                     "--transform", "perm-input", "--samples", "8", "--summary-only"],
              expect="ok", timeout=240)],
        canaries=[], outside=[], live=lambda p=hostile_zoo / "hostile.pt2": _live_pt2_alloc(p)))
    return attacks


# --------------------------------------------------------------------------
# 4. metrics.csv with reserved column names
# --------------------------------------------------------------------------
def _class4(ctx: dict) -> list[Attack2]:
    attacks = []
    members = _mlp_members(ctx)
    variants = {
        "metrics_column__file": ["_file"],
        "metrics_column__rn": ["_rn"],
        "metrics_column_model_id": ["model_id"],
        "metrics_columns_reserved_mix": ["__index_level_0__", "_part", "_committed", "_row", "filename",
                                         "file_row_number", "architecture_id", "zoo", "source_path", "ingested_at"],
    }

    def sane(out: str) -> list[str]:
        try:
            row = json.loads(out[out.index("["):out.rindex("]") + 1])[0]
        except (ValueError, IndexError, KeyError):
            return ["the models view did not answer"]
        problems = []
        if row.get("bad_ids"):
            problems.append(f"{row['bad_ids']} model_id values are not content hashes")
        if row.get("dup"):
            problems.append(f"{row['dup']} duplicate model_id rows")
        if row.get("n") not in (1, 3):
            problems.append(f"{row.get('n')} models, expected 3 (or 1 if the zoo was refused)")
        return problems

    for name, columns in variants.items():
        k = _Kit(ctx, 4, name)
        names = []
        for i, src in enumerate(members[:2]):
            names.append(_copy_member(src, k.zoo).name)
        values = {"model_id": "evil", "architecture_id": "evil", "zoo": "evil", "source_path": "../evil",
                  "ingested_at": "1970-01-01", "filename": "/etc/passwd"}
        header = ["checkpoint", "test_accuracy", *columns]
        rows = [[n, "0.5", *(values.get(c, str(7 + j)) for j, c in enumerate(columns))] for n in names]
        (k.zoo / "metrics.csv").write_text("\n".join(",".join(r) for r in [header, *rows]) + "\n")
        second = k.zoo.parent / f"{name}__second"
        _copy_member(members[2], second)
        _metrics(second, [members[2].name])
        attacks.append(k.attack(
            f"metrics.csv with the column(s) {', '.join(columns)}: ingest renames them (exit 0, with a warning) or "
            "refuses the zoo (exit 1); afterwards a second zoo ingests, the models view answers with content-hash "
            "ids, and graphstore sync rebuilds.",
            [k.ingest(expect="either"),
             k.ingest(zoo=second, expect="ok"),
             Step("sql", ["pipeline", "sql", "--catalog", str(k.cat), "--format", "json",
                          "SELECT count(*) FILTER (WHERE NOT regexp_full_match(model_id, '[0-9a-f]{32}')) AS bad_ids, "
                          "count(*) - count(DISTINCT model_id) AS dup, count(*) AS n FROM models"],
                  expect="ok", check=sane),
             Step("sync", ["graphstore", "sync", "--catalog", str(k.cat)], expect="ok")],
            canaries=[], secrets=[], outside=[], catalogs=[]))
    return attacks


# --------------------------------------------------------------------------
# 5. symlinks out of the zoo
# --------------------------------------------------------------------------
def _class5(ctx: dict) -> list[Attack2]:
    attacks = []
    lane = _lanes(5)
    members = _mlp_members(ctx)
    pt2 = sorted(ctx["pt2"].glob("*.pt2"))[0]

    def kit(name):
        k = _Kit(ctx, 5, name, shared=lane())
        _copy_member(members[0], k.zoo, "good")
        return k

    def add(k, description, steps=None, **kw):
        attacks.append(k.attack(description + " The outside file must not be opened; the member is refused.",
                                steps or [k.ingest()], canaries=[], **kw))

    k = kit("symlink_pt2_absolute")
    shutil.copy(pt2, k.out / "x.pt2")
    (k.zoo / "m.pt2").symlink_to(k.out / "x.pt2")
    add(k, "zoo/m.pt2 -> /outside/x.pt2 (absolute link to a valid archive).")

    k = kit("symlink_pt2_relative")
    shutil.copy(pt2, k.out / "x.pt2")
    (k.zoo / "m.pt2").symlink_to(os.path.relpath(k.out / "x.pt2", k.zoo))
    add(k, "zoo/m.pt2 -> ../../outside/x.pt2 (relative link).")

    k = kit("symlink_safetensors")
    _copy_member(members[1], k.out, "x")
    shutil.copy(members[1].with_suffix(".json"), k.zoo / "m.json")
    (k.zoo / "m.safetensors").symlink_to(k.out / "x.safetensors")
    add(k, "zoo/m.safetensors -> outside (its JSON sidecar inside the zoo).")

    k = kit("symlink_sidecar_json")
    shutil.copy(members[1], k.zoo / "m.safetensors")
    doc = json.loads(members[1].with_suffix(".json").read_text())
    doc.setdefault("metadata", {})["note"] = k.secret
    (k.out / "x.json").write_text(json.dumps(doc))
    (k.zoo / "m.json").symlink_to(k.out / "x.json")
    add(k, "zoo/m.json (the sidecar) -> outside, holding a secret in its metadata.")

    k = kit("symlink_metrics_csv")
    (k.out / "metrics.csv").write_text(f"checkpoint,note\ngood.safetensors,{k.secret}\n")
    (k.zoo / "metrics.csv").symlink_to(k.out / "metrics.csv")
    add(k, "zoo/metrics.csv -> outside, holding a secret.")

    k = kit("symlink_member_folder")
    _copy_member(members[1], k.out / "dir", "m")
    (k.zoo / "sub").symlink_to(k.out / "dir", target_is_directory=True)
    add(k, "zoo/sub -> /outside/dir, a folder holding a checkpoint and its sidecar.")

    k = kit("symlink_to_dev_zero")
    shutil.copy(members[1].with_suffix(".json"), k.zoo / "m.json")
    (k.zoo / "m.safetensors").symlink_to("/dev/zero")
    add(k, "zoo/m.safetensors -> /dev/zero (an endless file outside the zoo).", outside=[])

    k = kit("symlink_metrics_to_dev_zero")
    (k.zoo / "metrics.csv").symlink_to("/dev/zero")
    add(k, "zoo/metrics.csv -> /dev/zero.", outside=[])

    k = kit("symlink_dangling")
    shutil.copy(members[1].with_suffix(".json"), k.zoo / "m.json")
    (k.zoo / "m.safetensors").symlink_to(k.out / "missing.safetensors")
    add(k, "zoo/m.safetensors -> a path that does not exist.")

    k = kit("symlink_loop_folder")
    (k.zoo / "loop").symlink_to(".", target_is_directory=True)
    attacks.append(k.attack("zoo/loop -> . (a folder cycle inside the zoo): no hang; the good member ingests or "
                            "the loop is refused.", [k.ingest(expect="either")], canaries=[]))

    if _have_transformers():
        hf = ctx["hf"]

        def hf_kit(name):
            k = _Kit(ctx, 5, name, shared=lane())
            shutil.copytree(hf / "vit_00", k.zoo / "vit_00")
            return k

        def hf_metrics(k, names):
            (k.zoo / "metrics.csv").write_text("model,test_accuracy\n" + "".join(f"{n},0.5\n" for n in names))

        k = hf_kit("symlink_hf_safetensors")
        shutil.copytree(hf / "gpt2_00", k.out / "gpt2")
        (k.zoo / "m").mkdir()
        shutil.copy(hf / "gpt2_00" / "config.json", k.zoo / "m" / "config.json")
        (k.zoo / "m" / "model.safetensors").symlink_to(k.out / "gpt2" / "model.safetensors")
        hf_metrics(k, ["vit_00", "m"])
        add(k, "HF member m whose model.safetensors -> outside.", [k.ingest("--format", "hf-folders")])

        k = hf_kit("symlink_hf_config")
        (k.zoo / "m").mkdir()
        doc = json.loads((hf / "gpt2_00" / "config.json").read_text())
        doc["zg_note"] = k.secret
        (k.out / "config.json").write_text(json.dumps(doc))
        (k.zoo / "m" / "config.json").symlink_to(k.out / "config.json")
        shutil.copy(hf / "gpt2_00" / "model.safetensors", k.zoo / "m" / "model.safetensors")
        hf_metrics(k, ["vit_00", "m"])
        add(k, "HF member m whose config.json -> outside (with a secret field).", [k.ingest("--format", "hf-folders")])

        k = hf_kit("symlink_hf_member_folder")
        shutil.copytree(hf / "gpt2_00", k.out / "gpt2")
        (k.zoo / "m").symlink_to(k.out / "gpt2", target_is_directory=True)
        hf_metrics(k, ["vit_00", "m"])
        add(k, "HF member folder m -> /outside/gpt2.", [k.ingest("--format", "hf-folders")])

    k = _Kit(ctx, 5, "symlink_small_cnn_weights", shared=lane())
    shutil.copytree(ctx["scz"], k.zoo, dirs_exist_ok=True)
    (k.zoo / "weights.npy").rename(k.out / "weights.npy")
    (k.zoo / "weights.npy").symlink_to(k.out / "weights.npy")
    add(k, "Small CNN Zoo whose weights.npy -> outside.", [k.ingest("--format", "small-cnn-zoo")])

    k = _Kit(ctx, 5, "symlink_model_zoos_checkpoint", shared=lane())
    shutil.copytree(ctx["mz"], k.zoo, dirs_exist_ok=True)
    ckpt = sorted(k.zoo.rglob("checkpoint_000001/checkpoints"))[0]
    ckpt.rename(k.out / "checkpoints")
    ckpt.symlink_to(k.out / "checkpoints")
    add(k, "Model Zoos trial whose checkpoint_000001/checkpoints -> outside.", [k.ingest("--format", "model-zoos")])

    # a relative zoo path: the message names the path as given, not joined twice
    for name, link, label in (("symlink_relative_zoo_path_pt2", "m.pt2", "z/x/m.pt2"),
                              ("symlink_relative_zoo_path_folder", "sub", "z/x/sub")):
        k = _Kit(ctx, 5, name, shared=lane())
        zoo = k.zoo / "z" / "x"
        _copy_member(members[0], zoo, "good")
        if link == "m.pt2":
            shutil.copy(pt2, k.out / "x.pt2")
            (zoo / link).symlink_to(k.out / "x.pt2")
        else:
            _copy_member(members[1], k.out / "dir", "m")
            (zoo / link).symlink_to(k.out / "dir", target_is_directory=True)

        def names_it(out: str, label=label) -> list[str]:
            problems = []
            if label not in out:
                problems.append(f"the message does not name {label}")
            if "z/x/z/x" in out:
                problems.append("the message joins the zoo path twice (z/x/z/x)")
            return problems

        add(k, f"`cd parent; pipeline ingest z/x` where z/x/{link} links outside.",
            [Step("ingest", ["pipeline", "ingest", "z/x", "--catalog", str(k.cat)], cwd=k.zoo, check=names_it)])
    return attacks


# --------------------------------------------------------------------------
# 6. readers without bounds
# --------------------------------------------------------------------------
class _Pickle:
    """Pickle opcodes written by hand, for data.pkl files torch.save never writes."""

    def __init__(self, protocol: int = 2):
        self.out = bytearray(b"\x80" + bytes([protocol]))

    def op(self, code: bytes) -> "_Pickle":
        self.out += code
        return self

    def glob(self, module: str, name: str) -> "_Pickle":
        return self.op(b"c" + f"{module}\n{name}\n".encode())

    def stack_glob(self, module: str, name: str) -> "_Pickle":      # protocol 4: dotted names resolve
        return self.str(module).str(name).op(b"\x93")

    def str(self, s: str) -> "_Pickle":
        b = s.encode()
        return self.op(b"X" + struct.pack("<I", len(b)) + b)

    def int(self, n: int) -> "_Pickle":
        if -2 ** 31 <= n < 2 ** 31:
            return self.op(b"J" + struct.pack("<i", n))
        b = n.to_bytes((n.bit_length() + 8) // 8, "little", signed=True)
        return self.op(b"\x8a" + bytes([len(b)]) + b)

    def item(self, x) -> "_Pickle":
        if callable(x):
            x(self)
        elif x is None:
            self.op(b"N")
        elif isinstance(x, bool):
            self.op(b"\x88" if x else b"\x89")
        elif isinstance(x, int):
            self.int(x)
        elif isinstance(x, str):
            self.str(x)
        elif isinstance(x, tuple):
            self.tuple(*x)
        else:
            raise TypeError(x)
        return self

    def tuple(self, *items) -> "_Pickle":
        self.op(b"(")
        for x in items:
            self.item(x)
        return self.op(b"t")

    def tensor(self, key: str, numel: int, offset: int, size: tuple, stride: tuple,
               storage: str = "FloatStorage") -> "_Pickle":
        """``torch._utils._rebuild_tensor_v2`` of storage ``key`` as torch.save writes it."""
        self.glob("torch._utils", "_rebuild_tensor_v2").op(b"(")
        self.tuple("storage", lambda p: p.glob("torch", storage), key, "cpu", numel).op(b"Q")
        self.int(offset).tuple(*size).tuple(*stride).op(b"\x89")
        self.glob("collections", "OrderedDict").op(b")R")
        return self.op(b"tR")

    def state_dict(self, entries: list[tuple[str, str, int, int, tuple, tuple]]) -> "_Pickle":
        self.op(b"}(")
        for name, key, numel, offset, size, stride in entries:
            self.str(name).tensor(key, numel, offset, size, stride)
        return self.op(b"u")

    def bytes(self) -> bytes:
        return bytes(self.out + b".")


def _state_of(member: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return load_file(str(member))


def _legit_pt(member: Path) -> tuple[bytes, list[tuple[str, str, int, int, tuple, tuple]]]:
    """torch.save bytes of a real member's state dict, and the entries its data.pkl holds
    (name, storage key, numel, offset, size, stride), storages keyed 0, 1, ... in order."""
    import torch

    state = {k: torch.from_numpy(v.copy()) for k, v in _state_of(member).items()}
    entries = [(k, str(i), v.numel(), 0, tuple(v.shape), tuple(v.stride())) for i, (k, v) in enumerate(state.items())]
    return _torch_save_bytes(state), entries


def _pt_with(pt: bytes, data_pkl: bytes) -> bytes:
    out = io.BytesIO()
    _rewrite_zip(pt, out, {"data.pkl": data_pkl})
    return out.getvalue()


_BOMBS: dict[tuple[int, int], tuple[bytes, int, int]] = {}


def _repeat_deflate(chunk: bytes, reps: int) -> tuple[bytes, int, int]:
    """A raw deflate stream of ``chunk`` repeated ``reps`` times (each copy a self-contained
    full-flush block, so the stream is small), its CRC-32 and its inflated size."""
    key = (zlib.crc32(chunk[:4096]) ^ len(chunk), reps)
    if key not in _BOMBS:
        comp = zlib.compressobj(9, zlib.DEFLATED, -15)
        block = comp.compress(chunk) + comp.flush(zlib.Z_FULL_FLUSH)
        crc = 0
        for _ in range(reps):
            crc = zlib.crc32(chunk, crc)
        _BOMBS[key] = (block * reps + zlib.compressobj(9, zlib.DEFLATED, -15).flush(), crc, reps * len(chunk))
    return _BOMBS[key]


def _zip_members(pt: bytes) -> list[tuple[str, bytes]]:
    with zipfile.ZipFile(io.BytesIO(pt)) as z:
        return [(n, z.read(n)) for n in z.namelist()]


def _pt_bomb(pt: bytes, suffix: str, lying: bool) -> bytes:
    """The archive with member ``*suffix`` replaced by 2 GiB of zeros, deflated; ``lying``: its
    directory declares the member's real size, only the stream inflates to 2 GiB."""
    stream, crc, usize = _repeat_deflate(bytes(16 << 20), 128)
    members = []
    for name, data in _zip_members(pt):
        if name.endswith(suffix):
            members.append((name, stream, 8, crc if not lying else zlib.crc32(data), len(data) if lying else usize))
        else:
            members.append(_stored(name, data))
    fd, name = tempfile.mkstemp(suffix=".pt")
    os.close(fd)
    try:
        _raw_zip(Path(name), members)
        return Path(name).read_bytes()
    finally:
        os.unlink(name)


def _gzip_repeat(head: bytes, chunk: bytes, reps: int) -> bytes:
    """A gzip file of ``head`` then ``chunk`` ``reps`` times, a few MB for gigabytes."""
    comp = zlib.compressobj(9, zlib.DEFLATED, -15)
    first = comp.compress(head) + comp.flush(zlib.Z_FULL_FLUSH)
    comp = zlib.compressobj(9, zlib.DEFLATED, -15)
    block = comp.compress(chunk) + comp.flush(zlib.Z_FULL_FLUSH)
    crc = zlib.crc32(head)
    for _ in range(reps):
        crc = zlib.crc32(chunk, crc)
    last = zlib.compressobj(9, zlib.DEFLATED, -15).flush()
    size = len(head) + reps * len(chunk)
    return (b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x02\xff" + first + block * reps + last
            + struct.pack("<II", crc, size & 0xFFFFFFFF))


def _npy_header(descr: str, fortran: bool, shape: tuple) -> bytes:
    d = "{'descr': %r, 'fortran_order': %r, 'shape': %r, }" % (descr, fortran, tuple(shape))
    pad = 64 - (10 + len(d) + 1) % 64
    h = (d + " " * pad + "\n").encode()
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(h)) + h


_LIVE_STRIDE0 = """
import sys, torch
sd = torch.load(sys.argv[1], weights_only=True)
print(max(v.numel() * v.element_size() for v in sd.values()), sum(v.untyped_storage().nbytes() for v in sd.values()))
"""


def _live_stride0(path: Path) -> str:
    r = _run_python(_LIVE_STRIDE0, str(path))
    try:
        dense, stored = map(int, r.stdout.split()[-2:])
    except ValueError:
        return f"did not load: {(r.stdout + r.stderr)[-300:]}"
    return "" if dense > MEMORY_CAP and stored < 1024 else f"dense {dense} bytes from {stored} stored"


def _class6(ctx: dict) -> list[Attack2]:
    import torch

    attacks = []
    lane = _lanes(6)
    members = _mlp_members(ctx)

    def add(k, description, steps=None, **kw):
        kw.setdefault("canaries", [])
        kw.setdefault("outside", [])
        kw.setdefault("secrets", [])
        attacks.append(k.attack(description, steps or [k.ingest()], **kw))

    # torch.save zips
    k = _Kit(ctx, 6, "pt_stride0_65536_squared", shared=lane())
    n = 65536
    spec = {"format": "zoograph.spec/1", "input_shape": [n], "layers": [{"type": "linear", "out_features": n}]}
    (k.zoo / "m.pt").write_bytes(_torch_save_bytes({"layers.0.weight": torch.zeros(1).expand(n, n),
                                                    "layers.0.bias": torch.zeros(1).expand(n)}))
    (k.zoo / "m.json").write_text(json.dumps({"architecture": spec}))
    add(k, "torch.save of a 65536 x 65536 weight that is one float with strides 0 (16 GiB dense, 8 bytes "
           "stored), with a sidecar spec of exactly that linear layer.",
        live=lambda p=k.zoo / "m.pt": _live_stride0(p))

    pt, entries = _legit_pt(members[0])
    at = next(i for i, e in enumerate(entries) if len(e[4]) == 2)      # the first weight matrix
    name, key, numel, _, size, stride = entries[at]
    rows, cols = size
    crafted = {
        "pt_stride0_rewritten": ("data.pkl rewritten: layers.0.weight of size 2^20 x 2^20 with strides 0 over its "
                                 "storage", (name, key, numel, 0, (1 << 20, 1 << 20), (0, 0))),
        "pt_storage_offset_2_40": ("layers.0.weight at storage offset 2^40", (name, key, numel, 1 << 40, size, stride)),
        "pt_size_beyond_storage": ("layers.0.weight of 1000x the rows its storage holds (an out-of-bounds view)",
                                   (name, key, numel, 0, (rows * 1000, cols), stride)),
        "pt_negative_stride": ("layers.0.weight with stride (-cols, 1) (reads before the storage)",
                               (name, key, numel, 0, size, (-cols, 1))),
        "pt_negative_size": ("layers.0.weight of size (-rows, cols)", (name, key, numel, 0, (-rows, cols), stride)),
        "pt_storage_numel_2_40": ("storage declared 2^40 elements, data/0 holding a few hundred bytes",
                                  (name, key, 1 << 40, 0, size, stride)),
    }
    for attack_name, (what, entry) in crafted.items():
        k = _Kit(ctx, 6, attack_name, shared=lane())
        data = _Pickle().state_dict([*entries[:at], entry, *entries[at + 1:]]).bytes()
        (k.zoo / "m.pt").write_bytes(_pt_with(pt, data))
        shutil.copy(members[0].with_suffix(".json"), k.zoo / "m.json")
        add(k, f"A real MLP's .pt whose data.pkl is rewritten: {what}.")
    for suffix, label in (("data/0", "data/0"), ("byteorder", "byteorder")):
        for lying in (False, True):
            k = _Kit(ctx, 6, f"pt_deflate_bomb_{label.replace('/', '')}_{'lying' if lying else 'honest'}",
                     shared=lane())
            (k.zoo / "m.pt").write_bytes(_pt_bomb(pt, suffix, lying))
            shutil.copy(members[0].with_suffix(".json"), k.zoo / "m.json")
            add(k, f"A real MLP's .pt whose {label} member is 2 GiB of zeros deflated to ~2 MB"
                   + ("; the zip directory declares the member's real (small) size" if lying else
                      ", declared honestly") + ".")
    # Small CNN Zoo
    scz = ctx["scz"]
    rows_n = int(np.load(scz / "weights.npy", mmap_mode="r").shape[0])

    def scz_kit(name):
        k = _Kit(ctx, 6, name, shared=lane())
        shutil.copytree(scz, k.zoo, dirs_exist_ok=True)
        return k

    import gzip
    metrics_head = gzip.decompress((scz / "metrics.csv.gz").read_bytes()).split(b"\n")[0] + b"\n"
    k = scz_kit("scz_metrics_gz_one_2GiB_row")
    (k.zoo / "metrics.csv.gz").write_bytes(_gzip_repeat(metrics_head + b"0,", b"1" * (16 << 20), 128))
    add(k, "Small CNN Zoo metrics.csv.gz (~2 MB) that inflates to a header and one row of 2 GiB.",
        [k.ingest("--format", "small-cnn-zoo")])
    k = scz_kit("scz_metrics_gz_2GiB_of_rows")
    row = gzip.decompress((scz / "metrics.csv.gz").read_bytes()).split(b"\n")[1] + b"\n"
    (k.zoo / "metrics.csv.gz").write_bytes(_gzip_repeat(metrics_head, row * ((16 << 20) // len(row)), 128))
    add(k, "Small CNN Zoo metrics.csv.gz that inflates to 2 GiB of valid rows (millions of checkpoints).",
        [k.ingest("--format", "small-cnn-zoo")])
    for name, header, extend in (
            ("scz_weights_400M_columns", (rows_n, 400_000_000), True),
            ("scz_weights_4G_columns", (rows_n, 4_000_000_000), True),
            ("scz_weights_2_62_rows", (1 << 62, 4970), False)):
        k = scz_kit(name)
        head = _npy_header("<f4", False, header)
        size = len(head) + header[0] * header[1] * 4 if extend else len(head) + 4970 * 4
        _sparse(k.zoo / "weights.npy", head, size)
        add(k, f"Small CNN Zoo weights.npy declaring shape {header}" + (
            f", a sparse file of {size / 2 ** 30:.0f} GiB." if extend else ", holding one row."),
            [k.ingest("--format", "small-cnn-zoo")])
    for value in ("inf", "nan", "-16"):
        slug = {"inf": "inf", "nan": "nan", "-16": "negative"}[value]
        k = scz_kit(f"scz_layout_start_{slug}")
        text = (scz / "layout.csv").read_text()
        (k.zoo / "layout.csv").write_text(text.replace("kernel:0,16,160", f"kernel:0,{value},160"))
        add(k, f"Small CNN Zoo layout.csv whose conv2d kernel start_idx is {value}.",
            [k.ingest("--format", "small-cnn-zoo")])
    # Model Zoos
    for name, filename in (("mz_result_json_1GiB", "result.json"),):
        k = _Kit(ctx, 6, name, shared=lane())
        shutil.copytree(ctx["mz"], k.zoo, dirs_exist_ok=True)
        target = sorted(k.zoo.rglob(filename))[0]
        _sparse(target, target.read_bytes(), 1 << 30)
        add(k, f"Model Zoos trial whose {filename} is its real content then zeros up to 1 GiB (sparse).",
            [k.ingest("--format", "model-zoos")])
    # this project's format
    k = _Kit(ctx, 6, "metrics_csv_sparse_8GiB", shared=lane())
    names = [_copy_member(m, k.zoo).name for m in members[:2]]
    _sparse(k.zoo / "metrics.csv", ("checkpoint,test_accuracy\n" + "".join(f"{n},0.5\n" for n in names)).encode(),
            8 << 30)
    add(k, "metrics.csv of two real rows then zeros up to 8 GiB (sparse).")
    k = _Kit(ctx, 6, "sidecar_json_sparse_2GiB", shared=lane())
    _copy_member(members[0], k.zoo, "m")
    _sparse(k.zoo / "m.json", (k.zoo / "m.json").read_bytes(), 2 << 30)
    add(k, "A checkpoint's JSON sidecar: its real content then zeros up to 2 GiB (sparse).")
    k = _Kit(ctx, 6, "safetensors_sparse_16GiB", shared=lane())
    weight, bias = 4 * n * n, 4 * n
    header = json.dumps({"layers.0.weight": {"dtype": "F32", "shape": [n, n], "data_offsets": [0, weight]},
                         "layers.0.bias": {"dtype": "F32", "shape": [n], "data_offsets": [weight, weight + bias]}}
                        ).encode()
    header += b" " * (-len(header) % 8)
    _sparse(k.zoo / "m.safetensors", struct.pack("<Q", len(header)) + header, 8 + len(header) + weight + bias)
    (k.zoo / "m.json").write_text(json.dumps({"architecture": spec}))
    add(k, "A 65536 x 65536 linear layer in a valid safetensors file of 16 GiB (sparse), with its spec.")
    if _have_transformers():
        k = _Kit(ctx, 6, "hf_config_sparse_1GiB", shared=lane())
        shutil.copytree(ctx["hf"] / "gpt2_00", k.zoo / "m")
        _sparse(k.zoo / "m" / "config.json", (k.zoo / "m" / "config.json").read_bytes(), 1 << 30)
        (k.zoo / "metrics.csv").write_text("model,test_accuracy\nm,0.5\n")
        add(k, "HF member whose config.json is its real content then zeros up to 1 GiB (sparse).",
            [k.ingest("--format", "hf-folders")])
    return attacks


# --------------------------------------------------------------------------
# 7. hangs
# --------------------------------------------------------------------------
def _dynamic_pt2() -> bytes:
    """torch.export.save of the corpus's MLP exported with a dynamic batch (symbol s0), made
    loadable the way tests.hostile.corpus does (nn_module_stack entries dropped)."""
    import torch
    from torch.export import Dim

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    ep = torch.export.export(model, (torch.randn(2, 4),), dynamic_shapes={"input": {0: Dim("batch", min=2, max=1024)}})
    buf = io.BytesIO()
    torch.export.save(ep, buf)
    g = _Graph(buf.getvalue())
    for node in g.g["nodes"]:
        node["metadata"].pop("nn_module_stack", None)
    return g.bytes()


def _pt2_text(pt2: bytes, edit: Callable[[str], str]) -> bytes:
    g = _Graph(pt2)
    out = io.BytesIO()
    _rewrite_zip(pt2, out, {g.MEMBER: edit(json.dumps(g.prog)).encode()})
    return out.getvalue()


def _pt2_edit(pt2: bytes, edit: Callable[[_Graph], None]) -> bytes:
    g = _Graph(pt2)
    edit(g)
    return g.bytes()


_LIVE_LOAD = """
import sys, torch
torch.export.load(sys.argv[1])
print("loaded")
"""


def _live_hang(path: Path, seconds: float = 6) -> str:
    """torch.export.load itself does not finish within ``seconds``."""
    try:
        r = _run_python(_LIVE_LOAD, str(path), timeout=seconds)
    except subprocess.TimeoutExpired:
        return ""
    return f"torch.export.load finished: {(r.stdout + r.stderr)[-200:]}"


def _deep_treespec(depth: int) -> str:
    spec = '{"type": null, "context": null, "children_spec": []}'
    return ("[1, " + '{"type": "builtins.tuple", "context": "null", "children_spec": [' * depth + spec
            + "]}" * depth + "]")


def _class7(ctx: dict) -> list[Attack2]:
    attacks = []
    lane = _lanes(7)
    dyn, static = _dynamic_pt2(), _export_bytes()
    nest = 40_000

    def pt2(name, description, data, live=None, expect="refused"):
        k = _Kit(ctx, 7, name, shared=lane())
        path = k.zoo / "model.pt2"
        path.write_bytes(data)
        attacks.append(k.attack(description, [k.ingest(expect=expect)], canaries=[], outside=[], secrets=[],
                                live=(lambda: live(path)) if live else None))

    pt2("pt2_sym_size_9_pow_9_pow_9",
        "Dynamic-batch .pt2 whose symbolic sizes read 9**9**9 (plain arithmetic; evaluating it takes forever).",
        _pt2_text(dyn, lambda t: t.replace('"expr_str": "s0"', '"expr_str": "9**9**9"')), live=_live_hang)
    pt2("pt2_range_constraint_9_pow_9_pow_9",
        "Dynamic-batch .pt2 whose range constraint is keyed 9**9**9 (and the sizes name it).",
        _pt2_text(dyn, lambda t: t.replace('"s0"', '"9**9**9"')), live=_live_hang)
    pt2("pt2_range_max_5000_digits",
        "Dynamic-batch .pt2 whose range constraint's max_val is an integer of 5,000 digits.",
        _pt2_text(dyn, lambda t: re.sub(r'"max_val": \d+', '"max_val": ' + "9" * 5000, t)))
    pt2("pt2_sym_size_100000_parentheses",
        "Dynamic-batch .pt2 whose symbolic size is s0 inside 100,000 parentheses.",
        _pt2_text(dyn, lambda t: t.replace('"expr_str": "s0"', '"expr_str": "' + "(" * 100_000 + "s0"
                                           + ")" * 100_000 + '"')))

    def module_stack(value_of):
        def edit(g: _Graph) -> None:
            for node in g.g["nodes"]:
                node["metadata"]["nn_module_stack"] = value_of()
        return edit

    deep_getattr = "getattr(" * nest + "L['fn']" + ", '0')" * nest
    pt2("pt2_module_stack_40000_getattr",
        f"A .pt2 whose nn_module_stack path is {nest:,} nested getattr( calls (as torch writes them, with commas).",
        _pt2_edit(static, module_stack(lambda: f"fn_0,{deep_getattr},torch.nn.modules.linear.Linear")))
    pt2("pt2_module_stack_40000_getattr_no_commas",
        f"The same path with {nest:,} nested getattr( and no commas (parses as one entry).",
        _pt2_edit(static, module_stack(lambda: "fn_0," + "getattr(" * nest + "L" + ")" * nest
                                       + ",torch.nn.modules.linear.Linear")))
    pt2("pt2_module_stack_40000_entries",
        f"A .pt2 whose nn_module_stack holds {nest:,} entries: read or refused (exit 0 or 1), within the "
        "timeout and the memory cap.",
        _pt2_edit(static, module_stack(lambda: ";".join(f"m{i},m{i},torch.nn.modules.container.Sequential"
                                                        for i in range(nest)))), expect="either")

    def source_fn(g: _Graph) -> None:
        for node in g.g["nodes"]:
            node["metadata"]["source_fn_stack"] = "fn_0," + deep_getattr
    pt2("pt2_source_fn_stack_40000_getattr", f"A .pt2 whose source_fn_stack is {nest:,} nested getattr( calls.",
        _pt2_edit(static, source_fn))

    def in_spec(g: _Graph) -> None:
        g.prog["graph_module"]["module_call_graph"][0]["signature"]["in_spec"] = _deep_treespec(nest)
    pt2("pt2_in_spec_40000_deep", f"A .pt2 whose module call graph's in_spec is a tree {nest:,} tuples deep.",
        _pt2_edit(static, in_spec))

    def deep_json(g: _Graph) -> None:
        g.g["nodes"][0]["metadata"]["zg_deep"] = "ZG_DEEP"
    pt2("pt2_json_100000_deep", "A .pt2 whose program JSON nests a list 100,000 deep in a node's metadata.",
        _pt2_text(_pt2_edit(static, deep_json), lambda t: t.replace('"ZG_DEEP"', "[" * 100_000 + "]" * 100_000)))
    # FIFOs where files are expected: opening one for reading waits for a writer forever
    members = _mlp_members(ctx)
    for name, what in (("fifo_safetensors_member", "m.safetensors"), ("fifo_pt2_member", "m.pt2"),
                       ("fifo_metrics_csv", "metrics.csv"), ("fifo_sidecar_json", "m.json")):
        k = _Kit(ctx, 7, name, shared=lane())
        _copy_member(members[0], k.zoo, "good")
        if what == "m.json":
            shutil.copy(members[1], k.zoo / "m.safetensors")
        elif what == "m.safetensors":
            shutil.copy(members[1].with_suffix(".json"), k.zoo / "m.json")
        os.mkfifo(k.zoo / what)
        attacks.append(k.attack(f"zoo/{what} is a FIFO (no writer): ingest must not wait on it.",
                                [k.ingest()], canaries=[], outside=[], secrets=[]))
    if _have_transformers():
        k = _Kit(ctx, 7, "fifo_hf_config", shared=lane())
        shutil.copytree(ctx["hf"] / "vit_00", k.zoo / "vit_00")
        (k.zoo / "m").mkdir()
        shutil.copy(ctx["hf"] / "gpt2_00" / "model.safetensors", k.zoo / "m" / "model.safetensors")
        os.mkfifo(k.zoo / "m" / "config.json")
        (k.zoo / "metrics.csv").write_text("model,test_accuracy\nvit_00,0.5\nm,0.5\n")
        attacks.append(k.attack("HF member whose config.json is a FIFO.", [k.ingest("--format", "hf-folders")],
                                canaries=[], outside=[], secrets=[]))
    return attacks


# --------------------------------------------------------------------------
# 8. state poisoning
# --------------------------------------------------------------------------
def _poison(kind: str) -> _Pickle:
    """A data.pkl prefix that changes torch's own globals through allowed globals, then POPs."""
    p = _Pickle(4 if kind in ("dotted_func_globals", "code_swap") else 2)
    if kind == "defaults_of_rebuild_tensor_v2":         # setattr(_rebuild_tensor_v2, '__defaults__', ...)
        p.glob("torch._utils", "_rebuild_tensor_v2").op(b"(N}").str("__defaults__").tuple("zg-poison").op(b"stb0")
    elif kind == "module_dict_of_torch_utils":          # BUILD on the module torch._utils: its __dict__
        p.glob("torch", "_utils").op(b"}").str("_rebuild_tensor").glob("collections", "OrderedDict").op(b"sb0")
    elif kind == "dotted_func_globals":                 # _rebuild_tensor_v2.__globals__['_rebuild_tensor'] = ...
        p.stack_glob("torch._utils", "_rebuild_tensor_v2.__globals__").str("_rebuild_tensor")
        p.stack_glob("collections", "OrderedDict").op(b"s0")
    elif kind == "code_swap":                           # _rebuild_tensor_v2.__code__ = _rebuild_parameter.__code__
        p.stack_glob("torch._utils", "_rebuild_tensor_v2").op(b"(N}").str("__code__")
        p.stack_glob("torch._utils", "_rebuild_parameter.__code__").op(b"stb0")
    elif kind == "storage_class_dtype":                 # setattr(torch.FloatStorage, 'dtype', 'zg-poison')
        p.glob("torch", "FloatStorage").op(b"(N}").str("dtype").str("zg-poison").op(b"stb0")
    elif kind == "ordereddict_class_attribute":         # setattr(OrderedDict, '__getitem__', ...)
        p.glob("collections", "OrderedDict").op(b"(N}").str("__getitem__").glob("collections", "OrderedDict")
        p.op(b"stb0")
    else:
        raise ValueError(kind)
    return p


_LIVE_POISON = """
import io, pickle, sys, warnings, zipfile, torch
warnings.simplefilter("ignore")
hostile, good = sys.argv[1:]
z = zipfile.ZipFile(hostile)
class Plain(pickle.Unpickler):
    def persistent_load(self, pid):
        return torch.UntypedStorage(1 << 12)
try:
    Plain(io.BytesIO(z.read(next(n for n in z.namelist() if n.endswith("data.pkl"))))).load()
except Exception:
    pass
try:
    torch.load(good, weights_only=True)
    print("good read")
except Exception as exc:
    print("POISONED", type(exc).__name__, exc)
f = torch._utils._rebuild_tensor_v2
if f.__defaults__ != (None,) or f.__code__.co_name != "_rebuild_tensor_v2":
    print("POISONED torch._utils._rebuild_tensor_v2")
if getattr(torch._utils._rebuild_tensor, "__name__", "") != "_rebuild_tensor":
    print("POISONED torch._utils._rebuild_tensor")
if torch.FloatStorage.dtype != torch.float32:
    print("POISONED torch.FloatStorage.dtype", torch.FloatStorage.dtype)
"""

_PROBE = """
import json, sys, warnings
import numpy as np
warnings.simplefilter("ignore")
from pipeline.checkpoints import load_state_dict
hostile, good, expected = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
problems = []
try:
    load_state_dict(hostile)
    problems.append("the hostile data.pkl was read without an error")
    first = "accepted"
except Exception as exc:
    first = type(exc).__name__
try:
    sd = load_state_dict(good)
    for key, (shape, total) in expected.items():
        v = sd[key]
        v = np.asarray(v.detach().cpu().numpy() if hasattr(v, "detach") else v, dtype=np.float64)
        if list(v.shape) != shape or abs(float(v.sum()) - total) > 1e-5 * max(1.0, abs(total)):
            problems.append(f"{key} reads different values after the hostile file")
except Exception as exc:
    problems.append(f"the good checkpoint no longer reads: {type(exc).__name__}: {str(exc)[:200]}")
import torch, torch._utils
f = torch._utils._rebuild_tensor_v2
if f.__defaults__ != (None,) or f.__code__.co_name != "_rebuild_tensor_v2":
    problems.append("torch._utils._rebuild_tensor_v2 was changed")
if getattr(torch._utils._rebuild_tensor, "__name__", "") != "_rebuild_tensor":
    problems.append("torch._utils._rebuild_tensor was replaced")
try:
    if torch.FloatStorage.dtype != torch.float32:
        problems.append("torch.FloatStorage.dtype was changed")
except Exception:
    problems.append("torch.FloatStorage.dtype was changed")
import collections
if collections.OrderedDict.__getitem__ is collections.OrderedDict:
    problems.append("collections.OrderedDict was changed")
print("; ".join(problems) if problems else f"clean: the hostile file was refused ({first}), the good one reads")
sys.exit(1 if problems else 0)
"""


def _class8(ctx: dict) -> list[Attack2]:
    attacks = []
    members = _mlp_members(ctx)
    hostile_pt, entries = _legit_pt(members[0])
    good_pt, _ = _legit_pt(members[1])
    expected = {k: [list(v.shape), float(v.astype(np.float64).sum())] for k, v in _state_of(members[1]).items()}
    lane = _lanes(8)
    kinds = {
        "defaults_of_rebuild_tensor_v2": "BUILD on torch._utils._rebuild_tensor_v2 with slot state "
                                         "{'__defaults__': ('zg-poison',)}: every later tensor gets metadata",
        "module_dict_of_torch_utils": "GLOBAL torch _utils (the module) then BUILD with a dict: the module's "
                                      "globals get _rebuild_tensor = OrderedDict",
        "dotted_func_globals": "protocol-4 STACK_GLOBAL of '_rebuild_tensor_v2.__globals__' then SETITEM "
                               "_rebuild_tensor = OrderedDict",
        "code_swap": "BUILD on _rebuild_tensor_v2 with __code__ = _rebuild_parameter.__code__ (a dotted "
                     "STACK_GLOBAL)",
        "storage_class_dtype": "BUILD on torch.FloatStorage with slot state {'dtype': 'zg-poison'}",
        "ordereddict_class_attribute": "BUILD on collections.OrderedDict with slot state {'__getitem__': "
                                       "OrderedDict} (the type is immutable: expected to fail in any unpickler)",
    }
    for kind, what in kinds.items():
        k = _Kit(ctx, 8, f"poison_{kind}", shared=lane())
        hostile = k.zoo / "a_hostile.pt"
        good = k.zoo / "b_good.pt"
        hostile.write_bytes(_pt_with(hostile_pt, bytes(_poison(kind).out) + _Pickle(2).state_dict(entries)
                                     .bytes()[2:]))
        shutil.copy(members[0].with_suffix(".json"), k.zoo / "a_hostile.json")
        good.write_bytes(good_pt)
        shutil.copy(members[1].with_suffix(".json"), k.zoo / "b_good.json")
        _metrics(k.zoo, [hostile.name, good.name])

        def good_ingested(out: str) -> list[str]:
            problems = []
            if not re.search(r"\b1 new models?\b|\b1 already in the catalog\b", out):
                problems.append("the good checkpoint after the hostile one was not ingested")
            if "FAILED a_hostile.pt" not in out or "FAILED b_good.pt" in out:
                problems.append("not exactly the hostile checkpoint failed")
            return problems

        attacks.append(k.attack(
            f"data.pkl payload: {what}; then a good checkpoint in the same process. Ingest of both refuses the "
            "hostile one and ingests the good one; read in one process with pipeline.checkpoints.load_state_dict, "
            "the good one reads its own values and torch's globals are intact.",
            [k.ingest(check=good_ingested),
             Step("same_process", [PY, "-c", _PROBE, str(hostile), str(good), json.dumps(expected)], expect="ok")],
            canaries=[], outside=[], secrets=[],
            live=(lambda h=hostile, g=good: _live_poison(h, g)) if kind != "ordereddict_class_attribute" else None))
    return attacks


def _live_poison(hostile: Path, good: Path) -> str:
    r = _run_python(_LIVE_POISON, str(hostile), str(good))
    return "" if "POISONED" in r.stdout else f"torch still reads the good file: {(r.stdout + r.stderr)[-200:]}"


# --------------------------------------------------------------------------
# a control: the checks see a leak
# --------------------------------------------------------------------------
def control_attack(work: Path) -> Attack2:
    """A leak on purpose, to show the checks see one: ``graphstore cypher --write`` (which lifts
    the gate, for administrators) runs LOAD FROM on a secret file outside the catalog. Its
    outcome must not be clean: the secret is printed and the file outside is opened."""
    ctx = _context(Path(work))
    k = _Kit(ctx, 0, "control_write_load_from_secret")
    secret = k.secret_file()
    step = Step("cypher", ["graphstore", "cypher", "--catalog", str(ctx["catalog"]), "--write",
                           f"LOAD FROM '{secret}' (header=false, delim=':', file_format='csv') RETURN *"],
                expect="refused")
    return k.attack("control", [step], canaries=[], catalogs=[])


# --------------------------------------------------------------------------
# build
# --------------------------------------------------------------------------
BUILDERS = {1: _class1, 2: _class2, 3: _class3, 4: _class4, 5: _class5, 6: _class6, 7: _class7, 8: _class8}


def build_round2(work: Path, classes: tuple[int, ...] = tuple(BUILDERS)) -> list[Attack2]:
    """Write the shared material and every hostile file under ``work``; return the attacks."""
    ctx = _context(Path(work))
    _make_base(ctx)
    for folder in ("zoos", "cats", "outside", "canaries"):        # a rebuild starts from the shared material
        if ctx[folder].exists():
            shutil.rmtree(ctx[folder])
    attacks = []
    for klass in classes:
        attacks += BUILDERS[klass](ctx)
    names = [a.name for a in attacks]
    assert len(names) == len(set(names)), "attack names must be unique"
    return attacks
