"""KV events on real sockets: vLLM decodes ours, we decode vLLM's, gaps and late joins repair."""

from __future__ import annotations

import gc
import logging
import math
import re
import socket
import subprocess
import sys
import textwrap
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("zmq")
pytest.importorskip("msgspec")

import zmq

from kvoffload import InvalidArgumentError, KVOffloadError, OffloadingEvent, block_id_key
from kvoffload.observe.events import (
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    decode_batch,
    encode_batch,
)
from kvoffload.observe.indexer import PrefixIndex
from kvoffload.observe.publisher import KVEventPublisher
from kvoffload.observe.subscriber import Delivered, KVEventSubscriber, SubscriberClosedError
from tier_servers import free_port

LOCAL = "tcp://127.0.0.1:0"


def _stored(*ids: int) -> list[OffloadingEvent]:
    return [OffloadingEvent([block_id_key(i) for i in ids], "CPU", removed=False)]


def _receive_until(sub: KVEventSubscriber, count: int, timeout_s: float = 10.0) -> Delivered:
    got: Delivered = []
    deadline = time.monotonic() + timeout_s
    while len(got) < count and time.monotonic() < deadline:
        got += sub.receive(0.2)
    return got


def _connect(pub: KVEventPublisher, sub: KVEventSubscriber) -> None:
    """Publish warm-up batches until one arrives: a SUB socket joins asynchronously."""
    for _ in range(100):
        pub.publish(_stored(99))
        pub.flush()
        if sub.receive(0.1):
            return
    raise AssertionError("the subscriber never connected")


def test_a_late_subscriber_catches_up_then_follows() -> None:
    with KVEventPublisher(LOCAL, LOCAL, block_size=16) as pub:
        for i in range(5):
            pub.publish(_stored(i))
        pub.flush()
        with KVEventSubscriber(pub.endpoint, pub.replay_endpoint) as sub:
            caught_up = sub.catch_up()
            assert [seq for seq, _ in caught_up] == [0, 1, 2, 3, 4]
            _connect(pub, sub)
            first = sub.next_seq
            pub.publish(_stored(5))
            pub.flush()
            later = _receive_until(sub, 1)
    assert [seq for seq, _ in later] == [first]
    event = later[0][1].events[0]
    assert isinstance(event, BlockStored)
    assert event.block_hashes == [(5).to_bytes(8, "big")]
    assert (event.medium, event.block_size, event.group_idx) == ("CPU", 16, 0)


def test_a_catch_up_delivers_only_the_subscribed_topics_batches() -> None:
    """Replay filters by topic prefix as the SUB socket does live: a subscriber of another
    topic would otherwise index a publisher it never subscribed to."""
    with KVEventPublisher(LOCAL, LOCAL, topic="engine-b") as pub:
        pub.publish(_stored(1))
        pub.flush()
        with KVEventSubscriber(pub.endpoint, pub.replay_endpoint, topic="engine-a") as other:
            assert (other.catch_up(), other.next_seq, other.lost) == ([], 0, 0)
        with KVEventSubscriber(pub.endpoint, pub.replay_endpoint, topic="engine") as prefix:
            assert [seq for seq, _ in prefix.catch_up()] == [0]


class _Lossy(KVEventSubscriber):
    """Loses batch ``drop`` the first time it arrives, as a congested PUB socket does."""

    drop = -1
    dropped = False

    def accept(self, seq: int, payload: bytes, delivered: Delivered) -> None:
        if seq == self.drop and not self.dropped:
            self.dropped = True
            return
        super().accept(seq, payload, delivered)


def test_a_dropped_batch_is_detected_by_its_gap_and_repaired() -> None:
    with KVEventPublisher(LOCAL, LOCAL) as pub, _Lossy(pub.endpoint, pub.replay_endpoint) as sub:
        _connect(pub, sub)
        first, gaps, repaired = sub.next_seq, sub.gaps, sub.repaired
        sub.drop = first + 2
        for i in range(6):
            pub.publish(_stored(i))
        pub.flush()
        got = _receive_until(sub, 6)
    assert sub.dropped
    assert [seq for seq, _ in got] == list(range(first, first + 6))
    assert (sub.gaps - gaps, sub.repaired - repaired) == (1, 1)


def test_a_gap_without_replay_is_counted_and_skipped() -> None:
    with KVEventPublisher(LOCAL) as pub, _Lossy(pub.endpoint) as sub:
        _connect(pub, sub)
        first, gaps, lost = sub.next_seq, sub.gaps, sub.lost
        sub.drop = first + 2
        for i in range(4):
            pub.publish(_stored(i))
        pub.flush()
        got = _receive_until(sub, 3)
    assert [seq - first for seq, _ in got] == [0, 1, 3]
    assert (sub.gaps - gaps, sub.lost - lost) == (1, 1)


def test_publishing_on_a_taken_port_names_the_endpoint() -> None:
    from kvoffload import InvalidArgumentError

    with (
        KVEventPublisher(LOCAL) as first,
        pytest.raises(InvalidArgumentError, match="cannot bind KV events"),
    ):
        KVEventPublisher(first.endpoint)


