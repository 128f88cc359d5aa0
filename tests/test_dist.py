"""``make dist`` and the install from its wheel (docs/operations.md, "Install").

One wheel and sdist are built per test run (``python -m build``, as ``make
dist`` runs it: the sdist first, the wheel from the sdist).  The install
runs the step docs/operations.md gives (``scripts/install-venv.sh``) with a
prefix and a units directory in a temporary directory instead of
``/opt/replicator`` and ``/etc/systemd/system``: a clean virtualenv of
the system's Python, the wheel and its dependencies from pip's usual
sources (its cache first), the units written for that prefix and checked by
``systemd-analyze verify``, then an instance started from the installed
console script, outside the checkout, answering ``/health``.
"""

import atexit
import configparser
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import zipfile

from twisted.trial.unittest import SynchronousTestCase

import replicator
from tests.daemon import SECRET, Daemon, base_config, http
from tests.operations_doc import doc_block
from tests.servers import free_port, unavailable
from tests.systemd_units import SERVICES, UNITS, settings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VERSION = replicator.__version__

_built: tuple[str, str] | None = None


def built() -> tuple[str, str]:
    """``(wheel, sdist)`` paths, built once per test run."""
    global _built
    if _built is None:
        if importlib.util.find_spec("build") is None:  # the test extra
            unavailable("the build module is not installed (pip install -e '.[test]')")
        out = tempfile.mkdtemp(prefix="replicator-dist-")
        atexit.register(shutil.rmtree, out, True)
        result = subprocess.run([sys.executable, "-m", "build", "--outdir", out, ROOT],
                                capture_output=True, text=True, timeout=300)
        if result.returncode != 0:
            raise AssertionError(f"python -m build failed:\n{result.stdout[-3000:]}"
                                 f"{result.stderr[-3000:]}")
        names = os.listdir(out)
        wheel = [n for n in names if n.endswith(".whl")]
        sdist = [n for n in names if n.endswith(".tar.gz")]
        if (len(wheel), len(sdist)) != (1, 1):
            raise AssertionError(f"expected one wheel and one sdist, got {names}")
        _built = os.path.join(out, wheel[0]), os.path.join(out, sdist[0])
    return _built


def declared() -> configparser.ConfigParser:
    """setup.cfg, the one declaration of the metadata and dependencies."""
    config = configparser.ConfigParser()
    with open(os.path.join(ROOT, "setup.cfg"), encoding="utf-8") as f:
        config.read_file(f)
    return config


def _lines(value: str) -> list:
    """The entries of one of setup.cfg's multi-line values."""
    return [line.strip() for line in value.splitlines() if line.strip()]


class ArtifactTests(SynchronousTestCase):
    """What the wheel and the sdist carry."""

    def test_names(self):
        wheel, sdist = built()
        self.assertEqual(os.path.basename(wheel), f"replicator-{VERSION}-py3-none-any.whl")
        self.assertEqual(os.path.basename(sdist), f"replicator-{VERSION}.tar.gz")

    def test_wheel_has_the_package_and_no_tests(self):
        with zipfile.ZipFile(built()[0]) as z:
            names = z.namelist()
            info = f"replicator-{VERSION}.dist-info"
            metadata = z.read(f"{info}/METADATA").decode()
            entry_points = z.read(f"{info}/entry_points.txt").decode()
        tops = {n.split("/")[0] for n in names}
        self.assertEqual(tops, {"replicator", info})
        self.assertIn("replicator/cli.py", names)
        self.assertIn("replicator/export/spark.py", names)
        self.assertIn(f"{info}/licenses/LICENSE", names)
        self.assertEqual([n for n in names if "test" in n.split("/")[0]], [])
        # The dependencies are setup.cfg's, the spark extra with them.
        requires = [line.split(": ", 1)[1] for line in metadata.splitlines()
                    if line.startswith("Requires-Dist: ")]
        dependencies = _lines(declared()["options"]["install_requires"])
        self.assertIn("orjson >= 3.9, < 4", dependencies)
        for dependency in dependencies:
            name = dependency.split()[0].split("[")[0]
            self.assertTrue(any(r.startswith(name) for r in requires), (name, requires))
        self.assertTrue(any(r.startswith("pyspark") and 'extra == "spark"' in r
                            for r in requires), requires)
        self.assertIn("Provides-Extra: spark", metadata)
        self.assertIn("replicator = replicator.cli:main", entry_points)
        self.assertIn("replicator-export = replicator.export.cli:main", entry_points)
        self.assertIn("jsonl = replicator.consumers:JsonlConsumer", entry_points)

    def test_sdist_has_every_tracked_file(self):
        with tarfile.open(built()[1]) as t:
            names = {n.split("/", 1)[1] for n in t.getnames() if "/" in n}
        for path in ("LICENSE", "README.md", "CHANGELOG.md", "pyproject.toml", "setup.cfg",
                     "setup.py", "Makefile",
                     "docs/operations.md", "conf/master.yaml", "conf/worker.yaml",
                     "systemd/replicator-master.service", "systemd/replicator.sysusers.conf",
                     "scripts/install-venv.sh", "tests/test_dist.py"):
            self.assertIn(path, names)
        result = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
        if result.returncode != 0:
            return  # not a checkout (an unpacked sdist): the list above it is
        missing = sorted(set(result.stdout.split()) - names - {".gitignore"})
        self.assertEqual(missing, [], "tracked files missing from the sdist (MANIFEST.in)")
        self.assertEqual([n for n in names if "__pycache__" in n or n.endswith(".pyc")], [])


