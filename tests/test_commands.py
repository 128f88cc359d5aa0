"""Tests for replicator.replication.wire.commands: wire format, round trips,
malformed input, and the RDATA fan-out encoder."""

import orjson
from hypothesis import given, settings
from hypothesis import strategies as st
from twisted.trial.unittest import SynchronousTestCase

from replicator.jsontext import encode_json
from replicator.replication.wire.commands import (
    ALL_COMMANDS,
    CLIENT_COMMANDS,
    CLIENT_WRITER_COMMANDS,
    COMMANDS_BY_NAME,
    SERVER_COMMANDS,
    AuthChallengeCommand,
    AuthCommand,
    CancelTaskCommand,
    ClearUserSyncCommand,
    ErrorCommand,
    FederationAckCommand,
    LockReleasedCommand,
    NameCommand,
    NewActiveTaskCommand,
    PingCommand,
    PositionCommand,
    RdataCommand,
    RemoteServerUpCommand,
    ReplicateCommand,
    ServerCommand,
    UserIpCommand,
    UserSyncCommand,
    parse_line,
)
from replicator.replication.wire.encoding import (
    _encode_at_once,
    _encode_rdata_lines_each,
    encode_position_line,
    encode_rdata_lines,
    joined,
)
from replicator.replication.wire.parsing import CommandParseError

# ---------------------------------------------------------------- strategies

# Names: no space, no newline, never empty.
names = st.text(
    alphabet=st.characters(blacklist_characters=" \n", blacklist_categories=("Cs",)),
    min_size=1,
    max_size=20,
)
# Free text: anything but a newline (spaces, unicode, \r inside).
free_text = st.text(alphabet=st.characters(blacklist_characters="\n", blacklist_categories=("Cs",)),
                    max_size=40)
nonempty_text = free_text.filter(bool)
any_text = st.text(max_size=20)  # inside JSON: newlines, spaces, anything
# Stream tokens and other integer fields: 63-bit, never negative.
tokens = st.integers(min_value=0, max_value=2**63 - 1)
json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | any_text,
    lambda children: st.lists(children, max_size=5) | st.dictionaries(any_text, children,
                                                                      max_size=5),
    max_leaves=20,
)
rows = st.lists(json_values, max_size=6)
device_ids = st.none() | names.filter(lambda n: n != "None")

STRATEGIES = {
    "SERVER": st.builds(ServerCommand, nonempty_text),
    "RDATA": st.builds(RdataCommand, names, names, st.none() | tokens, rows),
    "POSITION": st.builds(PositionCommand, names, names, tokens, tokens),
    "ERROR": st.builds(ErrorCommand, free_text),
    "PING": st.builds(PingCommand, free_text),
    "NAME": st.builds(NameCommand, nonempty_text),
    "REPLICATE": st.just(ReplicateCommand()),
    "USER_SYNC": st.builds(UserSyncCommand, names, names, device_ids, st.booleans(), tokens),
    "CLEAR_USER_SYNC": st.builds(ClearUserSyncCommand, nonempty_text),
    "FEDERATION_ACK": st.builds(FederationAckCommand, names, tokens),
    "USER_IP": st.builds(UserIpCommand, names, any_text, any_text, any_text, st.none() | any_text,
                         tokens),
    "REMOTE_SERVER_UP": st.builds(RemoteServerUpCommand, nonempty_text),
    "LOCK_RELEASED": st.builds(LockReleasedCommand, any_text, any_text, any_text),
    "NEW_ACTIVE_TASK": st.builds(NewActiveTaskCommand, nonempty_text),
    "CANCEL_TASK": st.builds(CancelTaskCommand, nonempty_text),
    "AUTH_CHALLENGE": st.builds(AuthChallengeCommand, nonempty_text),
    "AUTH": st.builds(AuthCommand, nonempty_text),
}
commands = st.one_of(*STRATEGIES.values())