def test_indexer_answers_the_longest_prefix() -> None:
    index = PrefixIndex()
    h = [i.to_bytes(8, "big") for i in range(5)]
    from kvoffload.observe.events import make_batch

    index.apply("a", make_batch([BlockStored(h[:2], None, [], 16, None, "CPU", None)]))
    index.apply("b", make_batch([BlockStored(h[:4], None, [], 16, None, "CPU", None)]))
    assert index.longest_prefix(h) == ("b", 4)
    index.apply("b", make_batch([BlockRemoved([h[1]], "CPU")]))
    assert index.longest_prefix(h) == ("a", 2)
    assert index.longest_prefix([h[4]]) == (None, 0)
    # Held twice (two media): one removal leaves it held.
    index.apply("a", make_batch([BlockStored([h[0]], None, [], 16, None, "GPU", None)]))
    index.apply("a", make_batch([BlockRemoved([h[0]], "CPU")]))
    assert index.holds("a", h[0])


def test_a_clear_empties_the_media_the_index_was_told_it_covers() -> None:
    """vLLM's ``AllBlocksCleared`` is its GPU prefix cache's (with the connector's CPU
    tier, which announces no removals): the disk and shared tiers' blocks stay, and an
    index told so keeps them. By default a clear still empties every medium."""
    from kvoffload.observe.events import AllBlocksCleared, make_batch

    h = [i.to_bytes(8, "big") for i in range(4)]
    stores = make_batch(
        [
            BlockStored(h[:2], None, [], 16, None, "GPU", None),
            BlockStored(h[1:3], None, [], 16, None, "CPU", None),
            BlockStored(h[:4], None, [], 16, None, "STORAGE", None),
            BlockStored([h[0]], None, [], 16, None, "GPU", None),  # announced twice
        ]
    )
    cleared = make_batch([AllBlocksCleared()])
    gpu_and_cpu, every_medium = PrefixIndex(cleared_media={"GPU", "CPU"}), PrefixIndex()
    for index in (gpu_and_cpu, every_medium):
        index.apply("a", stores)
        index.apply("a", cleared)
    assert gpu_and_cpu.longest_prefix(h) == ("a", 4)
    assert every_medium.longest_prefix(h) == (None, 0)
    gpu_and_cpu.apply("a", make_batch([BlockRemoved([h[2]], "STORAGE")]))
    assert (gpu_and_cpu.longest_prefix(h), gpu_and_cpu.num_blocks("a")) == (("a", 2), 3)
    # The cleared media hold nothing more: a second removal of GPU's h[0] is no one's.
    gpu_and_cpu.apply("a", make_batch([BlockRemoved([h[0]], "GPU")]))
    assert gpu_and_cpu.holds("a", h[0])
    gpu_and_cpu.forget("a")
    assert (gpu_and_cpu.num_blocks("a"), gpu_and_cpu.longest_prefix(h)) == (0, (None, 0))


def test_cleared_media_given_as_one_string_is_refused() -> None:
    with pytest.raises(InvalidArgumentError, match="collection of media, got the string 'GPU'"):
        PrefixIndex(cleared_media="GPU")


def test_simulate_publishes_what_the_tier_holds(mooncake_trace: Path, tmp_path: Path) -> None:
    """A router indexing ``kvoffload simulate``'s events (in another process) sees its tier."""
    pub_port, replay_port = free_port(), free_port()
    result = tmp_path / "run.json"
    command = [
        sys.executable, "-m", "kvoffload", "simulate", "--trace", str(mooncake_trace),
        "--gpu-blocks", "878", "--cpu-blocks", "2196", "--no-bound", "--json", str(result),
        "--kv-events-endpoint", f"tcp://127.0.0.1:{pub_port}",
        "--kv-events-replay-endpoint", f"tcp://127.0.0.1:{replay_port}",
        "--serve-after", "3",
    ]  # fmt: skip
    index = PrefixIndex()
    with subprocess.Popen(command, stderr=subprocess.PIPE) as proc:
        try:
            with KVEventSubscriber(
                f"tcp://127.0.0.1:{pub_port}", f"tcp://127.0.0.1:{replay_port}"
            ) as sub:
                while not result.exists():
                    for _, batch in sub.receive(0.2):
                        index.apply("sim", batch)
                    assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
                # The results are written, the endpoints stay up for --serve-after.
                for _, batch in sub.receive(0.5) + sub.catch_up():
                    index.apply("sim", batch)
        finally:
            proc.wait(timeout=60)
    assert proc.returncode == 0
    import json

    report = json.loads(result.read_text())
    assert report["stores_failed"] == 0
    held = report["offload_blocks_written"] - report["offload_evictions"]
    assert 0 < held <= 2196
    assert index.num_blocks("sim") == held


