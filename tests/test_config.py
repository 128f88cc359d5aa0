"""Config parsing is pure (no reactor, no file read, no endpoint built) and
checks syntax; :func:`replicator.config.validate` checks what needs files
(TLS keys and CAs, the secret file) with the reactor it is given.  Both
report one line naming the key."""

import os
import subprocess
import sys
import tempfile

from twisted.internet import reactor
from twisted.trial.unittest import SynchronousTestCase

from replicator.config import ConfigError, parse_instance, validate

SECRET = "test-secret-0123456789"
CACHES = {
    "name": "caches", "table": "cache_invalidation_stream",
    "columns": [{"cache_func": "text"}, {"keys": "json?"}, {"invalidation_ts": "bigint"}],
    "writers": ["master"],
}


def doc(**change):
    config = {"server_name": "hs", "instance_name": "master",
              "database": {"sqlite": "x.db"}, "streams": [dict(CACHES)]}
    config.update(change)
    return config


class PureParsingTests(SynchronousTestCase):
    def test_parsing_imports_no_reactor(self):
        """Parsing a config with every kind of endpoint leaves the global
        reactor uninstalled: the instance's reactor is chosen later."""
        code = (
            "import sys\n"
            "from replicator.config import parse_instance\n"
            "parse_instance({'server_name': 'hs', 'instance_name': 'w', "
            "'database': {'sqlite': 'x.db'}, "
            "'replication': {'upstream': 'tcp:host=127.0.0.1:port=9092', "
            "'redis': {'endpoint': 'tcp:127.0.0.1:6379'}}, "
            "'http': {'listen': 'tcp:9093:interface=127.0.0.1', 'secret': 'x' * 16}})\n"
            "print('twisted.internet.reactor' in sys.modules)\n")
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                timeout=60)
        self.assertEqual((result.stdout, result.stderr), ("False\n", ""))

    def test_parsing_reads_no_file(self):
        missing = "/nonexistent/replicator"
        listen = (f"ssl:9092:interface=127.0.0.1:privateKey={missing}/server.key"
                  f":certKey={missing}/server.crt")
        config = parse_instance(doc(
            replication={"listen": listen, "client_ca": f"{missing}/ca.pem"},
            http={"listen": "tcp:9093:interface=127.0.0.1", "secret_file": f"{missing}/s"}))
        self.assertEqual(config.replication.client_ca, f"{missing}/ca.pem")
        self.assertEqual(config.http.secret_file, f"{missing}/s")
        self.assertIsNone(config.http.secret)

    def test_syntax_is_still_checked_when_parsing(self):
        cases = [
            ({"replication": {"listen": "tcp:notaport"}},
             "config: replication.listen: cannot parse endpoint 'tcp:notaport': invalid "
             "literal for int() with base 10: 'notaport'"),
            ({"http": {"listen": "tcp:70000:interface=127.0.0.1", "secret": SECRET}},
             "config: http.listen: port 70000 is not from 0 to 65535"),
            ({"replication": {"listen": "tcp:9092:interface=not-an-address"}},
             "config: replication.listen: interface 'not-an-address' is not an IP address"),
            ({"replication": {"listen": "tcp:port=9092:backlog=0"}},
             "config: replication.listen: backlog 0 is not from 1 to 65535"),
            ({"replication": {"upstream": "tcp:host=127.0.0.1:port=99999"}},
             "config: replication.upstream: port 99999 is not from 0 to 65535"),
            ({"replication": {"upstream": "tcp:127.0.0.1"}},
             "config: replication.upstream: cannot parse endpoint 'tcp:127.0.0.1': no port"),
            ({"replication": {"listen": "tcp:9092\\"}},
             "config: replication.listen: cannot parse endpoint 'tcp:9092\\\\': "
             "'tcp:9092\\\\' ends in a lone backslash"),
        ]
        for change, message in cases:
            with self.assertRaises(ConfigError, msg=message) as raised:
                parse_instance(doc(**change))
            self.assertEqual(str(raised.exception), message)

    def test_the_endpoints_users_write_parse(self):
        for listen in ("tcp:9092", "tcp:port=9092:interface=127.0.0.1",
                       r"tcp6:9092:interface=\:\:1", "unix:/run/replicator.sock",
                       "ssl:9092:privateKey=k.pem:certKey=c.pem", "systemd:domain=INET:index=0"):
            config = parse_instance(doc(replication={"listen": listen,
                                                     "insecure_public_listener": True}))
            self.assertEqual(config.replication.listen, listen)
        for upstream in ("tcp:127.0.0.1:9092", "tcp:host=127.0.0.1:port=9092",
                         "tls:localhost:9092:trustRoots=/etc/ca", "unix:path=/run/r.sock"):
            config = parse_instance(doc(replication={"upstream": upstream}))
            self.assertEqual(config.replication.upstream, upstream)


