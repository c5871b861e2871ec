//! Links whose frames travel through shared-memory rings (issue 48, item 1): the switch
//! from the socket, order across it with and without descriptors, the ring's bound, the
//! ends of a link (closed, cut, a peer gone without closing its ring), and peers that
//! break the protocol. Every wait has a deadline; no assertion is about time.

use super::*;
use crate::ring::{DEFAULT_CAPACITY, MIN_CAPACITY};
use baton_messages::SessionToken;
use baton_messages::codec::frame_bytes;
use baton_messages::protocol::{Call, RingOffer};
use std::os::fd::OwnedFd;

const WITHIN: Duration = Duration::from_secs(10);

fn config(ring: Option<usize>) -> LinkConfig {
    let config = LinkConfig::new(Session::new(SessionToken::from_bytes([9; 32])));
    match ring {
        Some(capacity) => config.with_ring(capacity),
        None => config.without_ring(),
    }
}

async fn linked(server_ring: Option<usize>, client_ring: Option<usize>) -> (AsyncLink, AsyncLink) {
    let (a, b) = tokio::net::UnixStream::pair().unwrap();
    let (server_config, client_config) = (config(server_ring), config(client_ring));
    let (server, client) = tokio::join!(
        AsyncLink::server(a, &server_config),
        AsyncLink::client(b, &client_config)
    );
    (server.unwrap(), client.unwrap())
}

async fn recv(rx: &mut LinkReader) -> Received {
    tokio::time::timeout(WITHIN, rx.recv())
        .await
        .expect("a frame within the deadline")
        .unwrap()
}

fn files(n: usize) -> Vec<std::fs::File> {
    (0..n).map(|_| tempfile::tempfile().unwrap()).collect()
}

/// One side of a link, split.
struct Side {
    rx: LinkReader,
    wx: LinkWriter,
    closer: LinkCloser,
}

fn split(link: AsyncLink) -> Side {
    let closer = link.closer();
    let (rx, wx) = link.into_split();
    Side { rx, wx, closer }
}

/// A link whose server offers a ring of `capacity` and whose client has read the offer
/// (with a first frame from the server): the client's next send switches to the ring.
async fn offered(capacity: usize) -> (Side, Side) {
    let (server, client) = linked(Some(capacity), None).await;
    let (mut server, mut client) = (split(server), split(client));
    server.wx.send(&Message::Ping(u64::MAX), &[]).await.unwrap();
    assert_eq!(recv(&mut client.rx).await.message, Message::Ping(u64::MAX));
    assert!(!client.wx.uses_ring(), "announced by the next send");
    (server, client)
}

/// A small frame: a ring of `MIN_CAPACITY` holds about 170 of them.
fn ping(i: u64) -> Message {
    Message::Ping(i)
}

/// A frame far larger than a ring of `MIN_CAPACITY` carries (`max_frame` 2040 bytes).
fn big(i: u64) -> Message {
    Message::Call(Call {
        id: i,
        target: "t".into(),
        type_name: "big".into(),
        payload: vec![i as u8; 10_000],
        offers: Vec::new(),
    })
}

#[test]
fn the_ring_setting_of_the_environment() {
    assert_eq!(ring_setting(None), Some(DEFAULT_CAPACITY));
    assert_eq!(ring_setting(Some("")), Some(DEFAULT_CAPACITY));
    assert_eq!(ring_setting(Some("0")), None);
    assert_eq!(ring_setting(Some(" 0 ")), None);
    assert_eq!(ring_setting(Some("1")), Some(DEFAULT_CAPACITY));
    assert_eq!(ring_setting(Some(" 65536 ")), Some(65536));
    assert_eq!(ring_setting(Some("lots")), None);
    assert_eq!(config(None).ring, None);
    assert_eq!(config(Some(8192)).ring, Some(8192));
}

