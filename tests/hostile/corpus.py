"""Builder for a small corpus of hostile "checkpoint" files.

Every file here is something a stranger could publish next to (or as) a model
checkpoint.  Tests ingest the corpus with the project's own loaders and assert
that no canary file appears and that nothing crashes or hangs.

``build(out, canary_dir)`` writes the files and returns :class:`Attack` records.
``fire(attack)`` loads one attack the *unsafe* way in a fresh interpreter and
reports whether its payload ran, which proves the payload is live.

Payloads are harmless: each one can only create its own empty canary file.
Run ``python -m tests.hostile.corpus`` (or this file) for a self-check.
"""
from __future__ import annotations

import io
import json
import os
import pickle
import random
import struct
import subprocess
import sys
import tempfile
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Tuple

import numpy as np
import torch
from safetensors.numpy import save_file


@dataclass
class Attack:
    name: str            # short unique id, e.g. "torchscript_pt"
    kind: str            # "checkpoint" | "metrics" | "sidecar" | "artifact"
    path: Path           # the hostile file written under out/
    canary: Path | None  # exists only if the payload's code ran
    description: str


# --------------------------------------------------------------------------
# payload makers
# --------------------------------------------------------------------------
class _ScriptPayload(torch.nn.Module):
    """TorchScript module whose ``__setstate__`` (run by torch.jit.load)
    calls ``torch.from_file(canary, shared=True)``, which creates the file."""

    def __init__(self, canary: str):
        super().__init__()
        self.canary = canary
        self.numel = 0

    @torch.jit.export
    def __getstate__(self) -> Tuple[str, bool]:
        return (self.canary, self.training)

    @torch.jit.export
    def __setstate__(self, state: Tuple[str, bool]) -> None:
        self.canary = state[0]
        self.training = state[1]
        # assigned, else TorchScript dead-code-eliminates the call
        self.numel = torch.from_file(state[0], True, 8).numel()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


class _ReducePayload:
    """Pickles to a call of ``open(canary, 'w')``: unpickling creates it."""

    def __init__(self, canary: Path):
        self.canary = str(canary)

    def __reduce__(self):
        return (open, (self.canary, "w"))


def _torchscript_bytes(canary: Path) -> bytes:
    buf = io.BytesIO()
    torch.jit.save(torch.jit.script(_ScriptPayload(str(canary))), buf)
    return buf.getvalue()


def _torch_save_bytes(obj) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _tiny_state_dict() -> dict:
    return {"0.weight": np.zeros((2, 2), dtype=np.float32)}


# --------------------------------------------------------------------------
# zip helpers
# --------------------------------------------------------------------------
def _rewrite_zip(src: bytes, dst, replace: dict[str, bytes]) -> None:
    """Copy zip ``src`` to ``dst`` with fixed timestamps; members whose name
    ends with a key of ``replace`` get that key's bytes instead."""
    with zipfile.ZipFile(io.BytesIO(src)) as zin, zipfile.ZipFile(dst, "w") as zout:
        for name in zin.namelist():
            data = zin.read(name)
            for suffix, new in replace.items():
                if name.endswith(suffix):
                    data = new
            zout.writestr(zipfile.ZipInfo(name), data)


def _raw_zip(dst: Path, members: list[tuple[str, bytes, int, int, int]]) -> None:
    """Write a zip by hand. members: (name, stored_bytes, method, crc32,
    uncompressed_size).  No name sanitising at all, unlike ``zipfile``."""
    date = (0 << 9) | (1 << 5) | 1  # 1980-01-01
    local, central = io.BytesIO(), io.BytesIO()
    for name, data, method, crc, usize in members:
        raw = name.encode()
        offset = local.tell()
        local.write(struct.pack("<4s5H3L2H", b"PK\x03\x04", 20, 0, method, 0, date,
                                crc, len(data), usize, len(raw), 0) + raw + data)
        central.write(struct.pack("<4s6H3L5H2L", b"PK\x01\x02", 20, 20, 0, method, 0,
                                  date, crc, len(data), usize, len(raw), 0, 0, 0, 0,
                                  0, offset) + raw)
    cd = central.getvalue()
    eocd = struct.pack("<4s4H2LH", b"PK\x05\x06", 0, 0, len(members), len(members),
                       len(cd), local.tell(), 0)
    dst.write_bytes(local.getvalue() + cd + eocd)