class ValidateTests(SynchronousTestCase):
    def setUp(self):
        self.tmp = tempfile.mkdtemp()
        self.cwd = os.getcwd()
        os.chdir(self.tmp)
        self.addCleanup(os.chdir, self.cwd)

    def check(self, change) -> str:
        config = parse_instance(doc(**change))
        with self.assertRaises(ConfigError) as raised:
            validate(config, reactor)
        message = str(raised.exception)
        self.assertNotIn("\n", message)
        return message

    def test_secret_file_is_read_by_validate(self):
        with open("secret", "w") as f:
            f.write(SECRET + "\n")
        config = parse_instance(doc(http={"listen": "tcp:0", "secret_file": "secret"}))
        self.assertIsNone(config.http.secret)
        checked = validate(config, reactor)
        self.assertEqual((checked.http.secret, checked.http.secret_file),
                         (SECRET, "./secret"))
        self.assertEqual(checked.replication, config.replication)

    def test_secret_file_mistakes(self):
        self.assertEqual(
            self.check({"http": {"listen": "tcp:0", "secret_file": "/nonexistent/secret"}}),
            "config: http.secret_file: cannot read secret file /nonexistent/secret: "
            "No such file or directory")
        # The secret pasted where its file's path goes: not echoed.
        pasted = "sG7WvwRr3qbEjKqGuFyvg3VKkUmJwl23oOMmVQTQXHU"
        self.assertEqual(
            self.check({"http": {"listen": "tcp:0", "secret_file": "/etc/x/" + pasted}}),
            "config: http.secret_file: cannot read secret file "
            "/etc/x/<a name like a secret, not shown>: No such file or directory")
        with open("empty", "w"):
            pass
        self.assertEqual(self.check({"http": {"listen": "tcp:0", "secret_file": "empty"}}),
                         "config: http.secret_file: secret file ./empty is empty")
        with open("short", "w") as f:
            f.write("short\n")
        self.assertEqual(self.check({"http": {"listen": "tcp:0", "secret_file": "short"}}),
                         "config: http.secret: must be at least 16 characters")

    def test_tls_files(self):
        listen = "ssl:0:interface=127.0.0.1:privateKey=/nonexistent/k.pem"
        message = self.check({"replication": {"listen": listen}})
        self.assertTrue(message.startswith(
            f"config: replication.listen: cannot parse endpoint {listen!r}: "), message)
        self.assertIn("/nonexistent/k.pem", message)
        message = self.check({"replication": {"listen": listen,
                                              "client_ca": "/nonexistent/ca.pem"}})
        self.assertTrue(message.startswith("config: replication.client_ca: "), message)
        upstream = "tls:localhost:9092:trustRoots=/nonexistent/ca"
        message = self.check({"replication": {"upstream": upstream}})
        self.assertTrue(message.startswith(
            f"config: replication.upstream: cannot parse endpoint {upstream!r}: "), message)

    def test_what_only_twisted_knows(self):
        """Endpoint types parsing does not know (a plugin's, say) are left to
        Twisted, in validate."""
        self.assertEqual(
            self.check({"replication": {"listen": "nonsense:9092",
                                        "insecure_public_listener": True}}),
            "config: replication.listen: cannot parse endpoint 'nonsense:9092': Unknown "
            "endpoint type: 'nonsense'")
        self.assertEqual(
            self.check({"replication": {"redis": {"endpoint": "tcp6:9092"}}}),
            "config: replication.redis.endpoint: cannot parse endpoint 'tcp6:9092': Unknown "
            "endpoint type: 'tcp6'")
        # An option of a type parsing knows is parsing's to name.
        with self.assertRaises(ConfigError) as e:
            parse_instance(doc(replication={"listen": "tcp:9092:bogus=1",
                                            "insecure_public_listener": True}))
        self.assertEqual(str(e.exception),
                         "config: replication.listen: a tcp: listener has no option 'bogus'; "
                         "its options: port, interface, backlog")

    def test_a_valid_config_is_returned_as_it_is(self):
        config = parse_instance(doc(
            replication={"listen": "tcp:0:interface=127.0.0.1"},
            http={"listen": "tcp:0:interface=127.0.0.1", "secret": SECRET}))
        self.assertEqual(validate(config, reactor), config)