class RoundTripTests(SynchronousTestCase):
    def test_strategies_cover_every_command(self):
        self.assertEqual(set(STRATEGIES), set(COMMANDS_BY_NAME))
        self.assertEqual(len(ALL_COMMANDS), 17)

    @settings(max_examples=500)
    @given(commands)
    def test_to_line_then_parse(self, cmd):
        line = cmd.to_line()
        self.assertNotIn("\n", line)
        self.assertTrue(line.startswith(cmd.NAME + " "), line)
        parsed = parse_line(line)
        self.assertEqual(type(parsed), type(cmd))
        self.assertEqual(parsed, cmd)
        # The line we write is canonical: parsing and writing it again
        # reproduces it byte for byte.
        self.assertEqual(parsed.to_line(), line)

    @given(names, names, st.none() | tokens, rows)
    def test_rdata_row_round_trips_through_bytes(self, stream, instance, token, row):
        data = RdataCommand(stream, instance, token, row).to_line().encode("utf-8")
        parsed = parse_line(data.decode("utf-8"))
        self.assertEqual((parsed.stream_name, parsed.instance_name, parsed.token, parsed.row),
                         (stream, instance, token, row))

    def test_big_integers_round_trip_exactly(self):
        row = [2**80, -(2**70), [2**64]]
        cmd = parse_line(RdataCommand("s", "w", 1, row).to_line())
        self.assertEqual(cmd.row, row)
        self.assertEqual(cmd.to_line(),
                         "RDATA s w 1 [1208925819614629174706176,-1180591620717411303424,"
                         "[18446744073709551616]]")