/// Both sides offer a ring. Frames sent before either side read the other's offer go on
/// the socket; after it, each side's next send announces the ring (`RingReady`) and from
/// then on frames without descriptors go through the ring, those with descriptors on the
/// socket after a marker. Every frame arrives once, in order, with its descriptors, in both
/// directions.
#[tokio::test(flavor = "current_thread")]
async fn frames_with_and_without_descriptors_keep_their_order_across_the_switch_both_ways() {
    let (server, client) = linked(Some(DEFAULT_CAPACITY), Some(DEFAULT_CAPACITY)).await;
    let (mut server, mut client) = (split(server), split(client));
    let files = files(2);
    let fds = |i: u64| -> Vec<_> {
        files
            .iter()
            .take((i % 3) as usize)
            .map(|f| f.as_fd())
            .collect()
    };
    let check = |got: Received, want: Message, i: u64| {
        assert_eq!((got.message, got.fds.len()), (want, (i % 3) as usize));
    };
    for i in 0..10 {
        client.wx.send(&Message::Ping(i), &fds(i)).await.unwrap();
        server.wx.send(&Message::Pong(i), &fds(i)).await.unwrap();
    }
    assert!(!client.wx.uses_ring() && !server.wx.uses_ring());
    for i in 0..10 {
        check(recv(&mut server.rx).await, Message::Ping(i), i);
        check(recv(&mut client.rx).await, Message::Pong(i), i);
    }
    for i in 10..60 {
        client.wx.send(&Message::Ping(i), &fds(i)).await.unwrap();
        server.wx.send(&Message::Pong(i), &fds(i)).await.unwrap();
    }
    assert!(
        client.wx.uses_ring() && server.wx.uses_ring(),
        "both sides switched"
    );
    for i in 10..60 {
        check(recv(&mut server.rx).await, Message::Ping(i), i);
        check(recv(&mut client.rx).await, Message::Pong(i), i);
    }
    assert!(server.rx.uses_ring() && client.rx.uses_ring());
}

/// Frames larger than the ring's maximum go on the socket after a marker, between frames
/// in the ring, in order; so do several frames encoded into one `send_encoded`.
#[tokio::test(flavor = "current_thread")]
async fn frames_larger_than_the_ring_carries_go_on_the_socket_in_order() {
    let (mut server, mut client) = offered(MIN_CAPACITY).await;
    let file = files(1);
    for i in 0..20 {
        let msg = if i % 3 == 0 { big(i) } else { ping(i) };
        let fd: Vec<_> = file
            .iter()
            .filter(|_| i % 5 == 0)
            .map(|f| f.as_fd())
            .collect();
        client.wx.send(&msg, &fd).await.unwrap();
    }
    let mut batch = Vec::new();
    for i in 20..30 {
        let msg = if i % 2 == 0 { big(i) } else { ping(i) };
        batch.extend(frame_bytes(&msg, 0).unwrap());
    }
    client.wx.send_encoded(&batch, &[]).await.unwrap();
    assert!(client.wx.uses_ring());
    for i in 0..30 {
        let got = recv(&mut server.rx).await;
        let want = if (i < 20 && i % 3 == 0) || (i >= 20 && i % 2 == 0) {
            big(i)
        } else {
            ping(i)
        };
        let nfds = usize::from(i < 20 && i % 5 == 0);
        assert_eq!((got.message, got.fds.len()), (want, nfds), "frame {i}");
    }
    assert!(server.rx.uses_ring());
}

/// A reader that reads nothing: the ring fills and the writer waits for room (it does not
/// finish, grow a queue or fail); once the reader reads, every frame arrives in order and
/// the writer finishes. `try_send_encoded` takes nothing while the ring is full.
#[tokio::test(flavor = "current_thread")]
async fn a_full_ring_makes_the_writer_wait_and_then_complete_in_order() {
    let (mut server, client) = offered(MIN_CAPACITY).await;
    let mut wx = client.wx;
    let direct = wx.clone();
    let writer = tokio::spawn(async move {
        for i in 0..1000 {
            wx.send(&ping(i), &[]).await?;
        }
        Ok::<_, Error>(())
    });
    for _ in 0..20 {
        tokio::task::yield_now().await;
    }
    assert!(!writer.is_finished(), "the writer waits for room");
    assert!(direct.uses_ring());
    let frame = frame_bytes(&ping(0), 0).unwrap();
    assert_eq!(
        direct.try_send_encoded(&frame, &[]).unwrap(),
        0,
        "full or busy"
    );
    for i in 0..1000 {
        assert_eq!(recv(&mut server.rx).await.message, ping(i));
    }
    tokio::time::timeout(WITHIN, writer)
        .await
        .expect("the writer finishes once there is room")
        .unwrap()
        .unwrap();
}