class CliValidatesTests(SynchronousTestCase):
    def test_a_secret_file_that_is_not_utf8_is_one_line_and_exit_2(self):
        import yaml

        from tests.daemon import cli

        tmp = tempfile.mkdtemp()
        with open(os.path.join(tmp, "secret"), "wb") as f:
            f.write(b"caf\xe9-secret-0123456789\n")
        with open(os.path.join(tmp, "c.yaml"), "w") as f:
            yaml.safe_dump(doc(http={"listen": "tcp:0:interface=127.0.0.1",
                                     "secret_file": "secret"}), f)
        result = cli("run", "-c", "c.yaml", cwd=tmp)
        self.assertEqual((result.returncode, result.stderr),
                         (2, "replicator: config: http.secret_file: secret file ./secret is "
                             "not UTF-8 text\n"))
        self.assertFalse(os.path.exists(os.path.join(tmp, "x.db")))


    def test_a_missing_tls_key_is_one_line_and_exit_2(self):
        import yaml

        from tests.daemon import cli

        tmp = tempfile.mkdtemp()
        listen = "ssl:0:interface=127.0.0.1:privateKey=missing.key:certKey=missing.crt"
        with open(os.path.join(tmp, "c.yaml"), "w") as f:
            yaml.safe_dump(doc(replication={"listen": listen}), f)
        result = cli("run", "-c", "c.yaml", cwd=tmp)
        self.assertEqual(result.returncode, 2, result.stderr)
        self.assertEqual(result.stderr.count("\n"), 1, result.stderr)
        self.assertTrue(result.stderr.startswith(
            f"replicator: config: replication.listen: cannot parse endpoint {listen!r}: "),
            result.stderr)
        self.assertIn("missing.crt", result.stderr)
        self.assertEqual(os.listdir(tmp), ["c.yaml"])


class InstanceNeedsValidatedConfigTests(SynchronousTestCase):
    def test_an_unread_secret_file_is_refused(self):
        from replicator.daemon.service import Instance

        config = parse_instance(doc(http={"listen": "tcp:0:interface=127.0.0.1",
                                          "secret_file": "/nonexistent/secret"}))
        with self.assertRaises(ConfigError) as raised:
            Instance(config, reactor)
        self.assertEqual(str(raised.exception), "config: http.secret_file: not read yet: "
                                                "validate() the config first")


class PathTests(SynchronousTestCase):
    """A path with a NUL byte can name no file: refused when parsed, one
    line naming the key (found by the config fuzzer: a traceback before)."""

    def test_nul_bytes_in_paths(self):
        cases = [
            ({"database": {"sqlite": "a\x00b"}},
             "config: database.sqlite: 'a\\x00b' is not a file path (it holds a NUL byte)"),
            ({"http": {"listen": "tcp:0", "secret_file": "s\x00"}},
             "config: http.secret_file: 's\\x00' is not a file path (it holds a NUL byte)"),
            ({"replication": {"listen": "ssl:0:privateKey=k.pem", "client_ca": "\x00ca"}},
             "config: replication.client_ca: '\\x00ca' is not a file path (it holds a NUL "
             "byte)"),
        ]
        for change, message in cases:
            with self.assertRaises(ConfigError, msg=message) as raised:
                parse_instance(doc(**change))
            self.assertEqual(str(raised.exception), message)

    def test_nul_byte_in_an_endpoint(self):
        for change, key in (({"replication": {"listen": "unix:/tmp/a\x00b"}},
                             "replication.listen"),
                            ({"replication": {"upstream": "tcp:host\x00:9092"}},
                             "replication.upstream")):
            with self.assertRaises(ConfigError) as raised:
                parse_instance(doc(**change))
            self.assertEqual(raised.exception.key, key)
            self.assertTrue(str(raised.exception).endswith(": it holds a NUL byte"),
                            str(raised.exception))

    def test_nul_byte_in_a_jsonl_consumer_path(self):
        from replicator.config import ConsumerConfig
        from replicator.consumers import load_consumers

        with self.assertRaises(ConfigError) as raised:
            load_consumers([ConsumerConfig("jsonl", None, {"path": "a\x00b"})], ".", reactor)
        self.assertEqual(str(raised.exception), "config: consumers[0].path: 'a\\x00b' is not "
                                                "a file path (it holds a NUL byte)")