def test_vllm_decodes_ours_and_we_decode_vllms(tmp_path: Path) -> None:
    """vLLM's ZmqEventPublisher, in another process, to our subscriber; and our bytes to vLLM."""
    pytest.importorskip("vllm")
    payload_file, received = tmp_path / "ours.bin", tmp_path / "received"
    with KVEventPublisher(LOCAL) as pub, KVEventSubscriber(pub.endpoint) as sub:
        time.sleep(0.3)
        pub.publish([*_stored(7, 8), OffloadingEvent([block_id_key(7)], "CPU", removed=True)])
        pub.flush()
        ((_, batch),) = _receive_until(sub, 1)
    from kvoffload.observe.events import encode_batch

    payload_file.write_bytes(encode_batch(batch))
    sub_port, replay_port = free_port(), free_port()
    script = textwrap.dedent(
        f"""
        import os, time, warnings
        warnings.simplefilter("ignore")
        import msgspec
        from vllm.distributed.kv_events import (
            BlockRemoved, BlockStored, KVEventBatch, ZmqEventPublisher)
        payload = open({str(payload_file)!r}, "rb").read()
        ours = msgspec.msgpack.Decoder(KVEventBatch).decode(payload)
        stored, removed = ours.events
        assert isinstance(stored, BlockStored) and isinstance(removed, BlockRemoved)
        assert stored.block_hashes == [(7).to_bytes(8, "big"), (8).to_bytes(8, "big")]
        assert stored.medium == "CPU" and removed.block_hashes == [(7).to_bytes(8, "big")]
        pub = ZmqEventPublisher(0, "tcp://127.0.0.1:{sub_port}",
                                "tcp://127.0.0.1:{replay_port}", topic="vllm")
        for i in range(6):
            # Batches sent before the connection is up are lost: the gap is repaired.
            pub.publish(KVEventBatch(ts=time.time(), events=[
                BlockStored([i], None, [1, 2], 16, None, "GPU", None)]))
            time.sleep(0.5)
        # Up (to answer the replay of a gap) until the test has every batch.
        deadline = time.monotonic() + 60
        while not os.path.exists({str(received)!r}) and time.monotonic() < deadline:
            time.sleep(0.05)
        pub.shutdown()
        """
    )
    with KVEventSubscriber(
        f"tcp://127.0.0.1:{sub_port}", f"tcp://127.0.0.1:{replay_port}", bind=True
    ) as sub:
        proc = subprocess.Popen([sys.executable, "-c", script], stderr=subprocess.PIPE)
        try:
            got = _receive_until(sub, 6, timeout_s=90)
        finally:
            received.touch()
            _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert [seq for seq, _ in got] == list(range(6))
    events: list[Any] = [b.events[0] for _, b in got]
    assert all(isinstance(e, BlockStored) for e in events)
    assert [e.block_hashes for e in events] == [[i] for i in range(6)]
    assert decode_batch(payload_file.read_bytes()).events[0].medium == "CPU"


def test_ports_picked_when_binding_are_told(capsys: pytest.CaptureFixture[str]) -> None:
    """``--metrics-port 0`` and ``:*`` / ``:0`` endpoints name the ports they got, on stderr."""
    pytest.importorskip("prometheus_client")
    from kvoffload.cli.main import main

    args = ["simulate", "--requests", "5", "--no-bound", "--metrics-port", "0"]
    args += ["--kv-events-endpoint", "tcp://127.0.0.1:*"]
    args += ["--kv-events-replay-endpoint", "tcp://127.0.0.1:0"]
    assert main(args) == 0
    told = capsys.readouterr().err.splitlines()
    patterns = [
        r"kvoffload: KV events on tcp://127\.0\.0\.1:([1-9]\d*)",
        r"kvoffload: KV event replay on tcp://127\.0\.0\.1:([1-9]\d*)",
        r"kvoffload: metrics on http://127\.0\.0\.1:([1-9]\d*)/metrics",
    ]
    assert len(told) == 3
    assert all(re.fullmatch(p, line) for p, line in zip(patterns, told, strict=True))


