"""The pool wire protocol on its own (no cluster): the two ends of the function
cache agree whatever the sequence, messages round-trip, failures keep their
type or say what they were."""

from __future__ import annotations

import pickle
import random

import pytest
from tasks.poolcore import NeedsArgs

from fiber_dask.engine import poolprotocol as proto
from fiber_dask.errors import RemoteTaskError


def _call(peer: proto.PeerFunctions, fid: int, blobs: dict) -> proto.Call:
    send, evict = peer.use(fid)
    return proto.Call(0, fid, blobs[fid] if send else None, 0, b"", 0, evict)


def test_owner_and_loop_agree_on_every_function_under_a_long_random_run():
    rng = random.Random(11)
    blobs = {fid: pickle.dumps(("f", fid)) for fid in range(3000)}
    peer = proto.PeerFunctions(limit=64)
    loaded = []
    loop = proto.LoopFunctions(lambda blob: loaded.append(blob) or pickle.loads(blob))
    for step in range(20000):
        # One hot function, a warm set, and a long tail of new ones.
        fid = rng.choice([0] * 5 + list(range(1, 40)) + [rng.randrange(40, 3000)])
        raw = proto.encode_frame([(3, proto.Calls([_call(peer, fid, blobs)]))])
        ((number, calls),) = proto.decode_frame(raw)
        (call,) = calls.calls
        assert number == 3
        assert loop.lookup(call) == ("f", fid), step
        assert len(loop) == len(peer) <= 64
    # The hot function was loaded once or a few times, not on every call.
    assert loaded.count(blobs[0]) < 10


def test_a_function_that_fails_to_load_keeps_failing_then_loads_when_it_can():
    state = {"ok": False}

    def load(blob):
        if not state["ok"]:
            raise ModuleNotFoundError("No module named 'only_on_the_owner'")
        return pickle.loads(blob)

    peer, loop = proto.PeerFunctions(), proto.LoopFunctions(load)
    blobs = {7: pickle.dumps("seven")}
    for _ in range(3):
        with pytest.raises(ModuleNotFoundError, match="only_on_the_owner"):
            loop.lookup(_call(peer, 7, blobs))
    state["ok"] = True  # e.g. the module was installed meanwhile
    assert loop.lookup(_call(peer, 7, blobs)) == "seven"


def test_messages_round_trip_in_one_frame_each_with_its_loop():
    calls = [proto.Call(k, 7, None, 0, b"p%d" % k, 0, ()) for k in range(3)]
    sent = [
        (5, proto.Attach(1234, "tcp://127.0.0.1:1")),
        (5, proto.Calls(calls)),
        (9, proto.Results([proto.Result(3, True, b"x", 0.5, False)])),
        (5, proto.InitFailed(b"e")),
        (9, proto.STOP),
        (5, proto.TERMINATE),
        (9, proto.Gone(proto.Reason.STOPPED)),
    ]
    got = proto.decode_frame(proto.encode_frame(sent))
    assert [loop for loop, _ in got] == [5, 5, 9, 5, 9, 5, 9]
    assert [type(m) for _, m in got] == [type(m) for _, m in sent]
    (_, a), (_, c), (_, r), (_, i), (_, stop), (_, term), (_, g) = got
    assert (a.pid, a.worker) == (1234, "tcp://127.0.0.1:1")
    assert [x.fields() for x in c.calls] == [x.fields() for x in calls]
    (r,) = r.results
    assert (r.ckey, r.ok, r.blob, r.seconds, r.last) == (3, True, b"x", 0.5, False)
    assert i.blob == b"e"
    assert stop is proto.STOP and term is proto.TERMINATE
    assert g.reason == proto.Reason.STOPPED


class _Local:
    pass


def test_items_pickle_plainly_only_when_plain():
    import cloudpickle

    plain = [1, 2.5, "s", b"b", None, True, 1j, (1, "a"), 10**30]
    assert pickle.loads(proto.dumps_items(plain)) == plain
    assert proto.dumps_items(plain) == pickle.dumps(plain, pickle.HIGHEST_PROTOCOL)
    # Anything else takes cloudpickle (by value for what lives in __main__).
    other = [1, _Local, (1, [2])]
    assert proto.dumps_items(other) == cloudpickle.dumps(other, pickle.HIGHEST_PROTOCOL)
    with pytest.raises(TypeError, match="generator"):
        proto.dumps_items([(x for x in ())])  # what pickling raises, as it is


def test_numpy_items_pickle_plainly_unless_they_hold_objects():
    import cloudpickle

    np = pytest.importorskip("numpy")
    theta = np.arange(5.0)
    plain = [(theta, 3, np.float64(0.5)), theta, np.int64(7)]
    blob = proto.dumps_items(plain)
    assert blob == pickle.dumps(plain, pickle.HIGHEST_PROTOCOL)
    got = pickle.loads(blob)
    assert (got[0][0] == theta).all() and got[0][1:] == (3, 0.5) and got[2] == 7
    # Object arrays may hold anything (a class of __main__): cloudpickle; so do
    # ndarray subclasses, whose class must be resolved on the loop.
    for other in ([np.array([_Local()], dtype=object)], [(np.ma.masked_array([1]),)]):
        assert proto.dumps_items(other) == cloudpickle.dumps(
            other, pickle.HIGHEST_PROTOCOL
        )


