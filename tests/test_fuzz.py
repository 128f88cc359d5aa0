"""A seeded slice of the adversarial suite (``make fuzz`` runs it at full
size): every phase with a fixed seed and small counts, so that the same
inputs run every time.  A test fails on any finding that is not a known
open defect (``tests/fuzz/known.py``, each entry naming its issue item).

Timing is not asserted here (the project's rule for ``make test``): the
reactor-stall monitor runs and reports, but only ``make fuzz`` fails on it.
"""

import shutil
import tempfile

import yaml
from twisted.trial.unittest import SynchronousTestCase, TestCase

from tests.fuzz import configs, httpfuzz, lines, peers, sockets
from tests.fuzz.known import unknown
from tests.fuzz.results import PhaseResult

SEED = 11
#: Timing is for make fuzz only.
NOT_IN_SLICE = ("reactor_stall",)


def _assert_clean(test, result: PhaseResult, minimum_inputs: int) -> None:
    test.assertGreaterEqual(result.total_inputs, minimum_inputs)
    found = [f for f in unknown(result.findings.values()) if f.kind not in NOT_IN_SLICE]
    if found:
        text = "\n".join(f"{f.kind}: {f.signature} (x{f.count}, {f.family})\n"
                         f"    input: {f.reproducer}\n    detail: {f.detail}" for f in found)
        test.fail(f"{result.phase}: {len(found)} finding(s)\n{text}")


class ProtocolLinesSlice(TestCase):
    """Phase 1: hostile lines to both sides in-process (a real handler on SQLite)."""

    timeout = 300

    async def test_every_line_is_dispatched_or_error_and_close(self):
        result = await lines.run_phase(SEED, 1200)
        self.flushLoggedErrors()  # reported through the result, with the input
        _assert_clean(self, result, 2400)


class DaemonSlice(SynchronousTestCase):
    """Phases 2, 4, 5 (and 6 inside them) against `replicator run` processes."""

    def test_sockets_beside_honest_clients(self):
        result = sockets.run_phase(SEED, 150)
        _assert_clean(self, result, 150)
        self.assertGreater(result.figures["honest_facts_written"], 0)

    def test_http_requests(self):
        result = httpfuzz.run_phase(SEED, 100)
        _assert_clean(self, result, 100)

    def test_mutated_configs(self):
        result = configs.run_phase(SEED, 10)
        _assert_clean(self, result, 10)

    def test_a_good_config_is_seen_running(self):
        """The phase tells a daemon that got ready from one that exited:
        its readiness line is found whatever the log's format (text lines
        start with the time since log_format; the phase saw no daemon ready
        any more and reported every good config as exit0_without_running)."""
        directory = tempfile.mkdtemp(prefix="fuzz-config-ready-")
        self.addCleanup(shutil.rmtree, directory, True)
        data = yaml.safe_dump(configs.base_config(directory)).encode()
        code, stdout, stderr, running = configs._run(directory, data)
        self.assertTrue(running, (code, stdout[-500:], stderr[-500:]))
        self.assertEqual(code, 0, stderr[-500:])


class ForgedPeersSlice(SynchronousTestCase):
    """Phase 3 on PostgreSQL (the worker-side poisoning is make fuzz only)."""

    def test_forged_peers(self):
        from tests.servers import PostgresServer

        server = PostgresServer.shared()
        result = peers.run_phase(SEED, server.create_database, peers.ATTACKS)
        _assert_clean(self, result, 8)