def test_ports_given_are_not_told(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("prometheus_client")
    from kvoffload.cli.main import main

    args = ["simulate", "--requests", "5", "--no-bound", "--metrics-port", str(free_port())]
    assert main([*args, "--kv-events-endpoint", f"tcp://127.0.0.1:{free_port()}"]) == 0
    assert capsys.readouterr().err == ""


def test_a_run_keeping_its_endpoints_up_says_so_once_its_results_are_written(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """docs/kv-events.md quotes this line: a run that seems done and has not returned says
    why, and how to end it."""
    pytest.importorskip("prometheus_client")
    from kvoffload.cli.main import main

    args = ["simulate", "--requests", "5", "--no-bound", "--metrics-port", str(free_port())]
    assert main([*args, "--serve-after", "0.2"]) == 0
    assert capsys.readouterr().err.splitlines() == [
        "kvoffload: results written; the endpoints stay up 0.2 s more "
        "(--serve-after; Ctrl-C ends it)"
    ]


def _bound_again(endpoint: str, replay: str) -> KVEventPublisher:
    """A publisher on endpoints another has just closed (ZeroMQ lets go of them shortly)."""
    for _ in range(100):
        try:
            return KVEventPublisher(endpoint, replay)
        except InvalidArgumentError:
            time.sleep(0.05)
    raise AssertionError(f"{endpoint} stayed taken")


def test_a_restarted_publisher_is_followed_and_its_predecessors_blocks_cleared() -> None:
    """A new publisher on the same endpoints numbers from 0 again: its batches are not
    dropped as duplicates, and the old instance's blocks leave the index."""
    endpoint, replay = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    index = PrefixIndex()
    with KVEventSubscriber(endpoint, replay) as sub:
        with KVEventPublisher(endpoint, replay) as first:
            _connect(first, sub)
            for i in range(20):
                first.publish(_stored(i))
            first.flush()
            for _, batch in _receive_until(sub, 20):
                index.apply("engine", batch)
        assert index.holds("engine", block_id_key(3)[:8])
        with _bound_again(endpoint, replay) as second:
            got: Delivered = []
            for _ in range(100):
                second.publish(_stored(50))
                second.flush()
                got += sub.receive(0.1)
                if got:
                    break
            got += sub.catch_up()
    _assert_followed_restart(sub, got, index)


def test_a_live_batch_numbered_as_the_last_one_is_a_restart() -> None:
    """Numbers on one socket only go up: the same number again is a new publisher's."""
    payload = encode_batch(KVEventBatch(0.0, []))
    with KVEventSubscriber(LOCAL, bind=True) as sub:
        delivered: Delivered = []
        for seq in (0, 1, 2, 2):
            sub.accept(seq, payload, delivered)
    assert (sub.restarts, sub.gaps) == (1, 1)  # no replay here: the new 0 and 1 are a gap
    assert [seq for seq, _ in delivered] == [0, 1, 2, -1, 2]


def test_receive_after_close_is_refused_in_one_line() -> None:
    """ZMQ's own ``ZMQError: Operation not supported`` said nothing of what was wrong."""
    with KVEventSubscriber(LOCAL, bind=True) as sub:
        endpoint = sub.endpoint
    with pytest.raises(SubscriberClosedError) as error:
        sub.receive(0.0)
    assert str(error.value) == f"receive on the KV event subscriber of {endpoint!r}: it is closed"
    assert isinstance(error.value, KVOffloadError)
    sub.close()  # a second close changes nothing


def test_a_publisher_restarted_after_a_catch_up_is_followed() -> None:
    """A subscriber that joined after a run and has seen only replayed batches (as with
    ``simulate --serve-after``) still tells the next run's batches from duplicates: they
    were dropped and the first run's blocks stayed in the index."""
    endpoint, replay = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    index = PrefixIndex()
    with KVEventPublisher(endpoint, replay) as first:
        for i in range(10):
            first.publish(_stored(i))
        first.flush()
        sub = KVEventSubscriber(endpoint, replay)
        for _, batch in sub.catch_up():
            index.apply("engine", batch)
    with sub:
        assert index.holds("engine", block_id_key(3)[:8])
        with _bound_again(endpoint, replay) as second:
            got: Delivered = []
            for i in range(100):
                second.publish(_stored(50 + i))
                second.flush()
                got += sub.receive(0.1)
                if got:
                    break
    _assert_followed_restart(sub, got, index)


def test_live_batches_a_catch_up_replayed_already_are_dropped_as_duplicates() -> None:
    """The same bytes numbered as a replayed batch are that batch again, not a restart."""
    with (
        KVEventPublisher(LOCAL, LOCAL) as pub,
        KVEventSubscriber(pub.endpoint, pub.replay_endpoint) as sub,
    ):
        for i in range(3):
            pub.publish(_stored(i))
        pub.flush()
        replayed = sub.catch_up()
        assert [seq for seq, _ in replayed] == [0, 1, 2]
        delivered: Delivered = []
        for seq, batch in replayed:
            sub.accept(seq, encode_batch(batch), delivered)
    assert (delivered, sub.restarts, sub.next_seq) == ([], 0, 3)


def test_batches_the_replay_buffer_no_longer_holds_are_counted_as_lost() -> None:
    """A catch-up or a gap repair that replay can only partly fill passes over the rest:
    the caller learns its index may be wrong instead of taking the batches as complete."""
    with KVEventPublisher(LOCAL, LOCAL, buffer_batches=5) as pub:
        for i in range(10):
            pub.publish(_stored(i))
        pub.flush()
        with KVEventSubscriber(pub.endpoint, pub.replay_endpoint) as late:
            caught_up = late.catch_up()
    assert [seq for seq, _ in caught_up] == [5, 6, 7, 8, 9]
    assert (late.lost, late.repaired) == (5, 5)

    with (
        KVEventPublisher(LOCAL, LOCAL, buffer_batches=2) as pub,
        _Lossy(pub.endpoint, pub.replay_endpoint) as sub,
    ):
        _connect(pub, sub)
        first, gaps, lost = sub.next_seq, sub.gaps, sub.lost
        sub.drop = first + 2
        for i in range(6):  # all sent before any is received: batch 2 has left the buffer
            pub.publish(_stored(i))
        pub.flush()
        got = _receive_until(sub, 5)
    assert [seq - first for seq, _ in got] == [0, 1, 3, 4, 5]
    assert (sub.gaps - gaps, sub.lost - lost) == (1, 1)


def _has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        return False
    return True


@pytest.mark.skipif(not _has_ipv6_loopback(), reason="no IPv6 loopback here")
def test_ipv6_endpoints_publish_and_replay() -> None:
    """ZMQ sockets take IPv6 addresses only when told: binding ``tcp://[::1]:PORT`` failed
    with "No such device" though the machine has the address."""
    with (
        KVEventPublisher("tcp://[::1]:0", "tcp://[::1]:0") as pub,
        _Lossy(pub.endpoint, pub.replay_endpoint) as sub,
    ):
        assert pub.endpoint.startswith("tcp://[::1]:")
        _connect(pub, sub)
        first, repaired = sub.next_seq, sub.repaired
        sub.drop = first + 1
        for i in range(3):
            pub.publish(_stored(i))
        pub.flush()
        got = _receive_until(sub, 3)
    assert [seq - first for seq, _ in got] == [0, 1, 2]
    assert sub.repaired - repaired == 1


def test_a_batch_that_does_not_decode_is_counted_as_lost_not_raised() -> None:
    """An event type we do not know (a newer vLLM's) raised out of ``receive`` and took the
    batches accepted before it in the same call, ``next_seq`` already past them."""
    import msgspec

    good = encode_batch(KVEventBatch(0.0, [BlockRemoved([b"a"], "CPU")]))
    unknown = msgspec.msgpack.encode([0.0, [{"type": "BlockUpdated", "block_hashes": []}], 0])
    with KVEventSubscriber(LOCAL, bind=True) as sub:
        delivered: Delivered = []
        for seq, payload in ((0, good), (1, unknown), (2, good)):
            sub.accept(seq, payload, delivered)
    assert [seq for seq, _ in delivered] == [0, 2]
    assert (sub.lost, sub.gaps, sub.next_seq) == (1, 0, 3)


def _assert_followed_restart(sub: KVEventSubscriber, got: Delivered, index: PrefixIndex) -> None:
    """One restart seen, delivered as -1 then the new run from 0: the old run's block 3 is
    gone from ``index`` and the new run's block 50 is in."""
    assert sub.restarts == 1
    seqs = [seq for seq, _ in got]
    assert seqs[0] == -1 and seqs[1:] == list(range(len(seqs) - 1))
    for _, batch in got:
        index.apply("engine", batch)
    assert not index.holds("engine", block_id_key(3)[:8])
    assert index.holds("engine", block_id_key(50)[:8])


def _raw_pub() -> tuple[zmq.Socket[bytes], str]:
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.PUB)
    sock.bind(LOCAL)
    return sock, sock.getsockopt_string(zmq.LAST_ENDPOINT)


def _seq(n: int) -> bytes:
    return n.to_bytes(8, "big", signed=True)


def test_messages_that_are_no_batch_are_ignored_not_raised() -> None:
    """A peer's message of another number of frames raised ``ValueError`` out of ``receive``
    with the batches taken before it; a number of -1 (the end-of-replay mark) was read as
    2**64 - 1: ~2**64 batches counted lost, and the next restart cleared the index."""
    good = encode_batch(KVEventBatch(0.0, []))
    raw, endpoint = _raw_pub()
    with raw, KVEventSubscriber(endpoint) as sub:
        for _ in range(100):
            raw.send_multipart((b"t", _seq(0), good))
            if sub.receive(0.1):
                break
        assert sub.next_seq == 1
        for frames in (
            (b"t", _seq(1)),
            (b"t", _seq(1), good, b""),
            (b"t", b"\x01", good),
            (b"t", _seq(-1), good),
            (b"t", _seq(1), good),
        ):
            raw.send_multipart(frames)
        got = _receive_until(sub, 1)
    assert [seq for seq, _ in got] == [1]
    assert (sub.next_seq, sub.lost, sub.gaps, sub.restarts) == (2, 0, 0, 0)


def test_a_replay_answering_messages_that_are_no_batch_is_read_past() -> None:
    """A replay socket's malformed answers raised ``ValueError`` out of ``catch_up``; they
    are skipped, and the batches and end mark after them still taken."""
    good = encode_batch(KVEventBatch(0.0, []))
    router: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.ROUTER)
    router.bind(LOCAL)
    replay = router.getsockopt_string(zmq.LAST_ENDPOINT)
    with router, KVEventSubscriber(LOCAL, replay, replay_timeout_s=10.0, bind=True) as sub:
        answered: list[Delivered] = []
        asking = threading.Thread(target=lambda: answered.append(sub.catch_up()))
        asking.start()
        assert router.poll(10_000)
        client, _, _ = router.recv_multipart()
        for frames in (
            (b"",),
            (b"", b"t", _seq(0)),
            (b"", b"t", b"\x00", good),
            (b"", b"t", _seq(-2), good),
            (b"", b"t", _seq(0), good),
            (b"", b"t", _seq(1), good),
            (b"", b"", _seq(-1), b""),
        ):
            router.send_multipart((client, *frames))
        asking.join(30)
    assert [[seq for seq, _ in got] for got in answered] == [[0, 1]]
    assert (sub.next_seq, sub.lost, sub.repaired) == (2, 0, 2)


