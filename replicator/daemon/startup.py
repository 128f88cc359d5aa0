"""How a start fails, and what is checked before it binds anything: the
error type the CLI prints as one line, its wording for OS errors, the
password kept out of a database error, the file-descriptor budget."""

import errno
import os
import re

from ..config import InstanceConfig


class StartupError(Exception):
    """Startup failed at runtime: ``key`` names the config key whose resource
    failed (``http.listen``, ``database.postgres``), ``problem`` says what,
    in one line.  ``code`` is the exit code (1: not a config mistake)."""

    def __init__(self, key: str, problem: str, code: int = 1):
        problem = " ".join(str(problem).split())
        super().__init__(f"{key}: {problem}")
        self.key = key
        self.problem = problem
        self.code = code


def os_reason(error: BaseException) -> str:
    """``address already in use`` for an OSError, else its one-line text."""
    code = getattr(error, "errno", None)
    if isinstance(code, int) and code in errno.errorcode:
        text = os.strerror(code)
        return text[:1].lower() + text[1:]
    return " ".join(str(error).split()) or type(error).__name__


def hide_password(text: str, dsn: str | None) -> str:
    """``text`` without the password of ``dsn`` (``password=...`` or the
    ``user:password@`` of a URI), should a driver message quote the DSN."""
    if not dsn:
        return text
    secrets = re.findall(r"password\s*=\s*('(?:[^'\\]|\\.)*'|\S+)", dsn)
    secrets += re.findall(r"://[^:/@\s]*:([^@\s]+)@", dsn)
    for secret in secrets:
        for form in (secret, secret.strip("'")):
            if form:
                text = text.replace(form, "[redacted]")
    return text


#: File descriptors an instance needs besides its connections: database
#: pool, log and consumer files, listeners, Redis, the metrics thread.
FD_RESERVE = 64


def fd_budget_problem(config: InstanceConfig, soft_limit: int) -> str | None:
    """Why the connection caps do not fit the process's file-descriptor
    limit (``RLIMIT_NOFILE`` soft limit), or None.  Past the limit, new
    sockets and files fail: /health, writes and the database with them."""
    if soft_limit < 0:  # RLIM_INFINITY
        return None
    needed = FD_RESERVE + config.database.pool_max
    keys = []
    if config.replication.listen:
        needed += config.replication.max_connections + config.replication.max_unidentified
        keys += ["replication.max_connections", "replication.max_unidentified"]
    if config.http.listen:
        needed += (config.http.max_connections + config.http.reserved_for_health
                   + config.http.reserved_for_writers)
        keys += ["http.max_connections", "http.reserved_for_health",
                 "http.reserved_for_writers"]
    if needed <= soft_limit or not keys:
        return None
    return (f"{' + '.join(keys)} and {FD_RESERVE + config.database.pool_max} descriptors "
            f"for the rest need {needed} file descriptors, over the process limit of "
            f"{soft_limit} (ulimit -n, LimitNOFILE=): lower the caps or raise the limit")