class ExactBytesTests(SynchronousTestCase):
    """Lines from PROTOCOL.md and seeds/tcp_replication.md."""

    CANONICAL = [
        'RDATA caches master batch ["get_user_by_id",["@a:hs"],1490197670513]',
        'RDATA caches master 54 ["get_user_by_id",["@c:hs"],1490197670513]',
        'RDATA caches master 2 ["get_user_by_id",["@01register-user:localhost:8823"],'
        '1490197670513]',
        'RDATA caches master 550953772 ["get_user_by_id",null,1550574873252]',
        "POSITION events master 53 53",
        "POSITION backfill master 1 1",
        "SERVER localhost:8823",
        "PING 1490197665618",
        "NAME synapse.app.appservice",
        "REPLICATE ",
        "ERROR server stopping",
        "USER_SYNC worker1 @bob:hs DEVICE start 1490197670513",
        "USER_SYNC worker1 @bob:hs None end 1490197670513",
        "CLEAR_USER_SYNC worker1",
        "FEDERATION_ACK federation_sender1 1234",
        'USER_IP @bob:hs ["syt_token","10.0.0.1","Mozilla/5.0 (X11; Linux)","DEV",1490197670513]',
        'USER_IP @bob:hs ["syt_token","10.0.0.1","curl",null,1]',
        "REMOTE_SERVER_UP example.org",
        'LOCK_RELEASED ["master","purge_lock","!room:hs"]',
        "NEW_ACTIVE_TASK task-1",
        "CANCEL_TASK task-1",
        "AUTH_CHALLENGE 0123456789abcdef0123456789abcdef",
        "AUTH " + "ab" * 32,
    ]

    def test_canonical_lines_reproduce(self):
        for line in self.CANONICAL:
            self.assertEqual(parse_line(line).to_line(), line)

    def test_every_command_has_a_canonical_example(self):
        self.assertEqual({line.split(" ", 1)[0] for line in self.CANONICAL}, set(COMMANDS_BY_NAME))

    def test_rdata_fields(self):
        cmd = parse_line('RDATA caches master batch ["get_user_by_id",["@a:hs"],1490197670513]')
        self.assertEqual(cmd, RdataCommand("caches", "master", None, ["get_user_by_id", ["@a:hs"],
                                                                      1490197670513]))
        cmd = parse_line('RDATA events master 14 ["$1:h", "!r:h", "m.room.guest_access", "", null]')
        self.assertEqual(cmd.token, 14)
        self.assertEqual(cmd.row, ["$1:h", "!r:h", "m.room.guest_access", "", None])
        # Synapse-era spacing inside the JSON is accepted and written compactly.
        self.assertEqual(cmd.to_line(),
                         'RDATA events master 14 ["$1:h","!r:h","m.room.guest_access","",null]')

    def test_rdata_row_with_spaces_and_escaped_newline(self):
        line = 'RDATA s w 3 ["a b  c","line1\\nline2",{"k y":[1, 2]}]'
        cmd = parse_line(line)
        self.assertEqual(cmd.row, ["a b  c", "line1\nline2", {"k y": [1, 2]}])
        self.assertEqual(cmd.to_line(), 'RDATA s w 3 ["a b  c","line1\\nline2",{"k y":[1,2]}]')

    def test_non_ascii_is_raw_utf8_and_escapes_are_accepted(self):
        self.assertEqual(RdataCommand("s", "w", 1, ["é"]).to_line().encode("utf-8"),
                         b'RDATA s w 1 ["\xc3\xa9"]')
        self.assertEqual(parse_line('RDATA s w 1 ["\\u00e9"]').row, ["é"])

    def test_position(self):
        self.assertEqual(PositionCommand("events", "master", 53, 53).to_line(),
                         "POSITION events master 53 53")
        self.assertEqual(parse_line("POSITION events master 1 53"),
                         PositionCommand("events", "master", 1, 53))

    def test_replicate_with_and_without_trailing_space(self):
        self.assertEqual(parse_line("REPLICATE"), ReplicateCommand())
        self.assertEqual(parse_line("REPLICATE "), ReplicateCommand())
        self.assertEqual(ReplicateCommand().to_line(), "REPLICATE ")

    def test_text_commands_keep_spaces(self):
        self.assertEqual(parse_line("ERROR invalid command: SERVER"),
                         ErrorCommand("invalid command: SERVER"))
        self.assertEqual(parse_line("PING"), PingCommand(""))
        self.assertEqual(parse_line("ERROR"), ErrorCommand(""))
        self.assertEqual(PingCommand("").to_line(), "PING ")

    def test_user_sync(self):
        cmd = parse_line("USER_SYNC worker1 @bob:hs None start 1490197670513")
        self.assertEqual(cmd, UserSyncCommand("worker1", "@bob:hs", None, True, 1490197670513))
        cmd = parse_line("USER_SYNC worker1 @bob:hs DEV end 5")
        self.assertEqual(cmd, UserSyncCommand("worker1", "@bob:hs", "DEV", False, 5))

    def test_user_ip_and_lock_released(self):
        cmd = parse_line('USER_IP @u:hs ["tok","::1","Agent 1.0",null,7]')
        self.assertEqual(cmd, UserIpCommand("@u:hs", "tok", "::1", "Agent 1.0", None, 7))
        cmd = parse_line('LOCK_RELEASED ["master","name","key with space"]')
        self.assertEqual(cmd, LockReleasedCommand("master", "name", "key with space"))

    def test_encode_position_line(self):
        self.assertEqual(encode_position_line("events", "master", 53, 54),
                         b"POSITION events master 53 54\n")
        self.assertEqual(
            encode_position_line("events", "master", 53, 54),
            PositionCommand("events", "master", 53, 54).to_line().encode() + b"\n",
        )


class DirectionTests(SynchronousTestCase):
    def test_every_command_has_a_direction(self):
        self.assertLessEqual(CLIENT_WRITER_COMMANDS, SERVER_COMMANDS)
        self.assertEqual(SERVER_COMMANDS | CLIENT_COMMANDS, set(COMMANDS_BY_NAME))


