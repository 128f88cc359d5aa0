"""Hostile replication-protocol input, generated from a seeded ``random.Random``.

Each *family* is a function ``(rng, side) -> bytes``: the bytes a peer sends,
usually one line ending in ``\\n`` (``partial`` may leave a line unfinished,
``session`` holds several).  ``side`` is ``"server"`` for lines a client
sends to a server and ``"client"`` for lines a server sends to a client.

The valid seed lines name the streams of :data:`STREAMS`: ``caches`` written
by ``master`` and ``worker1`` and ``events`` written by ``master``; a client
that says ``NAME worker1`` may send RDATA/POSITION for ``caches``.
"""

import random
from collections.abc import Callable

MAX_LINE = 16384

#: The streams of every instance under test (in-process and daemons).
STREAMS = [
    {"name": "caches", "table": "cache_stream",
     "columns": [{"cache_func": "text"}, {"keys": "json?"}, {"ts": "bigint"}],
     "writers": ["master", "worker1"]},
    {"name": "events", "table": "event_stream",
     "columns": [{"event_id": "text"}, {"n": "bigint?"}, {"ok": "boolean"}],
     "writers": ["master"]},
]

SERVER_NAME = "hs.test"

# Lines a client sends to a server.
CLIENT_SEEDS = [
    "NAME worker1",
    "NAME reader-7",
    "PING 1490197665500",
    "REPLICATE",
    "REPLICATE ",
    "USER_SYNC worker1 @alice:hs.test DEVICE start 1490197665500",
    "USER_SYNC worker1 @alice:hs.test None end 1490197665500",
    "CLEAR_USER_SYNC worker1",
    "FEDERATION_ACK worker1 17",
    'USER_IP @alice:hs.test ["tok","127.0.0.1","curl/8",null,1490197665500]',
    'USER_IP @bob:hs.test ["tok","::1","Mozilla \\u00e9",  "DEV",1]',
    "REMOTE_SERVER_UP other.example",
    'LOCK_RELEASED ["worker1","purge","!room:hs.test"]',
    "NEW_ACTIVE_TASK task-1",
    "CANCEL_TASK task-1",
    "ERROR something went wrong",
    'RDATA caches worker1 3 ["get_user_by_id",["@alice:hs.test"],1490197670513]',
    'RDATA caches worker1 batch ["f",null,1]',
    'RDATA caches worker1 4 ["f",{"a":[1,2,{"b":null}]},-5]',
    "POSITION caches worker1 3 5",
    "POSITION caches worker1 0 0",
]

# Lines a server sends to a client.
SERVER_SEEDS = [
    "SERVER hs.test",
    "PING 1490197665500",
    'RDATA caches master 3 ["get_user_by_id",["@alice:hs.test"],1490197670513]',
    'RDATA caches master batch ["f",null,1]',
    'RDATA caches worker1 2 ["g",null,2]',
    'RDATA events master 1 ["$ev:hs.test",null,true]',
    'RDATA events master 2 ["$ev2",7,false]',
    "POSITION caches master 3 5",
    "POSITION events master 0 2",
    "POSITION caches worker1 0 1",
    "ERROR Failed to keep up",
    "REMOTE_SERVER_UP other.example",
    'LOCK_RELEASED ["master","purge","!room:hs.test"]',
    "NEW_ACTIVE_TASK task-1",
    "CANCEL_TASK task-1",
]

# Integer fields: (seed, field index in the space-split line) per side.
INT_TEMPLATES = {
    "server": [
        "FEDERATION_ACK worker1 {n}",
        "USER_SYNC worker1 @a:hs.test D start {n}",
        "POSITION caches worker1 {n} 5",
        "POSITION caches worker1 3 {n}",
        'RDATA caches worker1 {n} ["f",null,1]',
        'RDATA caches worker1 7 ["f",null,{n}]',
        'RDATA caches worker1 7 ["f",[{n}],1]',
        'USER_IP @a:hs.test ["t","127.0.0.1","ua",null,{n}]',
        "PING {n}",
    ],
    "client": [
        "POSITION caches master {n} 5",
        "POSITION caches master 3 {n}",
        "POSITION events master 0 {n}",
        'RDATA caches master {n} ["f",null,1]',
        'RDATA events master 9 ["$e",{n},true]',
        "PING {n}",
    ],
}

