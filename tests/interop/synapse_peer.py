"""Synapse's own TCP replication peers, started for the interop suite.

Run with Synapse's interpreter (``SYNAPSE_PYTHON``), never imported by our
code.  Synapse 1.163.2 no longer wires its TCP replication into its config
(a ``replication`` listener and ``worker_replication_port`` are refused:
its processes talk over Redis), but it still ships the TCP protocol classes.
This script runs Synapse's own processes exactly as its entry points do and
adds only the TCP link:

``master CONFIG PORT``
    Synapse's main process (as ``synapse.app.homeserver``), plus Synapse's
    TCP replication server factory listening on ``127.0.0.1:PORT``.

``worker CONFIG HOST PORT STATUS WRITER``
    Synapse's generic worker (set up as ``synapse.app.generic_worker``
    does), whose replication is Synapse's TCP client protocol connected to
    ``HOST:PORT`` instead of Redis.  Every half second it writes ``STATUS``
    (JSON): per stream, its current token for ``WRITER`` and the RDATA
    lines its handler counted.

Everything that parses, checks and applies lines is Synapse's; this script
only calls its public entry points.
"""

import json
import os
import sys


def _master(config_path, port):
    from synapse.app import _base, homeserver
    from synapse.logging.context import LoggingContext
    from synapse.replication.tcp.resource import ReplicationStreamProtocolFactory

    config = homeserver.load_or_generate_config(["-c", config_path])
    with LoggingContext(name="main", server_name=config.server.server_name):
        hs = homeserver.create_homeserver(config)
        homeserver.setup(hs)

        async def start():
            await homeserver.start(hs, freeze=False)
            hs.get_reactor().listenTCP(port, ReplicationStreamProtocolFactory(hs),
                                       interface="127.0.0.1")

        _base.register_start(hs, start)
        homeserver.start_reactor(config)


def _worker(config_path, host, port, status_path, writer):
    import prometheus_client
    from synapse.app import _base, generic_worker
    from synapse.logging.context import LoggingContext
    from synapse.replication.tcp.protocol import ClientReplicationStreamProtocol
    from synapse.util.duration import Duration
    from twisted.internet.protocol import ReconnectingClientFactory

    config = generic_worker.load_config(["-c", config_path])
    with LoggingContext(name="main", server_name=config.server.server_name):
        hs = generic_worker.create_homeserver(config)
        generic_worker.setup(hs)
        handler = hs.get_replication_command_handler()

        class Factory(ReconnectingClientFactory):
            maxDelay = 5

            def buildProtocol(self, addr):
                self.resetDelay()
                return ClientReplicationStreamProtocol(
                    hs, hs.get_instance_name(), hs.hostname, hs.get_clock(), handler)

        def status():
            out = {}
            for name, stream in handler.get_streams().items():
                rdata = prometheus_client.REGISTRY.get_sample_value(
                    "synapse_replication_tcp_protocol_inbound_rdata_count_total",
                    {"stream_name": name, "server_name": hs.hostname}) or 0
                out[name] = {"token": stream.current_token(writer), "rdata": int(rdata)}
            tmp = status_path + ".tmp"
            with open(tmp, "w") as f:
                json.dump(out, f)
            os.replace(tmp, status_path)

        async def start():
            # Not _base.start: that would start Synapse's Redis replication.
            hs.get_reactor().connectTCP(host, port, Factory())
            hs.get_clock().looping_call(status, Duration(milliseconds=500))

        _base.register_start(hs, start)
        _base.start_worker_reactor("synapse-generic-worker", config)


def main(argv):
    if argv[:1] == ["master"] and len(argv) == 3:
        _master(argv[1], int(argv[2]))
    elif argv[:1] == ["worker"] and len(argv) == 6:
        _worker(argv[1], argv[2], int(argv[3]), argv[4], argv[5])
    else:
        sys.exit(__doc__)


if __name__ == "__main__":
    main(sys.argv[1:])