class MalformedTests(SynchronousTestCase):
    BAD = [
        "",
        "FOO",
        "FOO bar",
        "rdata caches master 1 []",
        " RDATA caches master 1 []",
        # RDATA
        "RDATA",
        "RDATA caches",
        "RDATA caches master",
        "RDATA caches master 1",
        "RDATA caches master x []",
        "RDATA caches master 1.5 []",
        "RDATA caches master +1 []",
        "RDATA caches master ١ []",
        "RDATA caches master BATCH []",
        "RDATA caches master 1 [",
        "RDATA caches master 1 {}",
        'RDATA caches master 1 "row"',
        "RDATA caches master 1 [NaN]",
        "RDATA caches master 1 [Infinity]",
        "RDATA caches master 1 [1e999]",
        "RDATA caches master 1 [1] [2]",
        "RDATA caches master 1 " + "[" * 100000,
        "RDATA  master 1 []",
        "RDATA caches  1 []",
        # POSITION
        "POSITION events master 1",
        "POSITION events master 1 x",
        "POSITION events master 1 2 3",
        "POSITION events master  2",
        # USER_SYNC
        "USER_SYNC w @u:hs None start",
        "USER_SYNC w @u:hs None started 1",
        "USER_SYNC w @u:hs None START 1",
        "USER_SYNC w @u:hs None start x",
        "USER_SYNC w @u:hs None start 1 2",
        # FEDERATION_ACK
        "FEDERATION_ACK w",
        "FEDERATION_ACK w x",
        "FEDERATION_ACK w 1 2",
        # USER_IP
        "USER_IP @u:hs",
        "USER_IP @u:hs [",
        'USER_IP @u:hs ["tok","ip","ua",null]',
        'USER_IP @u:hs ["tok","ip","ua",null,"1"]',
        'USER_IP @u:hs ["tok","ip","ua",null,true]',
        'USER_IP @u:hs ["tok","ip","ua",3,1]',
        'USER_IP @u:hs {"a":1}',
        # LOCK_RELEASED
        "LOCK_RELEASED",
        'LOCK_RELEASED ["a","b"]',
        'LOCK_RELEASED ["a","b",1]',
        "LOCK_RELEASED a b c",
        # missing single fields
        "SERVER",
        "SERVER ",
        "NAME",
        "CLEAR_USER_SYNC",
        "REMOTE_SERVER_UP ",
        "NEW_ACTIVE_TASK",
        "CANCEL_TASK ",
        # REPLICATE takes nothing
        "REPLICATE now",
    ]

    def test_every_malformed_line_raises(self):
        for line in self.BAD:
            with self.assertRaises(CommandParseError, msg=repr(line[:60])):
                parse_line(line)

    def test_error_text_is_short_and_one_line(self):
        for line in self.BAD:
            try:
                parse_line(line)
            except CommandParseError as e:
                text = str(e)
                self.assertNotIn("\n", text)
                self.assertLess(len(text), 400, text)

    def test_error_text_names_the_problem(self):
        cases = {
            "FOO bar": "unknown command 'FOO'",
            "RDATA caches master x []": "RDATA: token is not an integer: 'x'",
            "USER_SYNC w @u:hs None middle 1":
                "USER_SYNC: state is neither start nor end: 'middle'",
            "RDATA caches master 1 {}": "RDATA: row is not a JSON array",
            # A key given twice is refused, not read as its last value.
            'RDATA caches master 1 ["f",{"a":{"k":1,"k":2}},1]':
                "RDATA: invalid JSON in row: \"duplicate key 'k'\"",
        }
        for line, expected in cases.items():
            with self.assertRaises(CommandParseError) as cm:
                parse_line(line)
            self.assertEqual(str(cm.exception), expected)

    def test_huge_numbers_in_every_integer_field_are_parse_errors(self):
        # Python refuses int() of more than 4,300 digits with a ValueError:
        # that must never escape as anything but a CommandParseError.
        huge = "9" * 5000
        lines = [
            f"RDATA caches master {huge} []",
            f"POSITION caches master {huge} 1",
            f"POSITION caches master 1 {huge}",
            f"USER_SYNC w @u:hs None start {huge}",
            f"FEDERATION_ACK w {huge}",
            f"USER_IP @u:hs [\"t\",\"ip\",\"ua\",null,{huge}]",
            f"RDATA caches master 1 [{huge}]",
        ]
        for line in lines:
            with self.assertRaises(CommandParseError, msg=line[:40]) as cm:
                parse_line(line)
            self.assertLess(len(str(cm.exception)), 400)

    def test_integer_fields_are_63_bit_and_not_negative(self):
        top = 2**63 - 1
        self.assertEqual(parse_line(f"POSITION s w 0 {top}").new_token, top)
        self.assertEqual(parse_line(f"RDATA s w {top} []").token, top)
        for value in (str(2**63), "-1", "-0", "+1", "0x10", "1_000", "١٢"):
            for line in (f"POSITION s w 1 {value}", f"RDATA s w {value} []",
                         f"FEDERATION_ACK w {value}", f"USER_SYNC w @u None end {value}"):
                with self.assertRaises(CommandParseError, msg=line):
                    parse_line(line)
        with self.assertRaises(CommandParseError) as cm:
            parse_line(f"POSITION s w 1 {2**63}")
        self.assertEqual(str(cm.exception),
                         "POSITION: new_token is out of range (0 to 2**63-1): "
                         "'9223372036854775808'")

    @given(st.text(max_size=60))
    def test_arbitrary_text_parses_or_raises_parse_error(self, line):
        try:
            cmd = parse_line(line)
        except CommandParseError:
            return
        self.assertIn(cmd.NAME, COMMANDS_BY_NAME)