/// `LinkCloser::close` ends a writer waiting for room in a full ring, and a reader waiting
/// on its ring and socket; `LinkWriter::shutdown` does the same for the writer; and the
/// reader's side closing its link closes its ring, which ends the peer's wait for room at
/// once (the peer's reader reads nothing here, so only the ring can tell it).
#[tokio::test(flavor = "current_thread")]
async fn closing_ends_a_writer_waiting_for_room_and_a_waiting_reader() {
    #[derive(Debug, Clone, Copy)]
    enum By {
        Closer,
        Shutdown,
        ReadersSide,
    }
    for by in [By::Closer, By::Shutdown, By::ReadersSide] {
        let (server, client) = offered(MIN_CAPACITY).await;
        let mut wx = client.wx.clone();
        let cutter = client.wx.clone();
        let writer = tokio::spawn(async move {
            for i in 0.. {
                wx.send(&ping(i), &[]).await?;
            }
            Ok::<_, Error>(())
        });
        for _ in 0..20 {
            tokio::task::yield_now().await;
        }
        assert!(!writer.is_finished(), "the writer waits for room");
        match by {
            By::Shutdown => cutter.shutdown(),
            By::Closer => client.closer.close(),
            By::ReadersSide => server.closer.close(),
        }
        let ended = tokio::time::timeout(WITHIN, writer)
            .await
            .expect("the waiting writer is woken")
            .unwrap();
        assert!(matches!(ended, Err(Error::Closed)), "{by:?}: {ended:?}");
        drop(server);
    }

    // A reader waiting on its ring (the peer switched, sends nothing more).
    let (mut server, mut client) = offered(MIN_CAPACITY).await;
    client.wx.send(&ping(1), &[]).await.unwrap();
    assert_eq!(recv(&mut server.rx).await.message, ping(1));
    assert!(server.rx.uses_ring());
    let mut rx = server.rx;
    let reader = tokio::spawn(async move { rx.recv().await });
    for _ in 0..20 {
        tokio::task::yield_now().await;
    }
    assert!(!reader.is_finished(), "the reader waits");
    server.closer.close();
    let ended = tokio::time::timeout(WITHIN, reader)
        .await
        .expect("the waiting reader is woken")
        .unwrap();
    assert!(ended.is_err(), "{ended:?}");
}

/// A peer gone without closing its ring (as a SIGKILL leaves it: no `Drop` sets the ring's
/// `closed` flag, only the kernel closes its socket): the reader waiting on the ring ends
/// with `Closed` through the socket's end of stream, within the deadline. The same with
/// frames the peer left in the ring: they are read first.
#[tokio::test(flavor = "current_thread")]
async fn a_peer_gone_without_closing_its_ring_ends_the_wait() {
    for left in [0u64, 3] {
        let (mut server, mut client) = offered(DEFAULT_CAPACITY).await;
        client.wx.send(&ping(100), &[]).await.unwrap();
        assert_eq!(recv(&mut server.rx).await.message, ping(100));
        for i in 0..left {
            client.wx.send(&ping(i), &[]).await.unwrap();
        }
        let kept = client
            .wx
            .take_ring_for_test()
            .expect("the client writes the ring");
        drop(client);
        for i in 0..left {
            assert_eq!(recv(&mut server.rx).await.message, ping(i));
        }
        let ended = tokio::time::timeout(WITHIN, server.rx.recv())
            .await
            .expect("the socket's end ends the wait");
        assert!(matches!(ended, Err(Error::Closed)), "{ended:?}");
        drop(kept);
    }
}

