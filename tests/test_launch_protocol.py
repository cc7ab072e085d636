"""The launch protocol (Process parent ⇄ launcher): every message round-trips,
anything else is refused with a clear error, and a parent fed by a hand-made
launcher does what the messages say (output to the right stream, the pid, the
exit status) and ends the Process, saying why, on a frame it cannot read."""

from __future__ import annotations

import pickle
import signal

import pytest

from fiber_dask.comm import channel, security
from fiber_dask.launch import launchprotocol as proto
from fiber_dask.process import Process

EVERY_MESSAGE = [
    proto.Payload(b"\x00payload" * 1000),
    proto.Signal(signal.SIGTERM),
    proto.Started(4242),
    proto.StartFailed("cannot start the child process on tcp://x:1: ENOMEM"),
    proto.Output(1, b"out\n"),
    proto.Output(2, b"\xff not utf-8"),
    proto.Exit(-9),
]


def fields(msg) -> dict:
    return {name: getattr(msg, name) for name in type(msg).__slots__}


@pytest.mark.parametrize("msg", EVERY_MESSAGE, ids=lambda m: type(m).__name__)
def test_every_message_round_trips(msg):
    back = proto.decode(proto.encode(msg))
    assert type(back) is type(msg)
    assert fields(back) == fields(msg)


def test_every_message_kind_has_its_own_tag():
    kinds = {type(m) for m in EVERY_MESSAGE}
    assert len({k.tag for k in kinds}) == len(kinds) == 6


def test_an_output_frame_is_no_larger_than_the_tuple_it_replaced():
    # The child's stdout and stderr travel in Output frames: typing them must
    # not cost bytes (the wire before was pickle.dumps(("out", data))).
    data = b"x" * 65536
    before = pickle.dumps(("out", data), protocol=pickle.HIGHEST_PROTOCOL)
    assert len(proto.encode(proto.Output(1, data))) <= len(before)


def test_an_unknown_tag_is_refused_naming_it():
    raw = pickle.dumps(("out", b"the old wire"))
    with pytest.raises(proto.ProtocolError, match=r"unknown message tag 'out'") as e:
        proto.decode(raw)
    assert "same fiber-dask version" in str(e.value)


@pytest.mark.parametrize(
    "raw, says",
    [
        (b"\x80\x05junk", "not a message"),  # not a pickle
        (pickle.dumps(42), "not a message"),  # not a tuple
        (pickle.dumps(()), "not a message"),  # no tag
        (pickle.dumps((proto.Exit.tag,)), "Exit message with 0 fields"),
        (pickle.dumps((proto.Output.tag, 1, b"a", b"b")), "Output message with 3"),
    ],
)
def test_a_frame_that_is_not_a_message_is_refused(raw, says):
    with pytest.raises(proto.ProtocolError, match=says):
        proto.decode(raw)


def test_a_protocol_error_is_a_value_error():
    # The launcher's control loop ends on ValueError (what a broken connection
    # may raise too): a bad frame from the parent counts as the parent lost.
    assert issubclass(proto.ProtocolError, ValueError)


def test_hello_round_trips_through_the_handshake_as_plain_data():
    wire = proto.Hello(123, "tcp://10.0.0.1:4000").to_wire()
    assert pickle.loads(pickle.dumps(wire)) == wire
    assert type(wire) is dict
    back = proto.Hello.from_wire(wire)
    assert (back.pid, back.worker, back.task) == (123, "tcp://10.0.0.1:4000", True)
    beside = proto.Hello.from_wire(proto.Hello(5, None, task=False).to_wire())
    assert beside.task is False
    none = proto.Hello.from_wire(None)  # a peer that sent no hello
    # Not known to be the task: its queued task is cancelled, as for a twin.
    assert (none.pid, none.worker, none.task) == (None, None, False)


def test_the_launch_result_travels_as_a_task_result():
    r = proto.LaunchResult(proto.Outcome.UNREACHABLE, "no route to host")
    assert pickle.loads(pickle.dumps(r)) == r


# --------------------------------------------- the parent, fed by hand


def _waiting_process() -> Process:
    """A started Process whose launcher task no worker can run (a resource
    none has), so the only launcher that ever connects is the test's."""
    p = Process(target=print, resources={"fiber-test-no-such-resource": 1})
    p.start()
    return p


def _connect_as_launcher(p: Process):
    popen = p._popen
    conn = channel.connect(
        popen._server.address,
        security.authkey(),
        popen._service,
        hello=proto.Hello(99999, "tcp://launcher.test:1").to_wire(),
    )
    first = proto.decode(conn.recv_bytes())
    assert type(first) is proto.Payload and first.blob
    return conn


@pytest.mark.timeout(60)
def test_the_parent_does_what_the_launchers_messages_say(capfd):
    p = _waiting_process()
    conn = _connect_as_launcher(p)
    try:
        conn.send_bytes(proto.encode(proto.Started(4242)))
        assert p.pid == 4242
        conn.send_bytes(proto.encode(proto.Output(1, b"to stdout\n")))
        conn.send_bytes(proto.encode(proto.Output(2, b"to stderr\n")))
        p.terminate()
        msg = proto.decode(conn.recv_bytes())
        assert type(msg) is proto.Signal and msg.signum == signal.SIGTERM
        conn.send_bytes(proto.encode(proto.Exit(7)))
        p.join(30)
        assert (p.exitcode, p.reason) == (7, None)
    finally:
        channel.hangup(conn)
    out, err = capfd.readouterr()
    assert "to stdout" in out and "to stdout" not in err
    assert "to stderr" in err and "to stderr" not in out
    assert p._popen.worker == "tcp://launcher.test:1"
    assert p._popen.worker_pid == 99999


@pytest.mark.timeout(60)
def test_a_frame_the_parent_cannot_read_ends_the_process_saying_so():
    p = _waiting_process()
    conn = _connect_as_launcher(p)
    try:
        conn.send_bytes(pickle.dumps(("out", b"an old launcher")))
        p.join(30)
        assert p.exitcode == -signal.SIGKILL
        assert "cannot read" in p.reason and "unknown message tag 'out'" in p.reason
        assert "tcp://launcher.test:1 (pid 99999)" in p.reason
        # The parent hung up: a real launcher kills its child on that.
        assert conn.poll(30), "the parent did not hang up"
        with pytest.raises((EOFError, OSError)):
            conn.recv_bytes()
    finally:
        channel.hangup(conn)