JSON_TEMPLATES = {
    "server": [
        "RDATA caches worker1 7 {j}",
        'RDATA caches worker1 7 ["f",{j},1]',
        "USER_IP @a:hs.test {j}",
        'USER_IP @a:hs.test ["t","127.0.0.1",{j},null,1]',
        "LOCK_RELEASED {j}",
        'LOCK_RELEASED ["worker1","purge",{j}]',
    ],
    "client": [
        "RDATA caches master 7 {j}",
        'RDATA caches master 7 ["f",{j},1]',
        'RDATA events master 7 [{j},null,true]',
        "LOCK_RELEASED {j}",
    ],
}

TEXT_TEMPLATES = {
    "server": [
        "NAME {t}", "PING {t}", "ERROR {t}", "CLEAR_USER_SYNC {t}", "REMOTE_SERVER_UP {t}",
        "NEW_ACTIVE_TASK {t}", "CANCEL_TASK {t}", "FEDERATION_ACK {t} 3",
        "USER_SYNC {t} @a:hs.test D start 1", "USER_SYNC worker1 {t} {t} end 1",
        'USER_IP {t} ["t","127.0.0.1","ua",null,1]', 'RDATA caches worker1 3 ["{t}",null,1]',
        'RDATA {t} worker1 3 ["f",null,1]', "POSITION {t} worker1 1 2",
    ],
    "client": [
        "SERVER {t}", "PING {t}", "ERROR {t}", "REMOTE_SERVER_UP {t}", "NEW_ACTIVE_TASK {t}",
        'RDATA caches master 3 ["{t}",null,1]', 'RDATA {t} master 3 ["f",null,1]',
        "POSITION caches {t} 1 2",
    ],
}

_NASTY_TEXT = [
    "\x00", "\x1b[31mred\x1b[0m", "\r", "a\rb", "\x7f", "\u2028", "\u0085", "\ufeff",
    "\u202e", "\ud7ff", "\ufffd", "é", "\U0001f600", "\t", "\x0b\x0c", "%s%n{x}", "{0}",
    "None", "batch", "-", "\\", '"', "'", "<script>", "\x00" * 40, "a" * 300,
]

# Byte sequences no strict UTF-8 decoder accepts.
_INVALID_UTF8 = [
    b"\xff", b"\xfe", b"\xc3", b"\xc3(", b"\xa0\xa1", b"\xe2\x28\xa1", b"\xf0\x28\x8c\xbc",
    b"\xc0\x80", b"\xe0\x80\xaf", b"\xed\xa0\x80", b"\xed\xbf\xbf", b"\xf4\x90\x80\x80",
    b"\xf8\x88\x80\x80\x80", b"\x80",
]


def seeds(side: str) -> list[str]:
    return CLIENT_SEEDS if side == "server" else SERVER_SEEDS


def _seed(rng: random.Random, side: str) -> bytes:
    return rng.choice(seeds(side)).encode()


def _digits(rng: random.Random, n: int) -> str:
    return str(rng.randint(1, 9)) + "".join(rng.choice("0123456789") for _ in range(n - 1))


# ------------------------------------------------------------------ families
def valid(rng, side):
    return _seed(rng, side) + rng.choice([b"\n", b"\r\n"])


