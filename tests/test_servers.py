"""The throwaway servers of the tests end every process they started."""

import os
import threading

from twisted.trial.unittest import SynchronousTestCase

from tests.servers import RedisServer


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class RedisServerTests(SynchronousTestCase):
    def test_stop_ends_every_process_started(self):
        """A second start() (as a caller that forgot the constructor starts
        it) must not leave the first redis-server running after stop()."""
        redis = RedisServer()
        first = redis.proc.pid
        redis.kill()
        redis.start()
        second = redis.proc.pid
        redis.start()  # while the second one still runs
        third = redis.proc.pid
        redis.stop()
        self.assertEqual([p for p in (first, second, third) if _alive(p)], [])
        self.assertFalse(os.path.exists(redis.tmp))

    def test_no_start_after_stop(self):
        """A restart racing the end of a run (a fault injector's thread) gets
        an error instead of a server nobody will stop."""
        redis = RedisServer()
        redis.kill()
        redis.stop()
        errors = []

        def restart():
            try:
                redis.start()
            except RuntimeError as e:
                errors.append(str(e))

        thread = threading.Thread(target=restart)
        thread.start()
        thread.join(30)
        self.assertEqual(len(errors), 1)
        self.assertFalse(_alive(redis.proc.pid))


class FreePortsTests(SynchronousTestCase):
    def test_ports_are_never_handed_out_twice(self):
        from tests.servers import free_port, free_ports

        ports = free_ports(64) + [free_port() for _ in range(64)]
        self.assertEqual(len(set(ports)), 128)
