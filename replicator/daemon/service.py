"""One running instance, built from its config: the services and their order.

Start: database → schema version (:mod:`.storage.migrations`) → streams
(tables, positions) → handler → listeners and the
upstream connection → HTTP → ``READY=1`` to systemd.  Stop (SIGTERM/SIGINT):
``STOPPING=1`` → every peer told (servers send ``ERROR server stopping``,
clients ``CLEAR_USER_SYNC``) → listeners closed → in-flight writes finish →
positions persisted → consumers flushed → database closed.  Nothing
committed is lost at any step.

A start that fails for a reason outside the config file (a port in use, the
database unreachable) raises :class:`StartupError`: one line naming the key
whose resource failed, for the CLI to print (exit 1).
"""

import dataclasses
import gc
from typing import TYPE_CHECKING, Any

from twisted.application.service import MultiService, Service
from twisted.internet import defer, threads
from twisted.internet.interfaces import IProtocolFactory
from twisted.logger import Logger

from .. import files
from ..config import ConfigError, InstanceConfig
from ..config.fields import one_line
from ..consumers.base import Consumer
from ..net.endpoint_strings import exposure
from ..observe import metrics
from ..observe.health import HealthMonitor
from ..observe.instance_metrics import InstanceMetrics
from ..observe.reactor_watch import ReactorWatch
from ..observe.roles import has_replication_link, role
from ..observe.writers import clock_time, duration, writer_watch
from ..replication.core.handler import ReplicationHandler
from ..replication.transport.peers import local_names, policy_from_config
from ..replication.transport.tcp import (
    ConnectionSettings,
    ReplicationServerFactory,
    upstream_service,
)
from ..storage import migrations
from ..storage.database import Database
from ..streams.idempotency import IdempotencyPruner
from ..streams.registry import StreamRegistry
from ..streams.retention import RetentionService, trimmers_for
from . import sdnotify
from .checking import unbound_writers
from .listening import ListeningService
from .startup import StartupError, fd_budget_problem, hide_password, os_reason

if TYPE_CHECKING:
    from wsgiref.simple_server import WSGIServer

    from ..http.api import HttpApi
    from ..observe.writers import WriterWatch
    from ..replication.transport.redis import RedisReplication
    from ..replication.transport.tcp import UpstreamService

__all__ = ["Instance", "MetricsThread"]

log = Logger()


class MetricsThread(Service):
    """Serves /metrics from its own thread, so it answers while the reactor
    is busy.  ``listening`` fires once bound, or fails with
    :class:`StartupError` (``http.metrics_listen``)."""

    key = "http.metrics_listen"

    def __init__(self, host_port: str):
        self.host_port = host_port
        host, _, port = host_port.rpartition(":")
        self.host = host.strip("[]")
        self.port = int(port)
        self._server: WSGIServer | None = None
        self.listening: defer.Deferred[None] | None = None

    def startService(self) -> None:
        super().startService()
        from prometheus_client import start_http_server

        try:
            result = start_http_server(self.port, addr=self.host)
        except OSError as e:
            self.listening = defer.fail(StartupError(
                self.key, f"cannot listen on {self.host_port}: {os_reason(e)}"))
            return
        self.listening = defer.succeed(None)
        self._server = result[0] if isinstance(result, tuple) else None
        if self._server is not None:
            self.port = self._server.server_address[1]
        log.info("metrics listening on {host}:{port} (own thread)", host=self.host, port=self.port)

    def stopService(self) -> None:
        super().stopService()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


