"""Small refusals of the read API: two ``Last-Event-ID`` headers, tokens
that are not canonical (writers unsorted, whitespace, no writer), and a
reader secret equal to the write secret (at start and at reload: both
read the config through ``validate``)."""

import base64
import os

import orjson
from twisted.internet import reactor
from twisted.trial.unittest import SynchronousTestCase
from twisted.web.client import readBody
from twisted.web.http_headers import Headers

from replicator.config import ConfigError, validate
from replicator.http.read import tokens
from tests.http_api import SECRET, instance_config
from tests.read_api_cases import EVENTS, ReadTestCase


def raw_token(payload: bytes) -> str:
    return "v1." + base64.urlsafe_b64encode(payload).rstrip(b"=").decode("ascii")


NOT_CANONICAL = [
    raw_token(b'["caches",[["worker1",1],["master",0]]]'),  # writers unsorted
    raw_token(b'["events",[["worker1",1]]] '),  # a trailing space
    raw_token(b'["events", [["worker1", 1]]]'),  # spaces inside
    raw_token(b'["events",[]]'),  # no writer
]


class CanonicalTokenTests(SynchronousTestCase):
    def test_only_what_encode_gives_is_read(self):
        for text in NOT_CANONICAL:
            body = text[3:] + "=" * (-len(text[3:]) % 4)
            stream = orjson.loads(base64.urlsafe_b64decode(body))[0]
            with self.assertRaises(tokens.TokenError, msg=text):
                tokens.decode(text, stream, ["master", "worker1"])
        good = tokens.encode("caches", {"worker1": 1, "master": 0})
        self.assertEqual(tokens.decode(good, "caches", ["master", "worker1"]),
                         {"master": 0, "worker1": 1})


class RefusalTests(ReadTestCase):
    async def test_non_canonical_tokens_are_400_naming_from(self):
        await self.start_reading()
        for text in NOT_CANONICAL + [tokens.encode("events", {"worker1": 0}) + " "]:
            stream = "caches" if text == NOT_CANONICAL[0] else "events"
            response, doc = await self.page(stream, "?from=" + text.replace(" ", "%20"))
            self.assertEqual((response.code, doc.get("parameter")), (400, "from"), text)

    async def test_two_last_event_ids_are_400_naming_it(self):
        await self.start_reading()
        token = tokens.encode("events", {"worker1": 0}).encode("ascii")
        headers = Headers({b"authorization": [b"Bearer " + SECRET.encode()],
                           b"last-event-id": [token, token]})
        response = await self.agent.request(
            b"GET", f"http://127.0.0.1:{self.port}{EVENTS.format('events')}".encode(), headers)
        doc = orjson.loads(await readBody(response))
        self.assertEqual((response.code, doc["parameter"]), (400, "Last-Event-ID"), doc)
        self.assertEqual(self.api.reads.slots.open, 0)


class ReaderSecretTests(SynchronousTestCase):
    def config(self, reader_secret, **http):
        directory = os.path.abspath(self.mktemp())
        os.makedirs(directory)
        path = os.path.join(directory, "reader")
        with open(path, "w") as f:
            f.write(reader_secret + "\n")
        readers = [{"name": "one", "secret_file": path, "streams": ["*"]}]
        return instance_config("worker1", "dbname=x", http={
            "listen": "tcp:0:interface=127.0.0.1", "readers": readers, **http})

    def test_a_reader_secret_equal_to_the_write_secret_is_refused(self):
        with self.assertRaises(ConfigError) as e:
            validate(self.config(SECRET, secret=SECRET), reactor)
        self.assertEqual(str(e.exception).splitlines(), [
            "config: http.readers[0].secret_file: the same secret as the write secret "
            "(http.secret or http.secret_file): each reader needs its own"])
        directory = os.path.abspath(self.mktemp())
        os.makedirs(directory)
        write_file = os.path.join(directory, "write")
        with open(write_file, "w") as f:
            f.write(SECRET)
        with self.assertRaises(ConfigError) as e:
            validate(self.config(SECRET, secret_file=write_file), reactor)
        self.assertIn("config: http.readers[0].secret_file: the same secret as the write",
                      str(e.exception))
        # Another secret is fine.
        validate(self.config("another-reader-secret-123", secret=SECRET), reactor)