def _decode_batches(lines):
    """Parse wire lines back into (token, row) pairs, applying the batch
    rule: buffered batch rows take the token of the numeric line ending
    them."""
    out, pending = [], []
    for line in lines:
        assert line.endswith(b"\n") and line.count(b"\n") == 1, line
        cmd = parse_line(line[:-1].decode("utf-8"))
        pending.append(cmd.row)
        if cmd.token is not None:
            out.extend((cmd.token, row) for row in pending)
            pending = []
    assert not pending, "batch left open"
    return out


class EncodeRdataLinesTests(SynchronousTestCase):
    def test_batch_marking(self):
        updates = [
            (53, ["get_user_by_id", ["@z:hs"], 1]),
            (54, ["get_user_by_id", ["@a:hs"], 1490197670513]),
            (54, ["get_user_by_id", ["@b:hs"], 1490197670513]),
            (54, ["get_user_by_id", ["@c:hs"], 1490197670513]),
            (55, ["x", None, 2]),
            (56, ["y", None, 3]),
            (56, ["z", None, 3]),
        ]
        lines = encode_rdata_lines("caches", "master", updates)
        self.assertEqual(
            list(lines),
            [
                b'RDATA caches master 53 ["get_user_by_id",["@z:hs"],1]\n',
                b'RDATA caches master batch ["get_user_by_id",["@a:hs"],1490197670513]\n',
                b'RDATA caches master batch ["get_user_by_id",["@b:hs"],1490197670513]\n',
                b'RDATA caches master 54 ["get_user_by_id",["@c:hs"],1490197670513]\n',
                b'RDATA caches master 55 ["x",null,2]\n',
                b'RDATA caches master batch ["y",null,3]\n',
                b'RDATA caches master 56 ["z",null,3]\n',
            ],
        )
        self.assertEqual(lines.dropped, 0)

    def test_empty(self):
        lines = encode_rdata_lines("s", "w", [])
        self.assertEqual((list(lines), lines.dropped), ([], 0))

    def test_same_bytes_as_the_command_classes(self):
        updates = [(1, ["a b", {"k": "é\n"}]), (1, [True, 1.5]), (2, [2**70])]
        lines = encode_rdata_lines("events", "w1", updates)
        self.assertEqual(
            list(lines),
            [
                RdataCommand("events", "w1", None, ["a b",
                                                    {"k": "é\n"}]).to_line().encode() + b"\n",
                RdataCommand("events", "w1", 1, [True, 1.5]).to_line().encode() + b"\n",
                RdataCommand("events", "w1", 2, [2**70]).to_line().encode() + b"\n",
            ],
        )

    def test_over_long_rows_are_dropped_and_counted(self):
        limit = 100
        big = ["x" * 200]
        updates = [(1, ["a"]), (1, big), (2, ["b"]), (2, big), (3, big), (4, ["c"])]
        lines = encode_rdata_lines("s", "w", updates, max_line_length=limit)
        # Token 2's last row is dropped: its remaining row carries the token,
        # so the batch is still closed; token 3 disappears entirely.
        self.assertEqual(
            list(lines),
            [b'RDATA s w 1 ["a"]\n', b'RDATA s w 2 ["b"]\n', b'RDATA s w 4 ["c"]\n'],
        )
        self.assertEqual(lines.dropped, 3)

    def test_length_limit_is_exact(self):
        # The row is written as a batch line (the longest prefix here).
        limit = 64
        room = limit - len(b"RDATA s w batch ") - len(b'[""]')
        for size, kept in ((room, True), (room + 1, False)):
            lines = encode_rdata_lines("s", "w", [(1, ["x" * size]), (1, ["y"])],
                                       max_line_length=limit)
            if kept:
                self.assertEqual(len(lines), 2)
                self.assertEqual(lines.dropped, 0)
                self.assertEqual(len(lines[0]) - 1, limit)
                self.assertTrue(lines[0].startswith(b"RDATA s w batch "))
            else:
                self.assertEqual(list(lines), [b'RDATA s w 1 ["y"]\n'])
                self.assertEqual(lines.dropped, 1)

    def test_limit_accounts_for_long_tokens(self):
        # A token longer than "batch" makes the numeric prefix the longest.
        limit = 64
        token = 10**20
        room = limit - len(b"RDATA s w %d " % token) - len(b'[""]')
        lines = encode_rdata_lines("s", "w", [(token, ["x" * room])], max_line_length=limit)
        self.assertEqual([len(line) - 1 for line in lines], [limit])
        lines = encode_rdata_lines("s", "w", [(token, ["x" * (room + 1)])], max_line_length=limit)
        self.assertEqual((list(lines), lines.dropped), ([], 1))

    def test_unserializable_rows_are_dropped(self):
        lines = encode_rdata_lines("s", "w", [(1, [object()]), (1, ["ok"]), (2, [{1, 2}])])
        self.assertEqual((list(lines), lines.dropped), ([b'RDATA s w 1 ["ok"]\n'], 2))

    @settings(max_examples=300)
    @given(
        names,
        names,
        st.lists(st.tuples(st.integers(min_value=0, max_value=2**63 - 1), rows), max_size=20),
    )
    def test_decodes_to_the_input(self, stream, instance, updates):
        updates = sorted(updates, key=lambda u: u[0])
        lines = encode_rdata_lines(stream, instance, updates, max_line_length=10**9)
        self.assertEqual(lines.dropped, 0)
        self.assertEqual(len(lines), len(updates))
        self.assertEqual(_decode_batches(lines), updates)
        # Exactly one numeric line per distinct token, batch lines otherwise.
        numeric = [parse_line(line[:-1].decode()).token for line in lines]
        self.assertEqual([t for t in numeric if t is not None], sorted({t for t, _ in updates}))