class SecureByDefaultTests(SynchronousTestCase):
    """A listener is never left to Twisted's defaults (port 443 on every
    interface, ``server.pem`` in the working directory), and a replication
    listener that anyone could reach needs a gate (``client_ca`` or
    ``allowed_networks``) or the operator's explicit opt-in."""

    def message(self, **change) -> str:
        with self.assertRaises(ConfigError) as raised:
            parse_instance(doc(**change))
        message = str(raised.exception)
        self.assertNotIn("\n", message)
        return message

    def test_a_listener_without_its_port(self):
        for listen in ("tcp:", "tcp:interface=127.0.0.1", r"tcp6:interface=\:\:1",
                       "ssl:interface=127.0.0.1:privateKey=k.pem",
                       "tls:/etc/replicator/tls:interface=127.0.0.1"):
            for section, extra in (("replication", {}), ("http", {"secret": SECRET})):
                self.assertEqual(
                    self.message(**{section: dict(extra, listen=listen)}),
                    f"config: {section}.listen: cannot parse endpoint {listen!r}: no port")

    def test_a_tls_listener_without_its_key_and_certificate(self):
        for listen in ("tls:", "tls:9092", "tls::9092:interface=127.0.0.1",
                       "tls:port=9092:interface=127.0.0.1"):
            message = self.message(replication={"listen": listen})
            self.assertTrue(message.startswith("config: replication.listen: "), message)
            self.assertIn("directory", message)
        for listen in ("ssl:9092:interface=127.0.0.1", "ssl:9092:interface=127.0.0.1:certKey=c"):
            for section, extra in (("replication", {}), ("http", {"secret": SECRET})):
                self.assertEqual(
                    self.message(**{section: dict(extra, listen=listen)}),
                    f"config: {section}.listen: an ssl: listener needs privateKey= (its key "
                    "file; certKey= too if the certificate is in another file)")

    def test_a_tls_listener_with_its_directory_and_port(self):
        for listen in ("tls:/etc/replicator/tls:9092:interface=127.0.0.1",
                       "tls:path=/etc/replicator/tls:port=9092:interface=127.0.0.1"):
            config = parse_instance(doc(replication={"listen": listen}))
            self.assertEqual(config.replication.listen, listen)

    def test_a_public_replication_listener_needs_a_gate_or_an_opt_in(self):
        key = "ssl:9092:privateKey=k.pem"
        public = ("tcp:9092", "tcp:9092:interface=0.0.0.0", "tcp:9092:interface=192.0.2.7",
                  r"tcp6:9092:interface=\:\:", "tcp6:9092", f"{key}",
                  "tls:/etc/replicator/tls:9092", "systemd:domain=INET:index=0")
        for listen in public:
            self.assertEqual(
                self.message(replication={"listen": listen}),
                "config: replication.listen: listens beyond loopback with neither client_ca "
                "nor allowed_networks, so anyone who reaches it reads every fact: bind it to "
                "127.0.0.1, set client_ca or allowed_networks, or set "
                "replication.insecure_public_listener: true")
        gated = [{"listen": "tcp:9092", "allowed_networks": ["10.0.0.0/8"]},
                 {"listen": key, "allowed_networks": ["10.0.0.0/8"]},
                 {"listen": key, "client_ca": "ca.pem"}]
        gated += [{"listen": listen, "insecure_public_listener": True} for listen in public]
        local = ["tcp:9092:interface=127.0.0.1", r"tcp6:9092:interface=\:\:1",
                 "unix:/run/replicator.sock", f"{key}:interface=127.0.0.2"]
        gated += [{"listen": listen} for listen in local]
        for replication in gated:
            config = parse_instance(doc(replication=replication))
            self.assertEqual(config.replication.listen, replication["listen"])
        self.assertEqual(
            self.message(replication={"listen": "tcp:9092", "insecure_public_listener": "yes"}),
            "config: replication.insecure_public_listener: expected true or false, got str")

    def test_the_opt_in_is_off_by_default(self):
        config = parse_instance(doc(replication={"listen": "tcp:9092:interface=127.0.0.1"}))
        self.assertFalse(config.replication.insecure_public_listener)


class TlsDirectoryTests(SynchronousTestCase):
    """A ``tls:`` listener's directory must hold a key and a certificate:
    Twisted's listener would otherwise accept connections it can never
    complete a handshake on."""

    def check(self, path: str) -> str:
        listen = f"tls:{path}:9092:interface=127.0.0.1"
        config = parse_instance(doc(replication={"listen": listen}))
        with self.assertRaises(ConfigError) as raised:
            validate(config, reactor)
        message = str(raised.exception)
        self.assertTrue(message.startswith(
            f"config: replication.listen: cannot parse endpoint {listen!r}: "), message)
        return message

    def test_an_empty_or_missing_directory(self):
        empty = tempfile.mkdtemp()
        self.assertTrue(self.check(empty).endswith(f"no private key in the *.pem files of {empty}"))
        self.assertTrue(self.check("/nonexistent/tls").endswith(
            "/nonexistent/tls is not a directory (a tls: listener reads its *.pem files)"))

    def test_a_key_without_its_certificate_and_then_with_it(self):
        import shutil

        from tests.pki import make_pki

        pki = make_pki(tempfile.mkdtemp())
        directory = tempfile.mkdtemp()
        shutil.copy(pki["server.key"], os.path.join(directory, "server.pem"))
        self.assertTrue(self.check(directory).endswith(
            f"no certificate in the *.pem files of {directory}"))
        shutil.copy(pki["server.crt"], os.path.join(directory, "server-cert.pem"))
        listen = f"tls:{directory}:9092:interface=127.0.0.1"
        config = parse_instance(doc(replication={"listen": listen}))
        self.assertEqual(validate(config, reactor), config)