def test_a_batch_that_does_not_encode_is_dropped_and_the_publisher_goes_on() -> None:
    """An event msgpack cannot hold killed the publisher's thread: nothing was sent after it,
    ``flush`` waited out its timeout and ``close`` left both ports bound."""
    unencodable: Any = [object()]
    with KVEventPublisher(LOCAL) as pub, KVEventSubscriber(pub.endpoint) as sub:
        _connect(pub, sub)
        first, gaps = sub.next_seq, sub.gaps
        pub.publish_batch(KVEventBatch(0.0, unencodable))
        pub.publish_batch(KVEventBatch(0.0, [BlockRemoved([2**70], "CPU")]))
        pub.publish(_stored(1))
        pub.flush()
        got = _receive_until(sub, 1)
    assert [seq for seq, _ in got] == [first]  # numbered next: nothing seems lost
    assert sub.gaps == gaps


def test_a_batch_whose_text_is_no_utf8_is_dropped_and_the_publisher_goes_on() -> None:
    """A lone surrogate in a string (msgpack holds UTF-8 only) raised UnicodeEncodeError, a
    ValueError, which the dropping of unencodable batches did not catch: the thread died."""
    with KVEventPublisher(LOCAL) as pub, KVEventSubscriber(pub.endpoint) as sub:
        _connect(pub, sub)
        first = sub.next_seq
        pub.publish_batch(KVEventBatch(0.0, [BlockRemoved([b"\x01"], "CPU\ud800")]))
        pub.publish(_stored(1))
        pub.flush()
        got = _receive_until(sub, 1)
    assert [seq for seq, _ in got] == [first]


