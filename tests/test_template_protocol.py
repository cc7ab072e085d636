"""The slot template protocol on its own (no cluster): each message crosses a
real pipe and arrives as itself; a frame that is no message for the end that
reads it is a clear error, and a keeper whose template sends one lets the
template go and fails its waiting slots with that error instead of hanging."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading

import pytest
from support.wait import wait_until

from fiber_dask.engine import slots
from fiber_dask.engine import templateprotocol as proto
from fiber_dask.engine.slotpipe import FrameReader, write_frame

pytestmark = pytest.mark.timeout(60)

MESSAGES = [
    proto.Fork(0, b"\x80spec" * 1000),
    proto.Started(1, 4242),
    proto.Restarted(2, 4343),
    proto.Exited(3, -9, None),
    proto.Exited(4, 0, "recycled"),
    proto.Failed(5, "fork failed: [Errno 11] Resource temporarily unavailable"),
]


def _through_a_pipe(frames: list) -> list:
    r, w = os.pipe()
    try:
        for frame in frames:
            write_frame(w, frame)
        os.close(w)
        w = -1
        reader, out = FrameReader(r), []
        while (got := reader.read()) is not None:
            out.extend(got)
        return out
    finally:
        os.close(r)
        if w >= 0:
            os.close(w)


def test_each_message_round_trips_through_a_pipe_to_the_end_that_reads_it():
    frames = _through_a_pipe([proto.encode(m) for m in MESSAGES])
    for sent, frame in zip(MESSAGES, frames, strict=True):
        expected = proto.REQUESTS if type(sent) is proto.Fork else proto.REPORTS
        got = proto.decode(frame, expected)
        assert type(got) is type(sent) and got.fields() == sent.fields(), got
        assert got == sent
    assert not proto.REQUESTS & proto.REPORTS


def test_an_unknown_tag_is_a_clear_error():
    with pytest.raises(ValueError, match=r"unknown message 'fork'.*known tags: F, "):
        proto.decode(("fork", 0, b"spec"), proto.REQUESTS)
    with pytest.raises(ValueError, match="unknown message"):
        proto.decode((), proto.REPORTS)


def test_a_frame_with_other_fields_is_a_clear_error():
    with pytest.raises(ValueError, match=r"Exited has 3 fields .*, the frame 2"):
        proto.decode((proto.Exited.tag, 1, 0), proto.REPORTS)


def test_a_message_the_other_way_is_a_clear_error():
    with pytest.raises(ValueError, match="a Started came the wrong way"):
        proto.decode(proto.encode(proto.Started(1, 2)), proto.REQUESTS)
    with pytest.raises(ValueError, match=r"a Fork came the wrong way .*Exited"):
        proto.decode(proto.encode(proto.Fork(1, b"")), proto.REPORTS)


def test_a_template_that_sends_no_message_is_let_go_and_fails_its_slots():
    # A stand-in template: sends a frame that is no report, then reads its
    # stdin until EOF.  The keeper must not wait on it forever.
    report_r, report_w = os.pipe()
    script = textwrap.dedent(
        f"""
        import sys
        from fiber_dask.engine.slotpipe import write_frame
        write_frame({report_w}, ("Z", 0))
        sys.stdin.buffer.read()  # until the keeper lets it go
        """
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", script],
        stdin=subprocess.PIPE,
        pass_fds=(report_w,),
        env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)},
    )
    os.close(report_w)
    template = slots.Template.__new__(slots.Template)  # its process is ours
    template.lock = threading.Lock()
    template.forks, template.next_id, template.dead = {}, 0, False
    template.proc = proc
    reader = threading.Thread(target=template._read_reports, args=(report_r,))
    try:
        spec = slots.SlotSpec(("h", 1), b"k", "s", 0, None, None, None, {})
        fork = template.fork(spec)  # waiting for its Started when the frame comes
        reader.start()
        wait_until(fork.done.is_set, 20, "the keeper to fail the waiting slot")
        assert "unknown message 'Z'" in fork.error
        assert template.dead
        wait_until(lambda: proc.poll() is not None, 20, "the template to be let go")
        reader.join(20)
        assert not reader.is_alive()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