class DeclarationTests(SynchronousTestCase):
    """One declaration: setup.cfg holds the metadata and dependencies,
    setup.py only runs setuptools, pyproject.toml names the build system."""

    def test_pyproject_declares_no_project(self):
        import tomllib

        with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
            pyproject = tomllib.load(f)
        self.assertEqual(sorted(pyproject), ["build-system"])
        self.assertEqual(pyproject["build-system"]["build-backend"], "setuptools.build_meta")

    def test_setup_py_is_the_minimal_shim(self):
        with open(os.path.join(ROOT, "setup.py"), encoding="utf-8") as f:
            self.assertEqual(f.read(), "from setuptools import setup\n\nsetup()\n")

    def test_setup_cfg_declares_name_version_and_scripts(self):
        config = declared()
        self.assertEqual((config["metadata"]["name"], config["metadata"]["version"]),
                         ("replicator", "attr: replicator.__version__"))
        self.assertEqual(_lines(config["options.entry_points"]["console_scripts"]),
                         ["replicator = replicator.cli:main",
                          "replicator-export = replicator.export.cli:main"])
        self.assertEqual(sorted(config["options.extras_require"]), ["spark", "test"])


class InstallTests(SynchronousTestCase):
    """scripts/install-venv.sh into a clean virtualenv, then a running instance."""

    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="replicator-install-")
        self.addCleanup(shutil.rmtree, self.dir, True)
        self.prefix = os.path.join(self.dir, "opt", "replicator")
        self.units = os.path.join(self.dir, "units")

    def install(self, wheel: str):
        """docs/operations.md's install step, run from the checkout, with
        this test's wheel, prefix and units directory."""
        script = doc_block("install")
        for documented, here in (("dist/replicator-*-py3-none-any.whl", wheel),
                                 ("/opt/replicator", self.prefix),
                                 ("/etc/systemd/system", self.units)):
            self.assertEqual(script.count(documented), 1, script)
            script = script.replace(documented, here)
        # The system's Python, not the test's virtualenv; nothing of the
        # checkout on the path.
        env = {k: v for k, v in os.environ.items()
               if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
        env["PYTHON"] = shutil.which("python3", path="/usr/local/bin:/usr/bin:/bin") or "python3"
        result = subprocess.run(["bash", "-euo", "pipefail", "-c", script], capture_output=True,
                                text=True, env=env, cwd=ROOT, timeout=600)
        self.assertEqual(result.returncode, 0, result.stdout + result.stderr)
        return result.stdout, env

    def test_install_verify_units_start_and_answer(self):
        wheel, _ = built()
        out, env = self.install(wheel)
        self.assertEqual(out.strip().splitlines()[-1], f"replicator {VERSION}")
        binary = os.path.join(self.prefix, "bin", "replicator")
        # A clean virtualenv: its own site-packages, replicator from the wheel.
        where = subprocess.run(
            [os.path.join(self.prefix, "bin", "python"), "-c",
             "import replicator, sys; print(replicator.__file__); print(sys.prefix)"],
            capture_output=True, text=True, env=env, cwd=self.dir, check=True).stdout.split()
        self.assertTrue(where[0].startswith(self.prefix + "/lib/"), where)
        self.assertEqual(where[1], self.prefix)
        version = subprocess.run([binary, "--version"], capture_output=True, text=True,
                                 env=env, cwd=self.dir)
        self.assertEqual((version.returncode, version.stdout.strip()),
                         (0, f"replicator {VERSION}"))

        # The units run this prefix's console script, and systemd accepts them.
        for name in SERVICES:
            with open(os.path.join(self.units, name), encoding="utf-8") as f:
                service = settings(f.read(), "Service")
            commands = [v for k, v in service if k in ("ExecStart", "ExecReload")]
            self.assertEqual([c for c in commands if c.startswith("/opt/")], [], name)
            self.assertTrue(any(c.startswith(f"{binary} run -c ") for c in commands), name)
        analyze = shutil.which("systemd-analyze")
        if analyze is None:
            unavailable("systemd-analyze not found (install systemd)")
        for name in UNITS:
            result = subprocess.run([analyze, "verify", os.path.join(self.units, name)],
                                    capture_output=True, text=True, timeout=60, cwd=self.units)
            stem = name.split("@")[0]
            complaints = [line for line in result.stderr.splitlines() if stem in line]
            self.assertEqual((result.returncode, complaints), (0, []), result.stderr)

        # An instance from the installed script, on a config of its own.
        config = base_config("master", free_port(), [{
            "name": "caches", "table": "cache_invalidation_stream",
            "columns": [{"cache_func": "text"}], "writers": ["master"]}],
            database={"sqlite": "state.sqlite"})
        daemon = Daemon(self, config, "installed", command=[binary], env=env)
        check = subprocess.run([binary, "check", "-c", daemon.path], capture_output=True,
                               text=True, env=env, cwd=daemon.dir, timeout=60)
        self.assertEqual(check.returncode, 0, check.stdout + check.stderr)
        daemon.start()
        status, body = http(daemon.http_base + "/health")
        self.assertEqual(status, 200, body)
        self.assertEqual(json.loads(body)["version"], VERSION)
        status, _ = http(daemon.http_base + "/_replicator/v1/positions", secret=SECRET)
        self.assertEqual(status, 200)
        self.assertIn(self.prefix, daemon.output() + _exe(daemon.proc.pid))
        daemon.kill(signal.SIGTERM)
        self.assertEqual(daemon.proc.returncode, 0, daemon.output()[-2000:])


def _exe(pid: int) -> str:
    """The command line of process ``pid``."""
    with open(f"/proc/{pid}/cmdline", "rb") as f:
        return f.read().replace(b"\0", b" ").decode()