def test_a_peer_asking_for_replay_without_pause_does_not_hold_up_publishing() -> None:
    """The publisher served every pending replay request before its next batch: a peer
    that kept asking held up publishing for as long as it asked."""
    with (
        KVEventPublisher(LOCAL, LOCAL, buffer_batches=1) as pub,
        KVEventSubscriber(pub.endpoint) as sub,
    ):
        _connect(pub, sub)
        first = sub.next_seq
        stop = threading.Event()

        def ask_without_pause() -> None:
            with zmq.Context.instance().socket(zmq.DEALER) as asker:
                asker.setsockopt(zmq.LINGER, 0)
                asker.connect(str(pub.replay_endpoint))
                deadline = time.monotonic() + 30
                while not stop.is_set() and time.monotonic() < deadline:
                    for _ in range(4):
                        asker.send_multipart((b"", _seq(0)))
                    while asker.poll(0):
                        asker.recv_multipart()

        asking = threading.Thread(target=ask_without_pause)
        asking.start()
        try:
            time.sleep(0.2)  # the requests queue up
            pub.publish(_stored(1))
            got = _receive_until(sub, 1)
        finally:
            stop.set()
            asking.join()
    assert [seq for seq, _ in got] == [first]


class _Stall(logging.Handler):
    """Holds up the thread that logs, until released: the publisher's thread stops where
    the test chose, while the test queues batches and replay requests behind it."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.stalled, self.released = threading.Event(), threading.Event()

    def emit(self, record: logging.LogRecord) -> None:
        self.stalled.set()
        self.released.wait(30)


def test_replay_answers_and_queued_batches_take_turns_a_quarter_buffer_each() -> None:
    """The publisher sent one batch per replay request served: while peers kept asking (six
    catching up in a loop), it sent ~15 batches a second of the 350 published and its
    queue grew without bound. Sending every queued batch before the next answer instead
    kept a repair request waiting behind a backlog while the buffer rolled past the
    batches it asked for. Now each answer is followed by up to a quarter of the buffer's
    worth of queued batches (2 of 8 here): both go on, and what the first request asked
    for is still there when it is answered."""
    buffer_batches, batches, requests = 8, 20, 5
    stall = _Stall()
    log = logging.getLogger("kvoffload.observe.publisher")
    log.addHandler(stall)
    try:
        # inproc: a request sent is at the replay socket when the send returns
        with (
            KVEventPublisher(
                LOCAL, f"inproc://replay-{id(stall)}", buffer_batches=buffer_batches
            ) as pub,
            KVEventSubscriber(pub.endpoint) as sub,
            zmq.Context.instance().socket(zmq.DEALER) as peer,
        ):
            _connect(pub, sub)
            first = sub.next_seq
            peer.setsockopt(zmq.LINGER, 0)
            peer.connect(str(pub.replay_endpoint))
            unencodable: Any = [object()]
            pub.publish_batch(KVEventBatch(0.0, unencodable))  # its warning holds the thread
            assert stall.stalled.wait(30)
            for _ in range(requests):
                peer.send_multipart((b"", _seq(first)))
            for i in range(batches):
                pub.publish(_stored(i))
            stall.released.set()
            answered: list[list[int]] = []
            while len(answered) < requests and peer.poll(10_000):
                answer = []
                while (frames := peer.recv_multipart())[1]:  # the end marker has no topic
                    answer.append(int.from_bytes(frames[2], "big"))
                answered.append(answer)
            got = _receive_until(sub, batches)
    finally:
        stall.released.set()
        log.removeHandler(stall)
    assert answered == [list(range(first, first + 2 * turn)) for turn in range(requests)]
    assert [seq for seq, _ in got] == list(range(first, first + batches))


def test_a_peer_asking_for_replays_it_never_reads_is_not_queued_without_bound() -> None:
    """Each replay queued for a peer that does not read stayed in the engine's memory (200
    unread replays of 200 batches of 18 KB held 775 MiB). Now a peer has at most twice a
    whole replay queued (vLLM's bound), plus what the kernel's socket buffers hold; once
    it reads, it is answered in full again."""
    batches, requests = 5, 60
    with KVEventPublisher(LOCAL, LOCAL, buffer_batches=batches) as pub:
        for _ in range(batches):  # 256 KiB each: the kernel's buffers hold few of them
            pub.publish_batch(KVEventBatch(0.0, [BlockRemoved([bytes(8)] * 32768, "CPU")]))
        pub.flush()
        with zmq.Context.instance().socket(zmq.DEALER) as peer:
            peer.setsockopt(zmq.LINGER, 0)
            peer.setsockopt(zmq.RCVHWM, 1)
            peer.connect(str(pub.replay_endpoint))
            for _ in range(requests):
                peer.send_multipart((b"", _seq(0)))
            assert peer.poll(10_000)  # answering has begun: the requests are in, unread
            for _ in range(3 * requests):  # a turn of the thread each, serving a request
                pub.flush()
            queued = 0
            while peer.poll(2000):
                peer.recv_multipart()
                queued += 1
            peer.send_multipart((b"", _seq(0)))
            answer = []
            while peer.poll(10_000):
                answer.append(peer.recv_multipart())
                if answer[-1][1] == b"":  # the end-of-replay marker has no topic
                    break
    assert queued < requests * (batches + 1) / 3
    assert [frames[2] for frames in answer] == [_seq(i) for i in range(batches)] + [
        (-1).to_bytes(8, "big", signed=True)
    ]


def test_negative_timeouts_wait_for_nothing_or_are_refused() -> None:
    """ZMQ waits without end for a negative time: ``receive(-1)`` never returned, and a
    negative ``replay_timeout_s`` hung every repair on a replay socket that does not answer."""
    with pytest.raises(InvalidArgumentError, match="replay_timeout_s"):
        KVEventSubscriber(LOCAL, LOCAL, replay_timeout_s=-1.0, bind=True)
    with KVEventSubscriber(LOCAL, bind=True) as sub:
        returned: list[Delivered] = []
        receiving = threading.Thread(target=lambda: returned.append(sub.receive(-1.0)), daemon=True)
        receiving.start()
        receiving.join(30)
        assert returned == [[]]


def test_timeouts_without_end_wait_for_the_first_batch_or_are_refused() -> None:
    """``int()`` of an infinite or NaN timeout raised OverflowError or ValueError: a replay
    that may never answer is refused as a negative one is, and ``receive(math.inf)``
    waits for the first batch as long as it takes."""
    for endless in (math.inf, math.nan):
        with pytest.raises(InvalidArgumentError, match="replay_timeout_s"):
            KVEventSubscriber(LOCAL, LOCAL, replay_timeout_s=endless, bind=True)
    with KVEventPublisher(LOCAL) as pub, KVEventSubscriber(pub.endpoint) as sub:
        _connect(pub, sub)
        with pytest.raises(InvalidArgumentError, match="got nan"):
            sub.receive(math.nan)
        pub.publish(_stored(1))
        pub.flush()
        returned: list[Delivered] = []
        receiving = threading.Thread(
            target=lambda: returned.append(sub.receive(math.inf)), daemon=True
        )
        receiving.start()
        receiving.join(30)
        assert [[seq for seq, _ in got] for got in returned] == [[pub.published - 1]]


def test_flush_says_whether_the_batches_were_sent(caplog: pytest.LogCaptureFixture) -> None:
    """``flush`` returned nothing either way: a batch queued after ``close`` (no thread sends
    it) waited out the timeout and returned as a sent one did, with nothing logged."""
    with KVEventPublisher(LOCAL) as pub:
        pub.publish(_stored(1))
        assert pub.flush() is True
    assert pub.flush() is True  # close sent everything queued before it
    pub.publish(_stored(2))
    with caplog.at_level(logging.WARNING, logger="kvoffload.observe.publisher"):
        assert pub.flush(timeout_s=1.0) is False
    assert "were not sent (the publisher is closed)" in caplog.text


def test_flush_waits_without_end_for_an_endless_timeout_and_refuses_nan() -> None:
    """``flush(math.inf)`` (or any timeout past ``threading.TIMEOUT_MAX``) raised
    OverflowError from threading; ``flush(math.nan)`` waited for nothing and said the
    batches were not sent "within nan s"."""
    with KVEventPublisher(LOCAL) as pub:
        for endless in (math.inf, 1e300):
            pub.publish(_stored(1))
            assert pub.flush(endless) is True
        with pytest.raises(InvalidArgumentError, match="timeout_s must be a number of seconds"):
            pub.flush(math.nan)
        assert pub.published == 2


def test_a_batch_given_after_close_is_dropped_counted_and_logged_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """``publish`` after ``close`` queued each batch for a thread that had stopped: kept in
    memory, never sent, and nothing said so until a ``flush``."""
    with KVEventPublisher(LOCAL) as pub:
        pub.publish(_stored(1))
    with caplog.at_level(logging.WARNING, logger="kvoffload.observe.publisher"):
        pub.publish(_stored(2))
        pub.publish_batch(KVEventBatch(0.0, [BlockRemoved([b"\x02"], "CPU")]))
        pub.publish([])  # no events: no batch, nothing dropped
    assert (pub.published, pub.dropped_after_close) == (1, 2)
    assert caplog.text.count("given after the publisher") == 1
    assert pub.flush(timeout_s=1.0) is False  # they never will be sent
    pub.close()  # a second close changes nothing
    assert pub.dropped_after_close == 2


@pytest.mark.parametrize("buffer_batches", [-1, 1.5])
def test_a_bad_buffer_size_is_refused_by_name_before_any_port_is_bound(
    buffer_batches: Any,
) -> None:
    """A negative ``buffer_batches`` raised deque's raw ``ValueError`` ("maxlen must be
    non-negative"), and a fractional one a ``TypeError``, once both sockets were bound."""
    endpoint, replay = (f"tcp://127.0.0.1:{free_port()}" for _ in range(2))
    with pytest.raises(InvalidArgumentError, match="buffer_batches must be an integer >= 0"):
        KVEventPublisher(endpoint, replay, buffer_batches=buffer_batches)
    with KVEventPublisher(endpoint, replay, buffer_batches=0) as pub:  # both ports still free
        assert (pub.endpoint, pub.replay_endpoint) == (endpoint, replay)


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("block_size", "16", "block_size must be an integer >= 1"),
        ("block_size", 0, "block_size must be an integer >= 1"),
        ("data_parallel_rank", "x", "data_parallel_rank must be an integer >= 0"),
        ("data_parallel_rank", -1, "data_parallel_rank must be an integer >= 0"),
        ("topic", None, "topic must be a str"),
        ("topic", "kv\udcff", "topic must be UTF-8"),
    ],
)
def test_a_bad_batch_field_or_topic_is_refused_by_name_before_any_port_is_bound(
    option: str, value: Any, message: str
) -> None:
    """A str block size or rank was taken, and every batch it sent then failed to decode
    at the subscriber (counted lost); a topic of None or one that is not UTF-8 raised
    ``AttributeError`` or ``UnicodeEncodeError`` from inside."""
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    with pytest.raises(InvalidArgumentError, match=message):
        KVEventPublisher(endpoint, **{option: value})
    with KVEventPublisher(endpoint) as pub:  # the port is still free
        assert pub.endpoint == endpoint