def _stored(name: str, data: bytes):
    return (name, data, 0, zlib.crc32(data), len(data))


def _zero_bomb(total_mib: int, chunk_mib: int = 16) -> tuple[bytes, int, int]:
    """Raw deflate stream of ``total_mib`` MiB of zeros, built by compressing
    one chunk with a full flush (self-contained blocks) and repeating it."""
    chunk = bytes(chunk_mib << 20)
    comp = zlib.compressobj(9, zlib.DEFLATED, -15)
    block = comp.compress(chunk) + comp.flush(zlib.Z_FULL_FLUSH)
    reps = total_mib // chunk_mib
    crc = 0
    for _ in range(reps):
        crc = zlib.crc32(chunk, crc)
    final = zlib.compressobj(9, zlib.DEFLATED, -15).flush()  # empty last block
    return block * reps + final, crc, reps * len(chunk)


# --------------------------------------------------------------------------
# pt2 (torch.export) helpers
# --------------------------------------------------------------------------
def _export_bytes() -> bytes:
    """A real torch.export .pt2 of a tiny Sequential, made loadable: torch 2.2.1
    writes nn_module_stack entries like "getattr(L['fn'], '0')" whose comma
    breaks its own deserializer, so those metadata entries are dropped."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    ep = torch.export.export(model, (torch.randn(1, 4),))
    buf = io.BytesIO()
    torch.export.save(ep, buf)
    member = "serialized_exported_program.json"
    with zipfile.ZipFile(buf) as z:
        name = next(n for n in z.namelist() if n.endswith(member))
        prog = json.loads(z.read(name))
    for node in prog["graph_module"]["graph"]["nodes"]:
        node["metadata"].pop("nn_module_stack", None)
    out = io.BytesIO()
    _rewrite_zip(buf.getvalue(), out, {member: json.dumps(prog).encode()})
    return out.getvalue()


def _graph_with_from_file(pt2: bytes, canary: Path) -> bytes:
    """Rewrite the ReLU node of the exported graph into
    ``torch.ops.aten.from_file.default(canary, shared=True, size=8)``."""
    with zipfile.ZipFile(io.BytesIO(pt2)) as z:
        member = next(n for n in z.namelist() if n.endswith("serialized_exported_program.json"))
        prog = json.loads(z.read(member))
    node = next(n for n in prog["graph_module"]["graph"]["nodes"]
                if n["target"] == "torch.ops.aten.relu.default")
    template = node["inputs"][0]["arg"]

    def arg(key, value):
        a = {k: None for k in template}
        a[key] = value
        return a

    node["target"] = "torch.ops.aten.from_file.default"
    node["inputs"] = [{"name": "filename", "arg": arg("as_string", str(canary))},
                      {"name": "shared", "arg": arg("as_bool", True)},
                      {"name": "size", "arg": arg("as_int", 8)}]
    return json.dumps(prog).encode()


# --------------------------------------------------------------------------
# build
# --------------------------------------------------------------------------
def build(out: Path, canary_dir: Path) -> list[Attack]:
    """Write every hostile file under ``out`` (one subfolder per attack) and
    return the attacks.  Canaries are paths in ``canary_dir`` (not created)."""
    out, canary_dir = Path(out), Path(canary_dir)
    canary_dir.mkdir(parents=True, exist_ok=True)
    attacks: list[Attack] = []

    def add(name, kind, filename, canary, description, data=None) -> Path:
        path = out / name / filename
        path.parent.mkdir(parents=True, exist_ok=True)
        if data is not None:
            path.write_bytes(data)
        attacks.append(Attack(name, kind, path, canary, description))
        return path

    def can(name):
        return canary_dir / f"{name}.canary"

    c = can("torchscript_pt")
    add("torchscript_pt", "checkpoint", "model.pt", c,
        "TorchScript archive; __setstate__ calls torch.from_file(canary, shared=True). "
        "torch.load(weights_only=True) dispatches it to torch.jit.load.", _torchscript_bytes(c))

    pt2 = _export_bytes()
    for part in ("state_dict", "constants"):
        name = f"torchscript_in_pt2_{part}"
        _rewrite_zip(pt2, add(name, "checkpoint", "model.pt2", can(name),
                              f"torch.export .pt2 whose serialized_{part}.json member is a "
                              "TorchScript archive; torch.export.load torch.load()s it."),
                     {f"serialized_{part}.json": _torchscript_bytes(can(name))})

    c = can("pickle_reduce_pt")
    add("pickle_reduce_pt", "checkpoint", "model.pt", c,
        "torch.save zip whose data.pkl holds a __reduce__ -> open(canary, 'w').",
        _torch_save_bytes({"0.weight": torch.zeros(2, 2), "x": _ReducePayload(c)}))

    c = can("legacy_pickle_pt")
    add("legacy_pickle_pt", "checkpoint", "model.pth", c,
        "Plain (non-zip) pickle with a __reduce__ -> open(canary, 'w').",
        pickle.dumps({"state_dict": _ReducePayload(c)}, protocol=2))

    c = can("pickle_in_pt2_state_dict")
    _rewrite_zip(pt2, add("pickle_in_pt2_state_dict", "checkpoint", "model.pt2", c,
                          ".pt2 whose serialized_state_dict.json is torch.save bytes with a "
                          "__reduce__ payload (torch.export.load uses torch.load's default "
                          "weights_only=False in torch 2.2.1)."),
                 {"serialized_state_dict.json": _torch_save_bytes({"x": _ReducePayload(c)})})

    c = can("pt2_graph_calls_torch_function")
    _rewrite_zip(pt2, add("pt2_graph_calls_torch_function", "checkpoint", "model.pt2", c,
                          ".pt2 whose graph has the ReLU node replaced by "
                          "torch.ops.aten.from_file.default(canary, shared=True, size=8); "
                          "torch.export.load accepts it (verifier passes); running ep.module() creates "
                          "the canary, then fails on the next node."),
                 {"serialized_exported_program.json": _graph_with_from_file(pt2, c)})

    add("safetensors_header_bomb", "checkpoint", "model.safetensors", None,
        "safetensors whose 8-byte header length claims 2**40 bytes.",
        struct.pack("<Q", 2 ** 40) + b'{"a":')

    path = add("safetensors_truncated", "checkpoint", "model.safetensors", None,
               "Valid safetensors header for a 64x64 float32 tensor; data cut to 100 bytes.")
    save_file({"0.weight": np.ones((64, 64), dtype=np.float32)}, str(path))
    raw = path.read_bytes()
    path.write_bytes(raw[: 8 + struct.unpack("<Q", raw[:8])[0] + 100])

    bomb, crc, usize = _zero_bomb(1280)
    _raw_zip(add("zip_bomb_pt", "checkpoint", "model.pt", None,
                 f"torch.save-layout zip whose deflated archive/data.pkl expands to "
                 f"{usize >> 20} MiB of zeros ({len(bomb) >> 10} KiB on disk)."),
             [("archive/data.pkl", bomb, 8, crc, usize),
              _stored("archive/byteorder", b"little"), _stored("archive/version", b"3\n")])

    folder = out / "zip_path_traversal_pt"
    abs_target = canary_dir / "zip_path_traversal_abs.canary"
    with zipfile.ZipFile(io.BytesIO(_torch_save_bytes({"0.weight": torch.zeros(2, 2)}))) as z:
        members = [_stored(n, z.read(n)) for n in z.namelist()]
    members += [_stored("../../escape.txt", b"escaped\n"), _stored(str(abs_target), b"escaped\n")]
    _raw_zip(add("zip_path_traversal_pt", "checkpoint", "model.pt",
                 Path(os.path.normpath(folder / "../../escape.txt")),
                 "torch.save zip with extra members '../../escape.txt' and the absolute "
                 f"'{abs_target}'; canary is where naive extraction next to the "
                 "checkpoint would write the relative one."), members)

    for name, depth in (("deep_json_sidecar", 5000), ("wide_message_sidecar", 400)):
        path = add(name, "sidecar", "model.json", None,
                   f"State dict model.safetensors with a model.json whose 'architecture' "
                   f"is a list nested {depth} levels deep.")
        save_file(_tiny_state_dict(), str(path.with_name("model.safetensors")))
        path.write_text('{"architecture": ' + "[" * depth + "]" * depth + "}")

    path = add("metrics_unterminated_quote", "metrics", "metrics.csv", None,
               "metrics.csv beside a/b/c.safetensors; the b row opens a double quote "
               "that never closes, so a naive CSV reader swallows the c row.")
    for stem in "abc":
        save_file(_tiny_state_dict(), str(path.with_name(f"{stem}.safetensors")))
    path.write_text('file,test_accuracy\na.safetensors,0.5\n"b.safetensors,0.6\n'
                    'c.safetensors,0.7\n')

    c = can("artifact_torchscript")
    add("artifact_torchscript", "artifact", "metanet-0.pt", c,
        "A trained run's weight file that is really a TorchScript archive with a "
        "__setstate__ payload (torch.load(weights_only=True) runs it).", _torchscript_bytes(c))

    junk = random.Random(0).randbytes(4096)
    add("not_a_zip_pt2", "checkpoint", "model.pt2", None,
        "4 KiB of random bytes named model.pt2.", b"XX" + junk[2:])
    return attacks


# --------------------------------------------------------------------------
# fire: load the attack the unsafe way in a fresh interpreter
# --------------------------------------------------------------------------
_PT2_MEMBER = ("import zipfile\nz = zipfile.ZipFile(p)\n"
               "m = next(n for n in z.namelist() if n.endswith('serialized_state_dict.json'))\n"
               "torch.load(io.BytesIO(z.read(m)), weights_only=False)\n")
_NAIVE_EXTRACT = ("import zipfile, os\nz = zipfile.ZipFile(p)\n"
                  "for n in z.namelist():\n"
                  "    if n.startswith('/') or '..' in n.split('/'):\n"
                  "        open(os.path.join(os.path.dirname(p), n), 'wb').write(z.read(n))\n")
_UNSAFE = {
    "torchscript_pt": "torch.load(p, weights_only=True)",
    "artifact_torchscript": "torch.load(p, weights_only=True)",
    "torchscript_in_pt2_state_dict": "torch.export.load(p)",
    "torchscript_in_pt2_constants": "torch.export.load(p)",
    "pickle_reduce_pt": "torch.load(p, weights_only=False)",
    "legacy_pickle_pt": "pickle.load(open(p, 'rb'))",
    "pickle_in_pt2_state_dict": _PT2_MEMBER,
    "pt2_graph_calls_torch_function": "torch.export.load(p).module()(torch.randn(1, 4))",
    "zip_path_traversal_pt": _NAIVE_EXTRACT,
}


def fire(attack: Attack, timeout: float = 300) -> bool:
    """Load ``attack`` the unsafe way in a subprocess; True if its canary appeared.

    An existing canary is removed first.  Exceptions in the loader are
    swallowed (a payload may run before the load fails).  The path-traversal
    attack is "fired" by a naive extractor that writes only its hostile members.
    """
    if attack.canary is None or attack.name not in _UNSAFE:
        raise ValueError(f"{attack.name} has no code-execution payload to fire")
    attack.canary.unlink(missing_ok=True)
    body = "\n".join("    " + line for line in _UNSAFE[attack.name].splitlines())
    code = (f"import io, pickle, warnings, torch\nwarnings.simplefilter('ignore')\n"
            f"p = {str(attack.path)!r}\ntry:\n{body}\nexcept BaseException:\n    pass\n")
    subprocess.run([sys.executable, "-c", code], timeout=timeout, check=False,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return attack.canary.exists()


if __name__ == "__main__":
    import time
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        built = build(Path(tmp) / "out", Path(tmp) / "canaries")
        print(f"built {len(built)} attacks in {time.perf_counter() - t0:.1f}s")
        for a in built:
            size = a.path.stat().st_size
            live = fire(a) if a.canary is not None else None
            print(f"{a.name:32} {a.kind:10} {size:>9} B  live={live}")