/// A peer that drops its link the ordinary way closes its ring, then its socket: the reader
/// reads what the ring still holds, then ends with `Closed` (the ring's close alone does not
/// end it: frames may still come after a marker; the socket's end does).
#[tokio::test(flavor = "current_thread")]
async fn a_peer_that_drops_its_link_ends_the_wait_with_closed() {
    for left in [0u64, 3] {
        let (mut server, mut client) = offered(DEFAULT_CAPACITY).await;
        client.wx.send(&ping(100), &[]).await.unwrap();
        assert_eq!(recv(&mut server.rx).await.message, ping(100));
        for i in 0..left {
            client.wx.send(&ping(i), &[]).await.unwrap();
        }
        drop(client);
        for i in 0..left {
            assert_eq!(recv(&mut server.rx).await.message, ping(i));
        }
        let ended = tokio::time::timeout(WITHIN, server.rx.recv())
            .await
            .expect("the peer's close ends the wait");
        assert!(matches!(ended, Err(Error::Closed)), "{ended:?}");
    }
}

/// `readable_now` sees frames waiting in this side's ring, not only on the socket.
#[tokio::test(flavor = "current_thread")]
async fn readable_now_sees_frames_waiting_in_the_ring() {
    let (mut server, mut client) = offered(DEFAULT_CAPACITY).await;
    client.wx.send(&ping(1), &[]).await.unwrap();
    assert_eq!(recv(&mut server.rx).await.message, ping(1));
    assert!(!server.closer.readable_now(), "nothing waits");
    client.wx.send(&ping(2), &[]).await.unwrap();
    assert!(server.closer.readable_now(), "a frame waits in the ring");
    assert_eq!(recv(&mut server.rx).await.message, ping(2));
    assert!(!server.closer.readable_now(), "the frame was read");
}

/// After the switch, bytes on the socket with no marker in the ring before them break the
/// protocol: a typed error of the peer's fault, never a hang or a frame out of order.
#[tokio::test(flavor = "current_thread")]
async fn socket_bytes_without_a_marker_after_the_switch_are_the_peers_fault() {
    let (mut server, mut client) = offered(DEFAULT_CAPACITY).await;
    client.wx.send(&ping(1), &[]).await.unwrap();
    assert_eq!(recv(&mut server.rx).await.message, ping(1));
    let frame = frame_bytes(&ping(2), 0).unwrap();
    assert_eq!(client.wx.send_raw_for_test(&frame).unwrap(), frame.len());
    let got = tokio::time::timeout(WITHIN, server.rx.recv())
        .await
        .expect("an answer within the deadline");
    match got {
        Err(e @ Error::UnexpectedMessage { .. }) => assert!(e.is_peer_fault()),
        other => panic!("expected a protocol error, got {other:?}"),
    }
}

/// A `RingReady` from a peer that was offered no ring is out of place.
#[tokio::test(flavor = "current_thread")]
async fn ring_ready_without_an_offer_is_refused() {
    let (server, client) = linked(None, None).await;
    let (mut server, mut client) = (split(server), split(client));
    client.wx.send(&Message::RingReady, &[]).await.unwrap();
    let got = tokio::time::timeout(WITHIN, server.rx.recv())
        .await
        .unwrap();
    assert!(
        matches!(got, Err(Error::UnexpectedMessage { .. })),
        "{got:?}"
    );
    drop(client.rx);
}