# Rows as the fan-out gets them: JSON values, sometimes one orjson refuses
# (a set, an integer over 64 bits) or one too long for a small line limit.
_row_values = st.one_of(
    st.none(), st.booleans(), st.integers(min_value=-(2 ** 70), max_value=2 ** 70),
    st.text(max_size=30), st.just(float("nan")), st.frozensets(st.integers(), max_size=2),
)


@st.composite
def _updates(draw):
    token = draw(st.integers(min_value=-5, max_value=10 ** 12))
    out = []
    for _ in range(draw(st.integers(min_value=0, max_value=12))):
        token += draw(st.sampled_from([0, 0, 1, 7]))
        out.append((token, draw(st.lists(_row_values, max_size=3))))
    return out


class EncodeFastPathTests(SynchronousTestCase):
    """The comprehension fast path of encode_rdata_lines gives exactly the
    bytes (and drop count) of the row-by-row encoder it falls back to."""

    @settings(max_examples=400, deadline=None)
    @given(_updates(), st.one_of(st.just(10 ** 6), st.integers(min_value=10, max_value=120)))
    def test_same_bytes_as_row_by_row(self, updates, limit):
        fast = encode_rdata_lines("caches", "master", updates, max_line_length=limit)
        each = _encode_rdata_lines_each("caches", "master", updates, max_line_length=limit)
        self.assertEqual(list(fast), list(each))
        self.assertEqual(fast.dropped, each.dropped)
        self.assertEqual(joined(fast), b"".join(each))

    def test_batches_without_fallback(self):
        updates = [(5, ["a"]), (5, ["b"]), (6, ["c"]), (7, ["d"]), (7, ["e"])]
        self.assertEqual(
            b"".join(encode_rdata_lines("s", "w", updates)),
            b'RDATA s w batch ["a"]\nRDATA s w 5 ["b"]\nRDATA s w 6 ["c"]\n'
            b'RDATA s w batch ["d"]\nRDATA s w 7 ["e"]\n')

    def test_joined_once(self):
        lines = encode_rdata_lines("s", "w", [(1, ["a"]), (2, ["b"])])
        self.assertIs(joined(lines), joined(lines))
        self.assertEqual(joined(lines), b'RDATA s w 1 ["a"]\nRDATA s w 2 ["b"]\n')
        self.assertEqual(joined([b"x\n"]), b"x\n")
        self.assertEqual(joined([b"x\n", b"y\n"]), b"x\ny\n")

    def test_accepts_an_iterator(self):
        lines = encode_rdata_lines("s", "w", iter([(1, ["a"]), (1, ["b"])]))
        self.assertEqual(list(lines), [b'RDATA s w batch ["a"]\n', b'RDATA s w 1 ["b"]\n'])