def test_items_pickle_while_another_thread_still_imports_numpy(monkeypatch):
    """numpy half-imported by another thread (the embedded cluster's start
    imports distributed while a first pool's early slots serve) is no numpy
    yet: items pickle as when it is absent, instead of failing on its missing
    attributes ("partially initialized module 'numpy' has no attribute
    'ndarray'", seen in a pool's first tasks)."""
    import importlib.machinery
    import sys
    import types

    import cloudpickle

    half = types.ModuleType("numpy")
    half.__spec__ = importlib.machinery.ModuleSpec("numpy", None)
    half.__spec__._initializing = True
    monkeypatch.setitem(sys.modules, "numpy", half)
    other = [(_Local(), 1), _Local()]
    assert proto.dumps_items(other) == cloudpickle.dumps(other, pickle.HIGHEST_PROTOCOL)


def test_an_array_many_chunks_of_a_frame_share_travels_once():
    np = pytest.importorskip("numpy")
    theta = np.arange(1000.0)  # 8 KB, as an ES theta
    shared = proto.Shared()
    chunks = [[(theta, seed, 1), (theta, seed, -1)] for seed in range(50)]
    calls = [
        proto.Call(k, 1, None, 1, proto.dumps_items(items, shared), 0)
        for k, items in enumerate(chunks)
    ]
    assert len(shared) == 1
    frame = proto.encode_frame(
        [(k % 5, proto.Calls([c])) for k, c in enumerate(calls)], shared
    )
    assert theta.nbytes < len(frame) < 2 * theta.nbytes  # once, not 100 times
    got = []
    for _, msg in proto.decode_frame(frame):
        (call,) = msg.calls
        got.append(proto.loads_items(call.payload, msg.shared))
    assert [[(s, sign) for _, s, sign in items] for items in got] == [
        [(s, 1), (s, -1)] for s in range(50)
    ]
    assert all((t == theta).all() for items in got for t, _, _ in items)
    # Within a chunk the two items hold one array, as pickle's memo gave them;
    # each chunk its own, so a task that changes it changes no other's.
    assert got[0][0][0] is got[0][1][0]
    got[0][0][0][:] = -1
    assert (got[1][0][0] == theta).all()


def test_small_arrays_and_other_items_are_not_shared():
    import cloudpickle

    np = pytest.importorskip("numpy")
    shared = proto.Shared()
    small = np.arange(10.0)  # below SHARE_BYTES
    blob = proto.dumps_items([(small, 1)], shared)
    assert blob == pickle.dumps([(small, 1)], pickle.HIGHEST_PROTOCOL)
    big = np.arange(1000.0)
    other = [(big, _Local)]  # cloudpickle's path pickles the array within
    assert proto.dumps_items(other, shared) == cloudpickle.dumps(
        other, pickle.HIGHEST_PROTOCOL
    )
    assert len(shared) == 0
    assert proto.encode_frame([(1, proto.STOP)], shared) == proto.encode_frame(
        [(1, proto.STOP)]
    )


def test_lost_chunks_are_those_of_the_oldest_unanswered_calls():
    assert proto.lost_chunks([]) == ([], [])
    # Calls 4 had a, b, c (a answered already: not listed); 5 and 6 never
    # started.
    unanswered = [(4, False, "b"), (4, False, "c"), (5, True, "d"), (6, True, "e")]
    assert proto.lost_chunks(unanswered) == (["b", "c"], ["d", "e"])
    # The first chunk of a Calls is answered on its own: lost in it, the loop
    # ran only that one.
    unanswered = [(4, True, "a"), (4, False, "b"), (5, True, "c")]
    assert proto.lost_chunks(unanswered) == (["a"], ["b", "c"])
    assert proto.lost_chunks([(9, False, "x")]) == (["x"], [])


def _raised(exc):
    try:
        raise exc
    except BaseException as e:
        return e


def test_failures_keep_their_type_and_message():
    err = proto.decode_failure(proto.encode_failure(_raised(ValueError("plain"))))
    assert type(err) is ValueError and str(err) == "plain"
    assert "ValueError: plain" in str(err.__cause__)

    err = proto.decode_failure(proto.encode_failure(_raised(NeedsArgs("a", "b"))))
    assert type(err) is NeedsArgs and str(err) == "ab" and err.b == "b"


def test_a_failure_the_owner_cannot_rebuild_is_a_remote_task_error():
    class Local(Exception):  # not importable by name: pickled by value or not at all
        def __init__(self, a, b):
            super().__init__(f"{a}/{b}")

    raw = proto.encode_failure(_raised(Local(1, 2)))
    blob, name, message, tb = pickle.loads(raw)
    # Simulate an owner that cannot load the exception itself.
    err = proto.decode_failure(pickle.dumps((b"not a pickle", name, message, tb)))
    assert isinstance(err, RemoteTaskError)
    assert err.type_name.endswith("Local") and err.message == "1/2"
    assert "Local: 1/2" in err.traceback