/// Forged offers — a pipe and an unsealed memfd, too few descriptors, none — are refused
/// without a crash or an error: the link goes on over the socket, both ways.
#[tokio::test(flavor = "current_thread")]
async fn a_forged_ring_offer_is_refused_and_the_link_keeps_the_socket() {
    let (server, client) = linked(None, None).await;
    let (mut server, mut client) = (split(server), split(client));
    let (pipe_r, pipe_w) = rustix::pipe::pipe().unwrap();
    let unsealed: OwnedFd =
        rustix::fs::memfd_create("forged", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
    rustix::fs::ftruncate(&unsealed, (MIN_CAPACITY + 1024) as u64).unwrap();
    let offer = Message::RingOffer(RingOffer {
        capacity: MIN_CAPACITY as u64,
    });
    let forgeries: [Vec<BorrowedFd<'_>>; 4] = [
        vec![pipe_r.as_fd(), pipe_w.as_fd(), unsealed.as_fd()],
        vec![unsealed.as_fd(), pipe_r.as_fd(), pipe_w.as_fd()],
        vec![unsealed.as_fd()],
        vec![],
    ];
    for (i, fds) in forgeries.iter().enumerate() {
        client.wx.send(&offer, fds).await.unwrap();
        client.wx.send(&ping(i as u64), &[]).await.unwrap();
        assert_eq!(recv(&mut server.rx).await.message, ping(i as u64));
        server.wx.send(&Message::Pong(i as u64), &[]).await.unwrap();
        assert_eq!(recv(&mut client.rx).await.message, Message::Pong(i as u64));
        assert!(!server.wx.uses_ring() && !client.rx.uses_ring());
    }
}

/// Ring disabled, no offer goes out: the peer (which accepts any offer, its own setting
/// off) is still on the socket after its next send; enabled, it switches to the ring there.
#[tokio::test(flavor = "current_thread")]
async fn a_link_without_a_ring_sends_no_offer() {
    for ring in [None, Some(MIN_CAPACITY)] {
        let (server, client) = linked(ring, None).await;
        let (mut server, mut client) = (split(server), split(client));
        server.wx.send(&ping(0), &[]).await.unwrap();
        assert_eq!(recv(&mut client.rx).await.message, ping(0));
        client.wx.send(&ping(1), &[]).await.unwrap();
        assert_eq!(recv(&mut server.rx).await.message, ping(1));
        assert_eq!(client.wx.uses_ring(), ring.is_some(), "ring {ring:?}");
        assert_eq!(server.rx.uses_ring(), ring.is_some(), "ring {ring:?}");
    }
}

/// A blocking `Link` declines an offer itself (`RingDeclined`): its caller's first message
/// is the application's, with no descriptors, and the offering side goes on reading its
/// socket and lets its ring go (its memory, descriptors and slot in the budget of ends).
#[tokio::test(flavor = "current_thread")]
async fn a_blocking_link_declines_an_offer_and_both_stay_on_the_socket() {
    let (a, b) = UnixStream::pair().unwrap();
    a.set_nonblocking(true).unwrap();
    let a = tokio::net::UnixStream::from_std(a).unwrap();
    let blocking = tokio::task::spawn_blocking(move || {
        let mut link = Link::client(b, &config(None))?;
        let first = link.recv_timeout(WITHIN)?;
        link.send(&Message::Pong(7), &[])?;
        // The link is kept until the server has read the answer.
        Ok::<_, Error>((first, link))
    });
    let server = AsyncLink::server(a, &config(Some(MIN_CAPACITY)))
        .await
        .unwrap();
    let (mut rx, mut wx) = server.into_split();
    assert!(rx.keeps_ring(), "the offer's ring is kept until the answer");
    wx.send(&Message::Ping(7), &[]).await.unwrap();
    assert_eq!(recv(&mut rx).await.message, Message::Pong(7));
    assert!(!rx.uses_ring() && !wx.uses_ring());
    assert!(!rx.keeps_ring(), "the declined ring is still kept");
    let (first, _link) = tokio::time::timeout(WITHIN, blocking)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!((first.message, first.fds.len()), (Message::Ping(7), 0));
}

/// An offer an async link does not take (here: descriptors that are no ring) is answered
/// with `RingDeclined` before its next frame, on the socket; the link carries on there.
#[tokio::test(flavor = "current_thread")]
async fn an_offer_not_taken_is_declined_on_the_socket() {
    let (a, b) = UnixStream::pair().unwrap();
    a.set_nonblocking(true).unwrap();
    let a = tokio::net::UnixStream::from_std(a).unwrap();
    let blocking = tokio::task::spawn_blocking(move || {
        let mut link = Link::client(b, &config(None))?;
        let unsealed: OwnedFd =
            rustix::fs::memfd_create("forged", rustix::fs::MemfdFlags::CLOEXEC).unwrap();
        let offer = Message::RingOffer(RingOffer {
            capacity: MIN_CAPACITY as u64,
        });
        link.send(&offer, &[unsealed.as_fd()])?;
        link.send(&Message::Ping(3), &[])?;
        let first = link.recv_timeout(WITHIN)?.message;
        let second = link.recv_timeout(WITHIN)?.message;
        Ok::<_, Error>((first, second, link))
    });
    let server = AsyncLink::server(a, &config(None)).await.unwrap();
    let (mut rx, mut wx) = server.into_split();
    assert_eq!(recv(&mut rx).await.message, Message::Ping(3));
    wx.send(&Message::Pong(3), &[]).await.unwrap();
    let (first, second, _link) = tokio::time::timeout(WITHIN, blocking)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!((first, second), (Message::RingDeclined, Message::Pong(3)));
    assert!(!wx.uses_ring());
}

/// The environment variable that makes [`killed_peer_child`] the peer of
/// [`a_peer_killed_with_sigkill_ends_the_wait`]: the socket path to connect to.
const CHILD_ENV: &str = "BATON_RING_TEST_PEER";

/// The child's role (ignored unless [`CHILD_ENV`] names a socket): connects without a ring
/// of its own, reads the parent's first frame (and with it the offer), sends one frame
/// (which switches it to the parent's ring), then waits to be killed.
#[test]
#[ignore = "the peer process of a_peer_killed_with_sigkill_ends_the_wait"]
fn killed_peer_child() {
    let Ok(path) = std::env::var(CHILD_ENV) else {
        return;
    };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async {
        let link = AsyncLink::connect(&path, &config(None)).await.unwrap();
        let (mut rx, mut wx) = link.into_split();
        assert_eq!(recv(&mut rx).await.message, ping(0));
        wx.send(&ping(1), &[]).await.unwrap();
        assert!(wx.uses_ring());
        wx.send(&ping(2), &[]).await.unwrap();
        // Killed here; the deadline only bounds a parent that never kills.
        tokio::time::sleep(Duration::from_secs(60)).await;
    });
}