def mutate(rng, side):
    data = bytearray(_seed(rng, side))
    for _ in range(rng.randint(1, 4)):
        op = rng.randrange(7)
        pos = rng.randrange(len(data) + 1)
        if op == 0 and data:  # flip a bit
            pos = min(pos, len(data) - 1)
            data[pos] ^= 1 << rng.randrange(8)
        elif op == 1:  # insert a random byte
            data[pos:pos] = bytes([rng.randrange(256)])
        elif op == 2 and data:  # delete a run
            del data[pos:pos + rng.randint(1, 8)]
        elif op == 3:  # insert an interesting byte
            data[pos:pos] = rng.choice([b"\x00", b"\r", b" ", b"  ", b"\t", b"\xff", b"[",
                                        b"]", b"{", b'"', b"\\", b"-", b"0", b"\x1b"])
        elif op == 4 and data:  # duplicate a chunk
            end = min(len(data), pos + rng.randint(1, 20))
            data[pos:pos] = data[pos:end] * rng.randint(1, 4)
        elif op == 5:  # replace a byte with a digit or a letter
            if data:
                data[min(pos, len(data) - 1)] = rng.choice(b"0123456789azAZ")
        else:  # truncate
            del data[pos:]
    return bytes(data) + b"\n"


def splice(rng, side):
    a, b = _seed(rng, side), _seed(rng, side)
    return a[:rng.randrange(len(a) + 1)] + b[rng.randrange(len(b) + 1):] + b"\n"


def huge_int(rng, side):
    n = rng.choice([4300, 4301, 4400, 5000, rng.randint(4301, MAX_LINE - 200)])
    text = _digits(rng, n)
    if rng.random() < 0.3:
        text = "-" + text
    return rng.choice(INT_TEMPLATES[side]).format(n=text).encode() + b"\n"


def numbers(rng, side):
    value = rng.choice([
        "-0", "0000000000000000000000017", "+5", " 5", "5 ", "0x10", "1e5", "1.0", "-1",
        str(2 ** 63 - 1), str(2 ** 63), str(2 ** 64), str(-2 ** 63 - 1), str(2 ** 62),
        str(10 ** 30), "1e400", "-1e400", "NaN", "Infinity", "-Infinity", "٣", "１２",
        "²", "9" * 4299, "", "--1", "1_000",
    ])
    return rng.choice(INT_TEMPLATES[side]).format(n=value).encode() + b"\n"


def deep_json(rng, side):
    depth = rng.choice([100, 300, 999, 1000, 1500, 3000, 8000])
    kind = rng.randrange(3)
    if kind == 0:
        value = "[" * depth + "]" * depth
    elif kind == 1:
        value = '{"a":' * depth + "1" + "}" * depth
    else:  # unbalanced: opened, never closed
        value = "[" * depth
    return rng.choice(JSON_TEMPLATES[side]).format(j=value).encode() + b"\n"


def overlong(rng, side):
    size = rng.choice([MAX_LINE + 1, MAX_LINE + 2, MAX_LINE * 2, MAX_LINE * 6, 200_000])
    seed = _seed(rng, side)
    fill = rng.choice([b"a", b" ", b"\r", b"\xff", b"[", b"0"])
    line = seed + fill * max(0, size - len(seed))
    # Sometimes never finished: the peer just keeps sending.
    return line + (b"\n" if rng.random() < 0.7 else b"")


def at_limit(rng, side):
    """A line exactly at (or one under) the limit: must not be refused as
    over-long (with and without ``\\r``)."""
    target = MAX_LINE - rng.randint(0, 1)
    head = b"PING " if rng.random() < 0.5 else b"ERROR "
    line = head + b"x" * (target - len(head))
    return line + rng.choice([b"\n", b"\r\n"])


def partial(rng, side):
    """One or more valid lines, the last one sometimes unfinished."""
    data = b"".join(_seed(rng, side) + rng.choice([b"\n", b"\r\n"])
                    for _ in range(rng.randint(1, 3)))
    if rng.random() < 0.5:
        data = data[:rng.randrange(1, len(data))]
    return data