class Instance:
    """A replicator instance: everything ``replicator run`` starts."""

    def __init__(self, config: InstanceConfig, reactor: Any) -> None:
        """``config`` parsed and validated (:func:`replicator.config.validate`
        reads the secret file); every endpoint, timer and thread hop of the
        instance uses ``reactor``."""
        if config.http.secret_file is not None and config.http.secret is None:
            raise ConfigError("http.secret_file", "not read yet: validate() the config first")
        rep = config.replication
        if (rep.secret_file is not None and rep.secret is None) or any(
                w.secret is None for w in rep.writer_secrets):
            raise ConfigError("replication.writer_secrets" if rep.writer_secrets
                              else "replication.secret_file",
                              "not read yet: validate() the config first")
        self.reactor = reactor
        self.config = config
        try:
            self.db = Database(config.database)
        except OSError as e:  # the SQLite file's directory
            raise StartupError(f"database.{config.database.engine}",
                               f"cannot create {config.database.path}: {os_reason(e)}") from None
        self.registry = StreamRegistry(self.db, config.instance_name, config.streams,
                                       reactor=reactor)
        self.consumers = self._load_consumers()
        rep = config.replication
        self.handler = ReplicationHandler(
            self.registry, config.instance_name, config.server_name,
            consumers=self.consumers, fetch_limit=rep.fetch_limit,
            max_line_length=rep.max_line_length, clock=reactor,
            fanout_interval=rep.fanout_interval, max_batch_rows=rep.max_batch_rows,
            max_batch_bytes=rep.max_batch_bytes, known_names=rep.allowed_peers or (),
            max_user_syncs=rep.max_user_syncs, max_user_ips=rep.max_user_ips,
            max_federation_acks=rep.max_federation_acks,
            bookkeeping_max_age=rep.bookkeeping_max_age, audit=rep.audit,
            audit_recheck=rep.audit_recheck,
        )
        self.settings = ConnectionSettings(
            max_line_length=rep.max_line_length, ping_interval=rep.ping_interval,
            ping_timeout=rep.ping_timeout, max_queued_lines=rep.max_queued_lines,
            max_queued_bytes=rep.max_queued_bytes, idle_timeout=rep.idle_timeout,
        )
        self.services = MultiService()
        # From the first step of the start to the last of the stop.
        self.reactor_watch = ReactorWatch(reactor)
        self.listeners: list[ListeningService] = []
        # What must bind for the start to succeed.
        self._binding: list[ListeningService | MetricsThread] = []
        self.upstream: UpstreamService | None = None
        self.redis: RedisReplication | None = None
        self.http: HttpApi | None = None
        self.health: HealthMonitor | None = None
        self.writers: WriterWatch | None = None  # made at start
        self.live_metrics: InstanceMetrics | None = None
        # The listener's, for a reload's peer policy.
        self.replication_factory: ReplicationServerFactory | None = None
        self._reloading = defer.DeferredLock()  # one reload at a time
        self._stopped = False
        #: Whether start() completed.
        self._started = False

    def _load_consumers(self) -> list[Consumer]:
        if not self.config.consumers:
            return []
        from ..consumers import load_consumers

        return load_consumers(self.config.consumers, ".", self.reactor)

    @property
    def is_worker(self) -> bool:
        """Whether health counts a replication link of this instance's own
        (:func:`replicator.observe.roles.has_replication_link`)."""
        return has_replication_link(self.config)

    @property
    def role(self) -> str:
        """``master`` or ``worker`` (:func:`replicator.observe.roles.role`)."""
        return role(self.config)

    def _current_findings(self) -> Any:
        """The HTTP API's findings (the status page's recorder asks once it runs)."""
        assert self.http is not None
        return self.http.current_findings()

    def replication_status(self) -> tuple[bool, str]:
        """Whether this instance's replication links are up (workers)."""
        rep = self.config.replication
        if rep.upstream:
            # Connected means the upstream answered the handshake on a link
            # still up (a silent one is timed out after ping_timeout); an
            # accepted socket alone says nothing.
            if self.upstream is None:
                return False, f"upstream {rep.upstream} not started"
            if not self.upstream.connected:
                return False, self._upstream_down(rep.upstream)
        if rep.redis and self.redis is not None and not self.redis.connected:
            return False, f"not connected to redis {self.redis.where}"
        return True, "connected"

    def _upstream_down(self, endpoint: str) -> str:
        """What the upstream is while it does not answer, and since when."""
        assert self.upstream is not None
        since = self.upstream.down_since()
        if since is None:  # it answered since the caller looked
            return f"upstream {endpoint} connecting"
        for_ = duration(self.reactor.seconds() - since)
        if not self.upstream.ever_answered:
            return f"upstream {endpoint} has not answered since the start at " \
                   f"{clock_time(since)} ({for_})"
        return f"upstream {endpoint} not answering since {clock_time(since)} ({for_})"

    def _link_since(self) -> float | None:
        """Since when the upstream has not answered (None: it answers, or
        this instance has none): when its link problem began."""
        return self.upstream.down_since() if self.upstream is not None else None

    def _synapse_seen(self) -> str | None:
        """A Synapse on our Redis channel without the ``synapse:`` section
        (this instance stopped publishing there), as a health problem."""
        return self.redis.synapse_seen if self.redis is not None else None

    # ------------------------------------------------------------- start
    async def start(self) -> None:
        config = self.config
        started = self.reactor.seconds()
        self.reactor_watch.startService()
        files.warn_if_exposed(config.http.secret_file, "http.secret_file")
        await self._check_database()
        try:
            await migrations.prepare(self.db, any(s.local_writers for s in self.registry),
                                     config.database.auto_migrate, self.reactor,
                                     config.instance_name)
            await self.registry.start()
            await self.handler.load_findings()  # (the audit's, from before a restart)
        except migrations.SchemaProblem as e:
            raise StartupError(f"database.{self.db.engine}", str(e), code=e.code) from None
        except Exception as e:
            self._lost_during_start(e)
            raise
        self.handler.start()
        rep = config.replication
        self._warn_fd_budget()
        if rep.listen:
            self._warn_exposed(rep.listen, "replication")
            for line in unbound_writers(config):
                log.warn("{line}", line=line)
            policy = policy_from_config(rep, local_names(self.handler))
            factory = ReplicationServerFactory(self.handler, config.server_name, self.settings,
                                               clock=self.reactor, policy=policy,
                                               max_connections=rep.max_connections,
                                               max_connections_per_address=(
                                                   rep.max_connections_per_address),
                                               max_unidentified=rep.max_unidentified,
                                               identify_timeout=rep.identify_timeout)
            self._listen(rep.listen, factory, "replication", rep.client_ca,
                         key="replication.listen")
            self.replication_factory = factory
        if rep.upstream:
            self.upstream = upstream_service(
                self.reactor, rep.upstream, self.handler, config.instance_name,
                config.server_name, self.settings, initial_delay=rep.reconnect_initial_delay,
                max_delay=rep.reconnect_max_delay, secret=rep.secret)
            self.upstream.setServiceParent(self.services)
        if rep.redis and rep.redis.cluster:
            from ..replication.transport.redis_cluster import RedisClusterBus

            bus = RedisClusterBus(
                self.reactor, rep.redis, self.handler, config.server_name, config.instance_name,
                ping_interval=rep.ping_interval, ping_timeout=rep.ping_timeout,
                initial_delay=rep.reconnect_initial_delay, max_delay=rep.reconnect_max_delay)
            bus.setServiceParent(self.services)
            self.redis = bus  # type: ignore[assignment]  # connected, synapse_seen alike
        elif rep.redis:
            from ..replication.transport.redis import RedisReplication

            self.redis = RedisReplication(
                self.reactor, rep.redis, self.handler, config.server_name, config.instance_name,
                ping_interval=rep.ping_interval, ping_timeout=rep.ping_timeout,
                initial_delay=rep.reconnect_initial_delay, max_delay=rep.reconnect_max_delay,
                synapse_server_name=config.synapse.server_name if config.synapse else None)
            self.redis.setServiceParent(self.services)
        trimmers = trimmers_for(config.instance_name, self.registry, self.db, self.reactor)
        if trimmers:
            RetentionService(trimmers, self.reactor).setServiceParent(self.services)
        self.writers = writer_watch(config, self.registry, self.handler, self.reactor)
        self.health = HealthMonitor(
            registry=self.registry, handler=self.handler, db=self.db, clock=self.reactor,
            lag_grace=config.health.lag_grace, check_interval=config.health.check_interval,
            expect_upstream=self.is_worker, conditions=[self._synapse_seen],
            link_since=self._link_since,
            writers=self.writers)
        self.health.setServiceParent(self.services)
        self.handler.auditor.setServiceParent(self.services)
        if config.http.listen:
            from ..http import HttpApi

            self._warn_exposed(config.http.listen, "HTTP")
            from ..observe.status import StatusRecorder

            recorder = StatusRecorder(handler=self.handler, clock=self.reactor,
                                      findings=self._current_findings)
            self.http = HttpApi(config=config, registry=self.registry, handler=self.handler,
                                db=self.db, replication_status=self.replication_status,
                                clock=self.reactor, health=self.health, status=recorder,
                                writers=self.writers)
            from ..observe.problem_log import ProblemLog

            # The page's problems outlive a restart: those from before it first.
            await recorder.restore(ProblemLog(self.db, config.instance_name, self.reactor,
                                              redact=self.http.redact), started)
            recorder.setServiceParent(self.services)
            if any(stream.local_writers for stream in self.registry):
                IdempotencyPruner(self.http.streams.idempotent.keys,
                                  self.reactor).setServiceParent(self.services)
            self._listen(config.http.listen, self.http.site(), "HTTP", key="http.listen")
        if config.http.metrics_listen:
            metrics_thread = MetricsThread(config.http.metrics_listen)
            metrics_thread.setServiceParent(self.services)
            self._binding.append(metrics_thread)
        self.live_metrics = InstanceMetrics(
            registry=self.registry, handler=self.handler,
            healthy=self.health.healthy_source(self.replication_status), writers=self.writers,
            readers=self.http.reads.metric_samples if self.http is not None else None)
        metrics.add_source(self.live_metrics)
        self.services.startService()
        # One by one, so that the first failure is raised as itself (not
        # wrapped in a FirstError); the others are consumed.
        failure = None
        for service in self._binding:
            assert service.listening is not None  # (set by startService)
            try:
                await service.listening
            except Exception as e:
                failure = failure or e
        if failure is not None:
            raise failure
        # What startup made (modules, config, streams) lives as long as the
        # process: out of the collector's reach, a full collection walks only
        # what came since, so it stays short (it stalls the reactor).
        gc.freeze()
        self._started = True
        sdnotify.ready()
        sdnotify.status(f"{config.instance_name} ({self.role}): {len(self.registry)} streams")
        log.info("instance {name} of {server} ready", name=config.instance_name,
                 server=config.server_name)

    def _listen(self, endpoint: str, factory: IProtocolFactory, what: str,
                client_ca: str | None = None,
                key: str = "listen") -> None:
        service = ListeningService(self.reactor, endpoint, factory, what, client_ca, key)
        service.setServiceParent(self.services)
        self.listeners.append(service)
        self._binding.append(service)

    async def _check_database(self) -> None:
        """One query before anything else: an unreachable database is one
        line naming ``database.<engine>``, not a traceback."""
        db = self.config.database
        key = f"database.{db.engine}"
        try:
            await self.db.runQuery("SELECT 1")
        except Exception as e:
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise StartupError(key, "cannot connect: " + hide_password(first, db.dsn)) from None

    def _lost_during_start(self, e: Exception) -> None:
        """A PostgreSQL connection lost while the streams load (the server
        restarting after the first query answered) is the documented exit of
        a database that is not there: one line naming ``database.postgres``,
        exit 1, for the supervisor to start it again.  (Not SQLite's
        OperationalError: there it means a mistake, not an outage.)"""
        import psycopg2

        if self.db.is_postgres and isinstance(e, psycopg2.OperationalError):
            first = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise StartupError("database.postgres", "lost during start: "
                               + hide_password(first, self.config.database.dsn)) from None

    def _warn_fd_budget(self) -> None:
        import resource

        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        problem = fd_budget_problem(self.config, soft)
        if problem is not None:
            log.warn("{problem}", problem=problem)

    @staticmethod
    def _warn_exposed(endpoint: str, what: str) -> None:
        # A public replication listener without a gate never gets here
        # unless replication.insecure_public_listener says so (config).
        problem = exposure(endpoint, what)
        if problem is not None:
            log.warn("{problem}", problem=problem)

    def port_of(self, what: str) -> int | None:
        for s in self.listeners:
            if s.what == what:
                return s.bound_port
        return None

    # ------------------------------------------------------------ reload
    async def reload(self, path: str) -> None:
        """Read ``path`` again (SIGHUP) and apply what can change live
        (:mod:`replicator.daemon.reload`); one line per key that needs a restart,
        one summary line.  An invalid file is one line naming the key, and
        the instance keeps running on the config it has.  Connections that
        stay valid are never dropped."""
        await self._reloading.run(defer.ensureDeferred, self._reload(path))

    async def _reload(self, path: str) -> None:
        from ..config import load_config, validate
        from ..logs.output import change_logging
        from .reload import plan

        if self._stopped or not self._started:
            return
        sdnotify.reloading()
        try:
            await self._reopen_outputs("reload")
            try:
                read = await threads.deferToThreadPool(
                    self.reactor, self.reactor.getThreadPool(),
                    lambda: validate(load_config(path), self.reactor))
            except ConfigError as e:
                log.error("reload: {error}; keeping the running config", error=e)
                return
            p = plan(self.config, read)
            failed = []
            for key in p.restart:
                log.warn("reload: {key}: changed in the file; needs a restart; keeping the "
                         "running value", key=key)
            if p.logging:
                change_logging(p.config.log_level, p.config.log_format)
            if p.health and self.health is not None:
                self.health.set_settings(p.config.health.lag_grace,
                                         p.config.health.check_interval)
            tls = next((s.tls for s in self.listeners
                        if s.what == "replication" and s.tls is not None), None)
            if tls is not None:
                try:
                    read_tls = await threads.deferToThreadPool(
                        self.reactor, self.reactor.getThreadPool(), tls.read,
                        p.config.replication.client_ca)
                except Exception as e:
                    failed.append("replication.client_ca")
                    p.config = dataclasses.replace(p.config, replication=dataclasses.replace(
                        p.config.replication, client_ca=self.config.replication.client_ca))
                    log.error("reload: replication.listen: cannot read the TLS files: {error}; "
                              "keeping the running ones", error=one_line(e)[:300])
                else:
                    if tls.take(read_tls) and "replication.client_ca" not in p.applied:
                        p.applied.append("replication TLS files")
            if p.readers and self.http is not None:
                self.http.set_readers(p.config.http.readers)
            if p.peers and self.replication_factory is not None:
                policy = policy_from_config(p.config.replication, local_names(self.handler))
                self.replication_factory.set_policy(policy)
            streams = {s.name: s for s in self.config.streams}
            for key, stream_config in p.new_streams:
                try:
                    stream = await self.registry.add(stream_config, key)
                except Exception as e:
                    failed.append(key)
                    streams.pop(stream_config.name, None)
                    log.error("reload: {key}: cannot add stream {name}: {error}", key=key,
                              name=stream_config.name, error=one_line(e)[:300])
                    continue
                self.handler.stream_added(stream)
                streams[stream_config.name] = stream_config
            for key, stream_config in p.writers:
                old_writers = self.registry.get(stream_config.name).config.writers
                try:
                    stream = await self.registry.change_writers(stream_config)
                except Exception as e:
                    failed.append(f"{key}.writers")
                    log.error("reload: {key}.writers: cannot apply: {error}", key=key,
                              error=one_line(e)[:300])
                    continue
                self.handler.writers_changed(stream, old_writers)
                streams[stream_config.name] = stream_config
            if p.consumers is not None:
                from .consumer_reload import change_consumers

                self.consumers, consumers, bad = await change_consumers(
                    self.handler, self.consumers, self.config.consumers, p.config.consumers,
                    p.consumers, self.reactor)
                failed += bad
                p.config = dataclasses.replace(p.config, consumers=consumers)
            self.config = dataclasses.replace(p.config, streams=tuple(
                streams[s.name] for s in p.config.streams if s.name in streams))
            applied = [k for k in p.applied if k not in failed
                       and not any(k.startswith(f) for f in failed)]
            log.info("reload: applied {applied}; needs restart: {restart}",
                     applied=", ".join(applied) or "nothing",
                     restart=", ".join(p.restart) or "nothing")
        finally:
            sdnotify.ready()

    # ------------------------------------------------------------ reopen
    async def reopen(self) -> None:
        """Reopen the output files (SIGUSR1, ``replicator reopen``: what
        ``logrotate``'s ``postrotate`` runs) and nothing else: the config
        file is not read.  One line says how many were reopened."""
        await self._reloading.run(defer.ensureDeferred, self._reopen())

    async def _reopen(self) -> None:
        if self._stopped or not self._started:
            return
        count = await self._reopen_outputs("reopen")
        log.info("reopen: {count} output file{s} reopened; the config file not read",
                 count=count, s="" if count == 1 else "s")

    async def _reopen_outputs(self, what: str) -> int:
        """Let every consumer with a ``reopen`` method follow its output
        rotated outside (in the consumer's own file thread); also at a
        reload, first, even when the file just read is invalid.  The
        number of consumers that reopened theirs."""
        count = 0
        for consumer in self.consumers:
            reopen = getattr(consumer, "reopen", None)
            if callable(reopen):
                try:
                    await defer.maybeDeferred(reopen)
                    count += 1
                except Exception:
                    log.failure("{what}: reopening the output of {c} failed", what=what,
                                c=consumer)
        return count

    # -------------------------------------------------------------- stop
    async def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        sdnotify.stopping()
        # An instance that never started (its startup failed and said why
        # in one line) stops without saying so.
        said = log.info if self._started else log.debug
        said("instance {name} stopping", name=self.config.instance_name)
        self.handler.stop("server stopping")
        if self.services.running:
            await self.services.stopService()
        await self.handler.drain()
        await self.registry.stop()
        for consumer in self.consumers:
            try:
                await defer.maybeDeferred(consumer.close)
            except Exception:
                log.failure("closing consumer {c} failed", c=consumer)
        if self.live_metrics is not None:
            metrics.remove_source(self.live_metrics)
        self.db.close()
        if self.reactor_watch.running:
            self.reactor_watch.stopService()
        said("instance {name} stopped", name=self.config.instance_name)
