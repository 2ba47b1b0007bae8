"""A real Neo4j Community 5.26 server for tests and benchmarks, assembled from Maven Central.

``build_classpath()`` runs Maven once and caches the jars in ``~/.cache/zoograph/neo4j-<version>``
(override with ZOOGRAPH_NEO4J_CACHE); ``Neo4jServer`` starts ``CommunityEntryPoint`` on a free
loopback port with Bolt only, no auth, and stops it on exit. Needs Java 17+ and Maven.
"""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path

from zoocore.errors import StoreError

VERSION = "5.26.19"
POM = Path(__file__).with_name("pom.xml")
JVM_FLAGS = ["-Xms256m", "-Xmx768m", "-XX:+UseG1GC", "-Dio.netty.tryReflectionSetAccessible=true",
             "-Dlog4j2.disable.jmx=true",
             "--add-opens=java.base/java.nio=ALL-UNNAMED", "--add-opens=java.base/sun.nio.ch=ALL-UNNAMED",
             "--add-opens=java.base/java.io=ALL-UNNAMED", "--add-opens=java.base/java.util.concurrent=ALL-UNNAMED"]


def cache_dir() -> Path:
    base = os.environ.get("ZOOGRAPH_NEO4J_CACHE") or Path.home() / ".cache" / "zoograph"
    return Path(base) / f"neo4j-{VERSION}"


def build_classpath(quiet: bool = True, timeout: float = 900) -> Path:
    """The folder of Neo4j jars, built with Maven on first use. Raises StoreError if it cannot."""
    target = cache_dir()
    lib = target / "lib"
    if (lib / ".complete").exists():
        return lib
    for tool in ("java", "mvn"):
        if shutil.which(tool) is None:
            raise StoreError(f"building the Neo4j test server needs `{tool}` on PATH (Java 17+ and Maven)")
    target.mkdir(parents=True, exist_ok=True)
    shutil.copy(POM, target / "pom.xml")
    tmp = target / "lib.partial"
    shutil.rmtree(tmp, ignore_errors=True)
    cmd = ["mvn", "-B", "-f", str(target / "pom.xml"), "dependency:copy-dependencies",
           f"-DoutputDirectory={tmp}", "-DincludeScope=runtime"] + (["-q"] if quiet else [])
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise StoreError("Maven could not assemble Neo4j: " + (proc.stdout + proc.stderr)[-2000:])
    shutil.rmtree(lib, ignore_errors=True)
    os.rename(tmp, lib)
    (lib / ".complete").write_text(VERSION)
    return lib


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Neo4jServer:
    """``with Neo4jServer() as server: server.uri`` -> ``bolt://127.0.0.1:PORT`` (auth disabled)."""

    def __init__(self, port: int | None = None, startup_timeout: float = 180.0):
        self.port = port or free_port()
        self.uri = f"bolt://127.0.0.1:{self.port}"
        self.startup_timeout = startup_timeout
        self._proc: subprocess.Popen | None = None
        self._home: str | None = None
        self.log: list[str] = []

    def start(self) -> "Neo4jServer":
        lib = build_classpath()
        self._home = tempfile.mkdtemp(prefix="zoograph-neo4j-")
        settings = {
            "server.bolt.enabled": "true", "server.bolt.listen_address": f"127.0.0.1:{self.port}",
            "server.bolt.advertised_address": f"127.0.0.1:{self.port}", "server.bolt.tls_level": "DISABLED",
            "server.http.enabled": "false", "server.https.enabled": "false",
            "dbms.security.auth_enabled": "false", "server.memory.pagecache.size": "128m",
            "dbms.usage_report.enabled": "false", "server.jvm.additional": "-XX:+UseG1GC",
            # a query may not read the server's files (LOAD CSV FROM 'file:///...') nor take its memory
            "dbms.security.allow_csv_import_from_file_urls": "false",
            "db.memory.transaction.max": "512m",
        }
        cmd = ["java", *JVM_FLAGS, "-cp", f"{lib}/*", "org.neo4j.server.CommunityEntryPoint",
               f"--home-dir={self._home}", "--console-mode"]
        for k, v in settings.items():
            cmd += ["-c", f"{k}={v}"]
        self._proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        ready = threading.Event()

        def pump():
            assert self._proc is not None and self._proc.stdout is not None
            for line in self._proc.stdout:
                self.log.append(line.rstrip())
                if line.rstrip().endswith("Started."):
                    ready.set()

        threading.Thread(target=pump, daemon=True).start()
        deadline = time.monotonic() + self.startup_timeout
        while not ready.wait(0.5):
            if self._proc.poll() is not None or time.monotonic() > deadline:
                tail = "\n".join(self.log[-30:])
                self.stop()
                raise StoreError(f"Neo4j did not start on {self.uri}:\n{tail}")
        return self

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(30)
            except subprocess.TimeoutExpired:
                self._proc.kill()
        self._proc = None
        if self._home:
            shutil.rmtree(self._home, ignore_errors=True)
            self._home = None

    def __enter__(self) -> "Neo4jServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