/// Kills and reaps the child however the test ends.
struct Reaped(std::process::Child);

impl Drop for Reaped {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A peer process killed with SIGKILL after it switched to our ring runs no `Drop`, so
/// its ring is never marked closed: the reader, waiting on the ring, ends with `Closed`
/// through the socket's end of stream, within the deadline, after the frames it sent.
#[tokio::test(flavor = "current_thread")]
async fn a_peer_killed_with_sigkill_ends_the_wait() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ring.sock");
    let listener = tokio::net::UnixListener::bind(&path).unwrap();
    let child = std::process::Command::new(std::env::current_exe().unwrap())
        .args([
            "--ignored",
            "--exact",
            "link::ring_tests::killed_peer_child",
            "--nocapture",
        ])
        .env(CHILD_ENV, &path)
        .spawn()
        .unwrap();
    let mut child = Reaped(child);
    let (stream, _) = tokio::time::timeout(WITHIN, listener.accept())
        .await
        .expect("the child connects")
        .unwrap();
    let link = AsyncLink::server(stream, &config(Some(MIN_CAPACITY)))
        .await
        .unwrap();
    let (mut rx, mut wx) = link.into_split();
    wx.send(&ping(0), &[]).await.unwrap();
    assert_eq!(recv(&mut rx).await.message, ping(1));
    assert_eq!(recv(&mut rx).await.message, ping(2));
    assert!(rx.uses_ring(), "the child writes into our ring");
    child.0.kill().unwrap();
    let status = child.0.wait().unwrap();
    assert!(!status.success(), "killed, not finished: {status:?}");
    let ended = tokio::time::timeout(WITHIN, rx.recv())
        .await
        .expect("the socket's end ends the wait");
    assert!(matches!(ended, Err(Error::Closed)), "{ended:?}");
}
