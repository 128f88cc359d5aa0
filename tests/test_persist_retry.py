"""A writer's position is persisted again after a failed try, without
waiting for its next fact: a database that was down when the last fact's
position was to be persisted left ``stream_positions`` one fact behind for
as long as the writer stayed idle (found by ``make chaos``: pg/tcp, a
``pg_down`` at the end of the run), holding back the export's bound and
what the read API serves as immutable, and what a restart resumes from."""

from twisted.trial.unittest import SynchronousTestCase

from tests.harness import Harness
from tests.stream_sets import WRITTEN_STREAMS as STREAMS


class PersistRetryTests(SynchronousTestCase):
    def test_a_failed_persist_is_tried_again_until_it_succeeds(self):
        h = Harness(STREAMS, self.addCleanup)
        node = h.instance("master")
        stream = node.stream("caches")
        h.run(stream.write_fact([["first", None, 1]]))
        h.clock.advance(1)
        persisted = lambda: h.connection.execute(  # noqa: E731
            "SELECT stream_id FROM stream_positions WHERE stream_name = 'caches'").fetchall()
        self.assertEqual(persisted(), [(1,)])
        pool = node.db.pool
        run, down = pool._run, [True]

        def failing(work):
            if down[0]:
                from twisted.internet import defer
                return defer.fail(ConnectionError("the database is down"))
            return run(work)

        h.run(stream.write_fact([["second", None, 2]]))
        # Its position left to the background persist (as when other facts
        # were in flight at its commit), and the database gone meanwhile.
        h.connection.execute("UPDATE stream_positions SET stream_id = 1")
        h.connection.commit()
        pool._run = failing
        stream._on_advance("master", 1, 2)
        h.clock.advance(1)  # the persist fails
        self.assertEqual(persisted(), [(1,)])
        down[0] = False  # back; the writer writes nothing more
        for _ in range(120):
            h.clock.advance(1)
        self.assertEqual(persisted(), [(2,)])
        self.assertEqual([c for c in h.clock.getDelayedCalls()
                          if "persist" in repr(c.func)], [])