def invalid_utf8(rng, side):
    data = bytearray(_seed(rng, side))
    pos = rng.randrange(len(data) + 1)
    data[pos:pos] = rng.choice(_INVALID_UTF8)
    return bytes(data) + b"\n"


def surrogate(rng, side):
    escape = rng.choice(["\\ud800", "\\udc80", "\\udfff", "\\ud83d", "\\ud800\\ud800",
                         "\\udc00\\ud800"])
    templates = JSON_TEMPLATES[side]
    value = '"' + escape + '"'
    if rng.random() < 0.3:
        # The relayed-lock attack: a long string of them near the limit.
        value = '"' + escape * (rng.randint(10_000, MAX_LINE - 200) // len(escape)) + '"'
        line = f'LOCK_RELEASED ["worker1","purge",{value}]'
        if len(line) > MAX_LINE:
            line = line[:MAX_LINE - 3] + '"]'
    else:
        line = rng.choice(templates).format(j=value)
    return line.encode() + b"\n"


def control(rng, side):
    text = "".join(rng.choice(_NASTY_TEXT) for _ in range(rng.randint(1, 3)))
    line = rng.choice(TEXT_TEMPLATES[side]).format(t=text)
    return line.encode("utf-8", "surrogatepass") + b"\n"


def whitespace(rng, side):
    line = _seed(rng, side).decode()
    op = rng.randrange(6)
    if op == 0:
        line = " " + line
    elif op == 1:
        line = line.replace(" ", "  ", 1)
    elif op == 2:
        line = line.replace(" ", "\t", 1)
    elif op == 3:
        line = line.lower()
    elif op == 4:
        line = line + " " * rng.randint(1, 5)
    else:
        line = line.split(" ")[0]
    return line.encode() + rng.choice([b"\n", b"\r\n", b"\r\r\n", b"\n\n"])


def random_bytes(rng, side):
    n = rng.choice([0, 1, 2, 8, 64, 512])
    return bytes(rng.randrange(256) for _ in range(n)) + b"\n"


def flood(rng, side):
    """Many valid-looking bookkeeping lines with distinct keys (unbounded
    tables, issue 11 item 5)."""
    n = rng.randint(20, 200)
    base = rng.randrange(10 ** 9)
    out = []
    for i in range(n):
        k = base + i
        out.append(rng.choice([
            f'USER_IP @u{k}:hs.test ["t","10.0.0.1","ua","D{k}",{k}]',
            f"FEDERATION_ACK inst{k} {k}",
            f"USER_SYNC worker1 @u{k}:hs.test D{k} start {k}",
            f'RDATA caches worker1 batch ["f{k}",null,{k}]',
        ]) if side == "server" else rng.choice([
            f'RDATA caches master batch ["f{k}",null,{k}]',
            f"REMOTE_SERVER_UP s{k}.example",
        ]))
    return "\n".join(out).encode() + b"\n"


FAMILIES: dict[str, Callable[[random.Random, str], bytes]] = {
    "valid": valid,
    "mutate": mutate,
    "splice": splice,
    "huge_int": huge_int,
    "numbers": numbers,
    "deep_json": deep_json,
    "overlong": overlong,
    "at_limit": at_limit,
    "partial": partial,
    "invalid_utf8": invalid_utf8,
    "surrogate": surrogate,
    "control": control,
    "whitespace": whitespace,
    "random": random_bytes,
    "flood": flood,
}


def chunks(rng: random.Random, data: bytes) -> list[bytes]:
    """``data`` cut at random points (sometimes inside a UTF-8 character or
    between ``\\r`` and ``\\n``), sometimes whole."""
    if len(data) < 2 or rng.random() < 0.5:
        return [data]
    cuts = sorted(rng.sample(range(1, len(data)), min(len(data) - 1, rng.randint(1, 6))))
    out, prev = [], 0
    for c in cuts + [len(data)]:
        out.append(data[prev:c])
        prev = c
    return out
