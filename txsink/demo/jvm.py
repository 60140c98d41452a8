"""A faster start for the demo job's Spark JVM: a class-data archive made once, reused.

The demo and the end-to-end tests crash the job on purpose and start it again, dozens of
times; each start of a local Spark driver spends about 6 s loading and compiling classes
before its first batch. Two JVM options halve that (measured on 2 cores, Java 17, pyspark
4.x: 12.1 s from import to a stopped session with a first Python task, 6.4 s with both):

- an application class-data sharing archive (``-XX:SharedArchiveFile``, JDK 13+) holding
  the classes a Spark start loads, written once by a short warm-up run
  (``-XX:ArchiveClassesAtExit``) and keyed by the Java version, the pyspark version and
  its jars, so an upgrade makes a new one;
- the client compiler only (``-XX:TieredStopAtLevel=1``): the demo's batches are small,
  and C2 compilations of start-up code are never paid back.

The options reach the job process through :data:`JAVA_OPTIONS_ENV`, which the job turns
into ``spark.driver.extraJavaOptions``. Nothing here changes what the job writes; when an
archive cannot be made (no Java 13+, the warm-up failed) the job starts as before and the
reason is returned for the caller to print.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

JAVA_OPTIONS_ENV = "TXSINK_JOB_JAVA_OPTIONS"
COMPILER = "-XX:TieredStopAtLevel=1"

_WARM_UP = """
import sys
from pyspark.sql import SparkSession
spark = (
    SparkSession.builder.master("local[2]")
    .config("spark.ui.enabled", "false")
    .config("spark.sql.shuffle.partitions", "2")
    .config("spark.driver.extraJavaOptions", sys.argv[1])
    .getOrCreate()
)
spark.sparkContext.setLogLevel("ERROR")
spark.range(100).count()
spark.range(100).mapInArrow(lambda batches: batches, "id long").count()
spark.range(100).write.mode("overwrite").parquet(sys.argv[2])
query = (
    spark.readStream.schema("id long").parquet(sys.argv[2]).writeStream
    .trigger(availableNow=True).foreachBatch(lambda df, batch: df.count()).start()
)
query.awaitTermination()
spark.stop()
"""


def _java() -> str | None:
    home = os.environ.get("JAVA_HOME")
    if home and os.access(os.path.join(home, "bin", "java"), os.X_OK):
        return os.path.join(home, "bin", "java")
    return shutil.which("java")


def _java_version(java: str) -> tuple[int, str]:
    out = subprocess.run(
        [java, "-version"], check=False, capture_output=True, text=True, timeout=60
    )
    text = out.stderr + out.stdout
    found = re.search(r'version "(\d+)(?:\.(\d+))?', text)
    if not found:
        return 0, text
    major = int(found.group(1))
    return (int(found.group(2) or 0) if major == 1 else major), text


def _loads(java: str, archive: Path) -> bool:
    """A JVM starts with ``archive`` (a truncated or foreign one makes it abort)."""
    probe = subprocess.run(
        [java, f"-XX:SharedArchiveFile={archive}", "-version"],
        check=False, capture_output=True, timeout=60,
    )  # fmt: skip
    return probe.returncode == 0


def _key(java_text: str) -> str:
    import pyspark

    jars = Path(pyspark.__file__).parent / "jars"
    names = sorted(p.name for p in jars.glob("*.jar")) if jars.is_dir() else []
    blob = "\n".join([java_text, pyspark.__version__, *names])
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def startup_options(directory: str | Path, *, timeout: float = 300) -> tuple[str, str]:
    """``(java options, note)`` for a fast job start, making the archive in ``directory``
    when it is missing. The options are ``""`` when no archive can be used; the note says
    what was done or why not."""
    java = _java()
    if java is None:
        return "", "no java on PATH or JAVA_HOME: job JVMs start without a class-data archive"
    major, text = _java_version(java)
    if major < 13:
        return COMPILER, f"Java {major or '?'} has no dynamic class-data archives (13+ needed)"
    folder = Path(directory)
    folder.mkdir(parents=True, exist_ok=True)
    archive = folder / f"spark-{_key(text)}.jsa"
    # one maker at a time: a second process waits for the first's archive and reuses it
    with open(folder / ".make.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _made(java, archive, folder, timeout)


def _made(java: str, archive: Path, folder: Path, timeout: float) -> tuple[str, str]:
    """:func:`startup_options` once the maker's lock is held."""
    if archive.exists():
        if _loads(java, archive):
            return f"-XX:SharedArchiveFile={archive} {COMPILER}", f"reused {archive}"
        archive.unlink(missing_ok=True)  # damaged: a JVM given it would not start; remade
    partial = folder / f"{archive.name}.{os.getpid()}.partial"
    with tempfile.TemporaryDirectory(prefix="txsink-jvm-") as work:
        env = dict(os.environ, PYSPARK_PYTHON=os.environ.get("PYSPARK_PYTHON", sys.executable))
        env.pop(JAVA_OPTIONS_ENV, None)
        try:
            done = subprocess.run(
                [sys.executable, "-c", _WARM_UP, f"-XX:ArchiveClassesAtExit={partial}",
                 str(Path(work) / "rows")],
                check=False, env=env, capture_output=True, text=True, timeout=timeout,
            )  # fmt: skip
        except subprocess.TimeoutExpired:
            partial.unlink(missing_ok=True)
            return COMPILER, f"the class-data warm-up took over {timeout:.0f} s: not used"
    if done.returncode != 0 or not partial.exists() or not _loads(java, partial):
        partial.unlink(missing_ok=True)
        return COMPILER, f"the class-data warm-up failed: {done.stderr.strip()[-300:]}"
    os.replace(partial, archive)  # atomic: a reader sees no archive or a whole one
    return f"-XX:SharedArchiveFile={archive} {COMPILER}", f"made {archive}"


def enable(directory: str | Path) -> str:
    """Export the fast-start options for job processes started from here on (unless the
    caller already chose some); returns the note of :func:`startup_options`."""
    if JAVA_OPTIONS_ENV in os.environ:
        return f"{JAVA_OPTIONS_ENV} already set: kept"
    options, note = startup_options(directory)
    if options:
        os.environ[JAVA_OPTIONS_ENV] = options
    return note
