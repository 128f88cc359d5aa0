"""Live metrics: every scrape reports one snapshot of the live state, whole.

Scrapes come from two threads (the metrics thread and ``/metrics`` on the
HTTP listener); neither may see a series missing because the other is
computing its own figures at the same moment.
"""

import sys
import threading

from prometheus_client import REGISTRY
from twisted.internet import defer, reactor
from twisted.trial.unittest import SynchronousTestCase, TestCase
from twisted.web.client import Agent, HTTPConnectionPool, readBody

from replicator.config import parse_instance
from replicator.daemon.service import Instance
from replicator.observe import metrics
from tests.handlers import Peers, handler
from tests.http_api import SECRET
from tests.servers import PostgresServer
from tests.stream_sets import HEALTH_STREAM_DEFS as STREAM_DEFS

#: Configured instance names, each with a user syncing.
NAMES = [f"w{i}" for i in range(1000)]


def user_sync_series() -> int:
    """How many ``replicator_user_syncs`` series of the configured names
    one scrape reports."""
    return sum(1 for family in REGISTRY.collect() if family.name == "replicator_user_syncs"
               for sample in family.samples if sample.labels["instance"] in NAMES)


class ConcurrentScrapeTests(SynchronousTestCase):

    def setUp(self):
        self.handler, _ = handler(known_names=NAMES)
        peers = Peers(self, self.handler)
        for name in NAMES:
            proto, _ = peers.connect(name)
            proto.dataReceived(f"USER_SYNC {name} @u:hs None start 1\n".encode())
        metrics.add_source(self.handler.bookkeeping.metric_samples)
        self.addCleanup(metrics.remove_source, self.handler.bookkeeping.metric_samples)

    def test_a_scrape_concurrent_with_another_never_misses_a_series(self):
        self.assertEqual(user_sync_series(), len(NAMES))
        # Switch threads as often as the interpreter can, so that the two
        # scrapes interleave everywhere they can.
        interval = sys.getswitchinterval()
        sys.setswitchinterval(1e-6)
        self.addCleanup(sys.setswitchinterval, interval)
        counts = []

        def scrape():
            for _ in range(20):
                counts.append(user_sync_series())

        threads = [threading.Thread(target=scrape) for _ in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        self.assertEqual(counts, [len(NAMES)] * 40)


class OneSnapshotPerScrapeTests(TestCase):
    """``GET /metrics`` on an instance's HTTP listener."""

    timeout = 120

    async def test_a_scrape_computes_the_live_state_once(self):
        doc = {
            "server_name": "hs.test", "instance_name": "master",
            "database": {"postgres": PostgresServer.shared().create_database(), "pool_max": 3},
            "streams": STREAM_DEFS, "replication": {},
            "http": {"listen": "tcp:0:interface=127.0.0.1", "secret": SECRET},
        }
        instance = Instance(parse_instance(doc), reactor)
        self.addCleanup(lambda: defer.ensureDeferred(instance.stop()))
        await instance.start()
        books = instance.handler.bookkeeping
        computed = []
        compute = books.metric_samples

        def counted():
            computed.append(1)
            return compute()

        books.metric_samples = counted
        pool = HTTPConnectionPool(reactor, persistent=False)
        self.addCleanup(pool.closeCachedConnections)
        url = f"http://127.0.0.1:{instance.port_of('HTTP')}/metrics".encode()
        response = await Agent(reactor, pool=pool).request(b"GET", url)
        text = await readBody(response)
        self.assertEqual(response.code, 200)
        self.assertIn(b'replicator_stream_position{stream="caches",writer="master"}', text)
        self.assertEqual(len(computed), 1)