@pytest.mark.parametrize("bind", [True, False])
def test_an_endpoint_the_subscriber_cannot_use_is_refused_naming_it(bind: bool) -> None:
    """A port in use (``bind=True``) or an endpoint ZMQ cannot parse raised ZMQ's own
    ``ZMQError``, not the error the publisher gives, and left the SUB socket open."""
    with KVEventPublisher(LOCAL) as pub:
        endpoint = pub.endpoint if bind else "tcp://no-port"
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with pytest.raises(InvalidArgumentError, match=re.escape(repr(endpoint))):
                KVEventSubscriber(endpoint, bind=bind)
            gc.collect()  # an unclosed socket warns when collected
    assert not [w for w in caught if issubclass(w.category, ResourceWarning)]


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("topic", b"kvoffload", "topic must be a str, got b'kvoffload'"),
        ("topic", None, "topic must be a str, got None"),
        ("topic", "\udcff", "topic must be UTF-8"),
        ("replay_timeout_s", "5", "replay_timeout_s must be a finite number of seconds"),
        ("replay_timeout_s", None, "replay_timeout_s must be a finite number of seconds"),
        ("replay_timeout_s", True, "replay_timeout_s must be a finite number of seconds"),
        ("topic", b"k" * 10_000, "(10,003 characters)"),
    ],
)
def test_a_subscriber_topic_or_replay_timeout_of_another_type_is_refused_naming_it(
    option: str, value: Any, message: str
) -> None:
    """A bytes topic (ZMQ's frames are bytes) raised ``AttributeError`` from inside, one that
    is no UTF-8 ``UnicodeEncodeError``, and a replay timeout given as text ``TypeError``
    from a comparison; each is now refused as the publisher refuses them, naming it."""
    with pytest.raises(InvalidArgumentError, match=re.escape(message)):
        KVEventSubscriber(LOCAL, LOCAL, bind=True, **{option: value})