class NonFiniteTests(SynchronousTestCase):
    """NaN and the infinities are refused on encoding, as on decoding:
    orjson alone would write them as ``null``, a different value."""

    VALUES = [float("nan"), float("inf"), float("-inf")]

    def test_encode_json_refuses_them_anywhere(self):
        for bad in self.VALUES:
            for value in (bad, [1, bad], {"a": [None, {"b": bad}]}, [2**70, bad], ("t", bad)):
                self.assertRaises(ValueError, encode_json, value)
        self.assertEqual(encode_json([None, 1.5, {"a": None}]), b'[null,1.5,{"a":null}]')

    def test_command_lines_refuse_them(self):
        for bad in self.VALUES:
            self.assertRaises(ValueError, RdataCommand("s", "w", 1, [None, bad]).to_line)

    def test_rdata_rows_holding_them_are_dropped(self):
        updates = [(1, ["a", None]), (1, [float("nan")]), (2, [{"x": float("inf")}]),
                   (3, [None, 0.5])]
        for encode in (encode_rdata_lines, _encode_rdata_lines_each):
            lines = encode("s", "w", updates)
            self.assertEqual(list(lines), [b'RDATA s w 1 ["a",null]\n',
                                           b'RDATA s w 3 [null,0.5]\n'])
            self.assertEqual(lines.dropped, 2)