def test_a_replay_endpoint_the_subscriber_cannot_use_is_refused_when_made() -> None:
    """A replay endpoint ZMQ cannot parse was taken, then raised ``ZMQError`` out of the
    first ``receive`` that saw a gap, and the live batch that showed it was lost."""
    refused = pytest.raises(InvalidArgumentError, match=re.escape("replay to 'tcp://no-port'"))
    with KVEventPublisher(LOCAL) as pub, refused:
        KVEventSubscriber(pub.endpoint, "tcp://no-port")


def test_a_terminated_zmq_context_neither_stops_the_publisher_nor_is_held_up(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Other code in the process terminating the shared ZMQ context made the publisher's
    next socket call raise, which ended its thread: nothing was sent or flushed after it,
    and ``close`` (finding no thread) left the sockets open, so the termination never
    finished. Failed sends are now counted and the thread goes on."""
    with caplog.at_level(logging.WARNING, logger="kvoffload.observe.publisher"):
        with KVEventPublisher(LOCAL, LOCAL) as pub:
            terminating = threading.Thread(target=zmq.Context.instance().term, daemon=True)
            terminating.start()
            deadline = time.monotonic() + 30
            while "not sent on" not in caplog.text and time.monotonic() < deadline:
                pub.publish(_stored(1))
                assert pub.flush() is True
            failed = pub.send_failures
            assert failed == 1
            pub.publish(_stored(2))
            assert pub.flush() is True
            assert pub.send_failures == failed + 1
        terminating.join(30)
    assert not terminating.is_alive()  # close closed both sockets
    assert "replay on" in caplog.text and "no longer answered" in caplog.text
    assert caplog.text.count("not sent on") == 1  # the first failure only


def test_timeouts_longer_than_zmq_waits_in_one_call_are_waited_out() -> None:
    """ZMQ's poll takes at most 2**31 - 1 ms (~24.8 days): a longer ``receive`` timeout or
    ``replay_timeout_s`` raised OverflowError, though a finite one is accepted."""
    month = 31 * 24 * 3600.0
    with (
        KVEventPublisher(LOCAL, LOCAL) as pub,
        KVEventSubscriber(pub.endpoint, pub.replay_endpoint, replay_timeout_s=month) as sub,
    ):
        _connect(pub, sub)
        pub.publish(_stored(1))
        pub.flush()
        got = sub.receive(month)
        assert [seq for seq, _ in got] == [pub.published - 1]
        assert sub.catch_up() == []


def test_an_ipv6_endpoint_without_brackets_is_refused_before_the_run(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """ZMQ binds an IPv6 address only in brackets: ``tcp://::1:PORT`` passed the options'
    check and failed once the workload was built, as 'No such device'."""
    from kvoffload.cli.main import main

    endpoint = f"tcp://::1:{free_port()}"
    assert main(["simulate", "--requests", "5", "--kv-events-endpoint", endpoint]) == 1
    err = capsys.readouterr().err
    assert f"{endpoint!r}: an IPv6 address goes in brackets, tcp://[ADDRESS]:PORT" in err