class EncodeAtOnceTests(SynchronousTestCase):
    """All rows in one orjson call give exactly the row-by-row bytes, or
    decline (None) and leave it to the other paths."""

    @settings(max_examples=400, deadline=None)
    @given(st.text(min_size=1, max_size=5).filter(lambda s: " " not in s and "\n" not in s),
           _updates(), st.one_of(st.just(10 ** 6), st.integers(min_value=10, max_value=120)))
    def test_same_bytes_as_row_by_row_or_declines(self, stream, updates, limit):
        each = _encode_rdata_lines_each(stream, "w", updates, max_line_length=limit)
        if updates:
            prefix = b"RDATA " + stream.encode() + b" w "
            tokens, rows = zip(*updates)
            data = _encode_at_once(prefix, tokens, rows, limit)
            if data is not None:
                self.assertEqual(data, b"".join(each))
                self.assertEqual(each.dropped, 0)
        lines = encode_rdata_lines(stream, "w", updates, max_line_length=limit)
        self.assertEqual(list(lines), list(each))
        self.assertEqual(joined(lines), b"".join(each))

    def test_used_for_plain_rows_and_batches(self):
        updates = [(5, ["a", [1], None]), (5, []), (6, ["%d %s"]), (7, [{"k": [2]}])]
        data = _encode_at_once(b"RDATA s%% w ", *zip(*updates), 1000)
        self.assertEqual(data, b'RDATA s%% w batch ["a",[1],null]\nRDATA s%% w 5 []\n'
                               b'RDATA s%% w 6 ["%d %s"]\nRDATA s%% w 7 [{"k":[2]}]\n')

    def test_any_row_content_in_one_call(self):
        # Rows holding what splits JSON arrays (``],[``), or that are not
        # arrays, need no row-by-row path.
        rows = (["],["], [[1], [2]], {"k": [[3], [4]]}, "x", [], ["\x00", ",\x00,"])
        tokens = tuple(range(1, len(rows) + 1))
        data = _encode_at_once(b"RDATA s w ", tokens, rows, 1000)
        self.assertEqual(data, b"".join(b"RDATA s w %d " % t + orjson.dumps(r) + b"\n"
                                        for t, r in zip(tokens, rows)))

    def test_long_rows_within_the_limit_in_one_call(self):
        # Many rows, some close to the limit: the cheap window check or the
        # exact one keeps them; one byte more declines.
        limit = 2000
        room = limit - len(b"RDATA s w batch ") - len(b'[""]')
        for sizes in ([10] * 300, [room] * 20, [10] * 100 + [room] + [10] * 100):
            rows = tuple(["x" * size] for size in sizes)
            tokens = tuple(range(1, len(rows) + 1))
            data = _encode_at_once(b"RDATA s w ", tokens, rows, limit)
            self.assertEqual(data, b"".join(_encode_rdata_lines_each(
                "s", "w", list(zip(tokens, rows)), max_line_length=limit)))
            longer = rows[:-1] + (["x" * (room + 1)],)
            self.assertIsNone(_encode_at_once(b"RDATA s w ", tokens, longer, limit))


class FieldsTests(SynchronousTestCase):
    """``fields()`` names a command's arguments as the protocol does (what
    ``tail --json`` prints), for the text-only commands too."""

    def test_fields_are_named_as_on_the_wire(self):
        from replicator.replication.wire.commands import (
            NameCommand,
            PingCommand,
            PositionCommand,
            ServerCommand,
        )

        self.assertEqual(ServerCommand("hs.test").fields(), {"server_name": "hs.test"})
        self.assertEqual(NameCommand("worker1").fields(), {"client_name": "worker1"})
        self.assertEqual(PingCommand("123").fields(), {"data": "123"})
        self.assertEqual(PositionCommand("caches", "master", 1, 2).fields(),
                         {"stream_name": "caches", "instance_name": "master",
                          "prev_token": 1, "new_token": 2})
