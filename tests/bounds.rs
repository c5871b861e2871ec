//! A node no peer can exhaust: one flood test per bound a peer controls, each driven by a
//! real second process (`baton-flood-peer`) that holds the session token and speaks the
//! link protocol frame by frame. For each: the offending link ends with its typed error,
//! this process's resident memory stays within a stated bound (printed), and an honest
//! peer's handoffs keep working throughout (their round trips printed). Then the bounds we
//! control: a sender faster than its link waits instead of queueing, a batch of our calls
//! leaves the queue's bound as strict as before, and an importer that cannot open a buffer
//! (its descriptor limit lowered) refuses that call and keeps its link and its other
//! leases.

#[path = "support/actors.rs"]
mod actors;
#[path = "support/msgs.rs"]
mod msgs;
#[path = "support/peer.rs"]
mod peer;

use actix::prelude::*;
use actors::{DEADLINE, Lines, Parent, eventually, exited, run};
use baton::actors::{ActorError, LinkLimits, Peer};
use baton::ipc::{HostBackend, Link, SharedBackend};
use baton::messages::Message as Wire;
use baton::messages::protocol::CallFault;
use msgs::*;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};
use tokio::task::spawn_blocking;

/// One test at a time: each measures this process's resident memory.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

/// The limits of the node under test: small, so that each flood reaches its bound fast.
fn limits() -> LinkLimits {
    LinkLimits {
        queued_bytes: 256 << 10,
        calls_in_flight: 8,
        offers_per_message: 64,
        leases_held: 256,
        ..LinkLimits::default()
    }
}

/// Resident memory of this process, in bytes (`/proc/self/statm`).
fn rss() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap();
    let pages: u64 = statm.split_whitespace().nth(1).unwrap().parse().unwrap();
    // 4 KiB pages: x86-64 and the AArch64 kernels this runs on.
    pages * 4096
}

/// Answers `Nap`: sleeps, then replies with `reply_bytes` bytes. Counts the naps running
/// at once ([`NAPPING`]) and the most seen ([`MOST_NAPPING`]).
struct Napper;

/// `Nap`s running now.
static NAPPING: AtomicUsize = AtomicUsize::new(0);
/// The most `Nap`s seen running at once since the last reset.
static MOST_NAPPING: AtomicUsize = AtomicUsize::new(0);

impl Actor for Napper {
    type Context = Context<Self>;
}

impl Handler<Nap> for Napper {
    type Result = ResponseFuture<Vec<u8>>;

    fn handle(&mut self, msg: Nap, _: &mut Context<Self>) -> Self::Result {
        let now = NAPPING.fetch_add(1, Ordering::SeqCst) + 1;
        MOST_NAPPING.fetch_max(now, Ordering::SeqCst);
        Box::pin(async move {
            tokio::time::sleep(Duration::from_millis(msg.ms.into())).await;
            NAPPING.fetch_sub(1, Ordering::SeqCst);
            vec![7; msg.reply_bytes as usize]
        })
    }
}

/// Keeps every buffer offered to it (an inbox that never lets go).
struct Hoarder(Vec<baton::actors::Shared<u8>>);

impl Actor for Hoarder {
    type Context = Context<Self>;
}

impl Handler<baton::actors::Offered> for Hoarder {
    type Result = ();
    fn handle(&mut self, msg: baton::actors::Offered, _: &mut Context<Self>) {
        self.0.push(msg.buffer);
    }
}

/// Keeps every buffer of a `Hold` call.
struct Keeper(Vec<baton::actors::Shared<u32>>);

impl Actor for Keeper {
    type Context = Context<Self>;
}

impl Handler<Hold> for Keeper {
    type Result = usize;
    fn handle(&mut self, msg: Hold, _: &mut Context<Self>) -> usize {
        self.0.extend(msg.buffers);
        self.0.len()
    }
}

/// The node under test, with `limits()`, an honest child linked to it, and the handlers
/// the floods aim at.
async fn setup(tag: &str) -> (Parent, peer::Peer, Peer) {
    let ns = peer::namespace(tag);
    let backend: SharedBackend = Arc::new(HostBackend::with_namespace(&ns).unwrap());
    let mut parent = Parent::start_configured(&ns, backend, |c| c.limits(limits()));
    parent
        .child_env
        .push(("BATON_BACKEND".into(), "host".into()));
    parent
        .node
        .register::<Nap>("nap", Napper.start().recipient());
    parent
        .node
        .register::<Hold>("holder", Keeper(Vec::new()).start().recipient());
    parent
        .node
        .set_inbox(Hoarder(Vec::new()).start().recipient());
    let (honest, link) = parent.child(&[]).await;
    (parent, honest, link)
}

/// A node under test with `limits()`, and a raw link of this process connected to it (a
/// peer driven frame by frame from blocking tasks), with the node's side of it.
async fn raw_peer(tag: &str) -> (Parent, Link, Peer) {
    let ns = peer::namespace(tag);
    let backend: SharedBackend = Arc::new(HostBackend::with_namespace(&ns).unwrap());
    let parent = Parent::start_configured(&ns, backend, |c| c.limits(limits()));
    let (raw, link) = parent.raw_link().await;
    (parent, raw, link)
}

/// Round trips of an honest handoff (a buffer to the child, summed there), one after the
/// other, until `done` holds; each must succeed. Returns the sorted latencies.
async fn honest_handoffs(
    parent: &Parent,
    link: &Peer,
    mut done: impl FnMut() -> bool,
) -> Vec<Duration> {
    let buf = parent.pattern_buffer(256, 9).await;
    let want: u64 = (0..256).map(|i| u64::from(pattern(9, i))).sum();
    let sink = link.remote::<Sum>("sink");
    let mut took = Vec::new();
    let start = Instant::now();
    while !done() || took.len() < 20 {
        assert!(start.elapsed() < DEADLINE, "the flood never ended");
        let t = Instant::now();
        let sum = sink
            .send_timeout(
                Sum {
                    buffers: vec![buf.share()],
                },
                DEADLINE,
            )
            .await
            .expect("the honest peer's handoff works during the flood");
        took.push(t.elapsed());
        assert_eq!(sum, want);
    }
    took.sort();
    took
}

/// Runs `role args…` of the flood peer against the node, keeps an honest handoff loop
/// going and samples memory until the flooder is cut, then checks its link ended with
/// `expected` and memory stayed within `bound` bytes of growth.
async fn flood(tag: &str, role: &str, args: &[&str], expected: &str, bound: u64) {
    let (parent, mut honest, link) = setup(tag).await;
    // Warm up (first allocations, mappings, code pages), then measure from here.
    honest_handoffs(&parent, &link, || true).await;
    let before = rss();
    let sock = parent.socket();
    let mut argv = vec![role, sock.as_str()];
    argv.extend_from_slice(args);
    let (mut flooder, flood_link) = parent
        .spawn_linked(peer::exe("baton-flood-peer"), &argv, true)
        .await;
    let lines = Lines::of(flooder.take_stdout().expect("piped"));
    let mut peak = before;
    let events = parent.events.clone();
    let id = flood_link.link_id();
    let took = honest_handoffs(&parent, &link, || {
        peak = peak.max(rss());
        events.down_reason(id).is_some()
    })
    .await;
    let reason = parent.events.down_reason(id).unwrap().unwrap_or_default();
    assert!(
        reason.contains(expected),
        "{role}: the flooder's link ended with {reason:?}, not {expected}"
    );
    let sent = lines.next_line(DEADLINE).await;
    assert!(exited(&mut flooder, DEADLINE).await.success());
    let grew = peak.saturating_sub(before);
    println!(
        "{role}: flooder {sent}, cut with {expected}; our resident memory {} KiB → peak {} KiB \
         (+{} KiB, bound {} KiB); honest handoffs during the flood: {}, p50 {:?}, p99 {:?}",
        before >> 10,
        peak >> 10,
        grew >> 10,
        bound >> 10,
        took.len(),
        took[took.len() / 2],
        took[took.len() * 99 / 100],
    );
    assert!(
        grew <= bound,
        "{role}: memory grew by {grew} bytes, over the bound of {bound}"
    );
    // The honest peer never noticed.
    assert!(link.is_connected());
    assert!(parent.events.down_reason(link.link_id()).is_none());
    link.close();
    assert!(exited(&mut honest, DEADLINE).await.success());
}

#[test]
fn a_hundred_thousand_pings_never_read_cut_the_flooder_not_the_node() {
    let _serial = serial();
    run(async {
        // Pongs queue for a peer that does not read, up to the queue's 256 KiB.
        flood("fping", "pings", &["100000"], "PeerNotReading", 32 << 20).await;
    });
}

#[test]
fn calls_faster_than_the_node_handles_them_pause_its_reading() {
    let _serial = serial();
    run(async {
        // Eight calls run at once; reading pauses; their 4 KiB replies pile up unread.
        flood("fcall", "calls", &[], "PeerNotReading", 32 << 20).await;
    });
}

/// The calls-in-flight bound itself, told apart from no bound: a peer that sends 64 slow
/// calls at once and reads every reply is never cut (it breaks no rule), but at most
/// `calls_in_flight` (8) of its calls run here at once — the others wait, unread, in its
/// socket — and all 64 are answered.
#[test]
fn at_most_calls_in_flight_of_a_peers_calls_run_at_once() {
    let _serial = serial();
    run(async {
        let (parent, mut honest, link) = setup("fburst").await;
        NAPPING.store(0, Ordering::SeqCst);
        MOST_NAPPING.store(0, Ordering::SeqCst);
        let sock = parent.socket();
        let (mut burst, burst_link) = parent
            .spawn_linked(
                peer::exe("baton-flood-peer"),
                &["burst", &sock, "64", "100"],
                true,
            )
            .await;
        let lines = Lines::of(burst.take_stdout().expect("piped"));
        let answered = lines.next_line(DEADLINE).await;
        assert!(exited(&mut burst, DEADLINE).await.success());
        let most = MOST_NAPPING.load(Ordering::SeqCst);
        let bound = limits().calls_in_flight;
        println!(
            "64 calls at once: {answered} answered, at most {most} ran at once (bound {bound})"
        );
        assert_eq!(answered, "sent 64", "every call answered");
        assert!(
            most <= bound,
            "{most} of the peer's calls ran at once, past the bound of {bound}"
        );
        assert!(most > 1, "the calls ran concurrently ({most} at most)");
        assert!(
            parent
                .events
                .down_reason(burst_link.link_id())
                .flatten()
                .is_none_or(|r| !r.contains("PeerNotReading")),
            "a peer that reads its replies is not cut"
        );
        link.close();
        assert!(exited(&mut honest, DEADLINE).await.success());
    });
}

#[test]
fn a_call_with_more_offers_than_allowed_is_a_protocol_fault() {
    let _serial = serial();
    run(async {
        flood("foffer", "offers", &["65"], "TooManyOffers", 32 << 20).await;
    });
}

#[test]
fn more_leases_than_allowed_is_a_protocol_fault() {
    let _serial = serial();
    run(async {
        flood("flease", "leases", &[], "TooManyLeases", 32 << 20).await;
    });
}

/// A sender faster than its link: calls to a stopped peer wait for room instead of
/// queueing — the link never holds more than the send window — and all go through once
/// the peer reads again.
#[test]
fn a_sender_faster_than_its_link_waits_for_room() {
    let _serial = serial();
    run(async {
        let (_parent, mut honest, link) = setup("fsend").await;
        let window = limits().send_window;
        let blob = link.remote::<Blob>("blob");
        signal(&honest, rustix::process::Signal::STOP);
        // 48 calls of 512 KiB (24 MiB): three times the window.
        let sends: Vec<_> = (0..48)
            .map(|_| {
                actix::spawn(blob.send_timeout(
                    Blob {
                        data: vec![7; 512 << 10],
                    },
                    DEADLINE,
                ))
            })
            .collect();
        // The writer fills the socket and the window; the rest wait.
        let start = Instant::now();
        let mut most = 0;
        while start.elapsed() < Duration::from_millis(500) {
            most = most.max(link.queued_bytes());
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        println!(
            "queued for the stopped peer: at most {} KiB (window {} KiB)",
            most >> 10,
            window >> 10
        );
        assert!(most > 0, "something was queued");
        assert!(
            most <= window + (64 << 10),
            "the link queued {most} bytes, past its {window}-byte window"
        );
        let finished = sends.iter().filter(|s| s.is_finished()).count();
        if finished > 0 {
            let first = sends.into_iter().find(|s| s.is_finished()).unwrap();
            panic!(
                "{finished} calls finished while the peer is stopped: {:?}",
                first.await
            );
        }
        signal(&honest, rustix::process::Signal::CONT);
        for send in sends {
            assert_eq!(send.await.unwrap().unwrap(), 512 << 10);
        }
        link.close();
        assert!(exited(&mut honest, DEADLINE).await.success());
    });
}

/// Calls of ours queued back to back leave in one `sendmsg`, and the batch takes their
/// bytes out of the calls' count exactly (the send window bounds them, not the queue's
/// bound). So after a batch of eight calls, a peer that sends pings and reads no pong is
/// still cut at the queue's bound (`PeerNotReading`): a miscounted batch would leave the
/// bound unenforced. The peer is a raw link of this process, driven from a blocking task.
#[test]
fn after_a_batch_of_calls_the_queue_bound_still_cuts_a_peer_that_does_not_read() {
    let _serial = serial();
    run(async {
        let (parent, mut raw, link) = raw_peer("fbatch").await;

        // `send` queues its call before it returns: all eight are queued before the link's
        // writer runs, and leave together.
        let blob = link.remote::<Blob>("blob");
        let calls: Vec<_> = (0..8)
            .map(|i| actix::spawn(blob.send_timeout(Blob { data: vec![i; 64] }, DEADLINE)))
            .collect();
        // The peer reads the eight calls (and answers none), then sends pings and reads no
        // pong.
        let flood = spawn_blocking(move || {
            let mut calls = 0;
            while calls < 8 {
                if let Wire::Call(_) = raw.recv_timeout(DEADLINE)?.message {
                    calls += 1;
                }
            }
            let mut sent = 0u64;
            while sent < 200_000 && raw.send(&Wire::Ping(sent), &[]).is_ok() {
                sent += 1;
            }
            Ok::<_, baton::ipc::Error>(sent)
        });
        eventually(DEADLINE, "the raw link to end", || {
            parent.events.down_reason(link.link_id()).is_some()
        })
        .await;
        let reason = parent.events.down_reason(link.link_id()).unwrap();
        assert!(
            reason
                .as_deref()
                .is_some_and(|r| r.contains("PeerNotReading")),
            "after a batch of calls, the peer that reads no pong ended with {reason:?}"
        );
        let sent = flood.await.unwrap().expect("the peer read our eight calls");
        println!("after a batch of 8 calls: the peer sent {sent} pings before it was cut");
        for call in calls {
            let got = call.await.unwrap();
            assert!(
                matches!(got, Err(ActorError::LinkClosed { .. })),
                "an unanswered call ends with the link: {got:?}"
            );
        }
    });
}

/// The queue's bound is a sum of bytes: a peer that falls a long way behind but reads is not
/// cut. A raw link of this process sends pings without reading until ~64 KiB of our pongs
/// are queued past its socket (a quarter of the 256 KiB bound), then reads every pong: the
/// link stays up, and every ping is answered, in order.
#[test]
fn a_peer_far_behind_that_reads_is_not_cut() {
    use std::sync::atomic::AtomicBool;
    let _serial = serial();
    run(async {
        let (parent, mut raw, link) = raw_peer("fslow").await;
        let behind = 64 << 10;
        let read_now = Arc::new(AtomicBool::new(false));
        let peer = {
            let read_now = Arc::clone(&read_now);
            spawn_blocking(move || {
                let mut sent = 0u64;
                while !read_now.load(Ordering::SeqCst) && sent < 1_000_000 {
                    raw.send(&Wire::Ping(sent), &[])?;
                    sent += 1;
                }
                // Every pong, in the order of the pings (queued or not, frames keep one order).
                let mut pongs = 0u64;
                while pongs < sent {
                    if let Wire::Pong(n) = raw.recv_timeout(DEADLINE)?.message {
                        assert_eq!(n, pongs, "pong {n} came where pong {pongs} was due");
                        pongs += 1;
                    }
                }
                Ok::<_, baton::ipc::Error>((sent, raw))
            })
        };
        let mut most = 0;
        eventually(DEADLINE, "our pongs to queue up", || {
            most = most.max(link.queued_bytes());
            most >= behind || parent.events.down_reason(link.link_id()).is_some()
        })
        .await;
        read_now.store(true, Ordering::SeqCst);
        let (sent, raw) = peer
            .await
            .unwrap()
            .expect("the peer that reads gets every pong");
        println!(
            "the peer sent {sent} pings, fell {} KiB behind (bound {} KiB), then read every pong",
            most >> 10,
            limits().queued_bytes >> 10
        );
        assert!(
            parent.events.down_reason(link.link_id()).is_none(),
            "a peer {} KiB behind, under the bound, was cut: {:?}",
            most >> 10,
            parent.events.down_reason(link.link_id())
        );
        assert!(most >= behind, "only {most} bytes were ever queued");
        assert!(link.is_connected());
        drop(raw);
    });
}

fn signal(child: &peer::Peer, sig: rustix::process::Signal) {
    let pid = rustix::process::Pid::from_raw(child.pid() as i32).expect("a pid");
    rustix::process::kill_process(pid, sig).expect("signal");
}

/// An importer that cannot open a buffer — it is at its open-file limit — refuses that
/// call (a typed remote error; the lease comes back), and keeps its link and the leases it
/// already holds. On named segments (the open is an `shm_open`) and on memfds (the
/// descriptor cannot be received: the kernel drops it).
/// Whether the lease table says process `pid` may map buffer `id`.
fn maps(table: &[baton::actors::BufferLeases], id: baton::actors::BufferId, pid: u32) -> bool {
    table
        .iter()
        .find(|b| b.buffer == id)
        .is_some_and(|b| b.mapped_by.iter().any(|p| p.pid == pid))
}

#[test]
fn an_importer_that_cannot_open_refuses_the_call_and_keeps_its_link() {
    let _serial = serial();
    run(async {
        for flavor in ["named", "memfd"] {
            let ns = peer::namespace(&format!("fdl{flavor}"));
            let backend: SharedBackend = Arc::new(
                HostBackend::with_flavor(
                    if flavor == "named" {
                        baton::ipc::HostFlavor::Named
                    } else {
                        baton::ipc::HostFlavor::Memfd
                    },
                    &ns,
                )
                .unwrap(),
            );
            let mut parent = Parent::start_with(&ns, backend);
            parent
                .child_env
                .push(("BATON_BACKEND".into(), "host".into()));
            let (mut child, link) = parent.child(&["stubborn"]).await;
            let held = parent.pattern_buffer(64, 1).await;
            let holder = link.remote::<Hold>("holder");
            holder
                .send(Hold {
                    buffers: vec![held.share()],
                })
                .await
                .unwrap();
            // A buffer the importer keeps mapped after giving its lease back (warm).
            let warm = parent.pattern_buffer(64, 3).await;
            holder
                .send(Hold {
                    buffers: vec![warm.share()],
                })
                .await
                .unwrap();
            link.remote::<DropHeld>("holder.drop")
                .send(DropHeld)
                .await
                .unwrap();
            eventually(DEADLINE, "the warm buffer's lease back", || {
                warm.leases_out() == 0
            })
            .await;
            holder
                .send(Hold {
                    buffers: vec![held.share()],
                })
                .await
                .unwrap();
            let limit = link
                .remote::<LimitFds>("fd-limit")
                .send(LimitFds { spare: 0 })
                .await
                .unwrap();
            let refused = parent.pattern_buffer(64, 2).await;
            // The refused call also carries buffers the importer maps already (no
            // descriptor needed): it gives back every lease, and says `Unmapped` for the
            // new allocation only — never for one it maps, or the exporter would count it
            // unmapped while it is.
            let got = holder
                .send(Hold {
                    buffers: vec![refused.share(), warm.share(), held.share(), refused.share()],
                })
                .await;
            println!(
                "{flavor}: at its limit of {limit} descriptors, the importer answered {got:?}"
            );
            assert!(
                matches!(&got, Err(ActorError::Remote(CallFault::OfferRefused(why))) if why.contains("open") || why.contains("descriptor") || why.contains("files")),
                "{flavor}: {got:?}"
            );
            // The refused lease came back; the one held before is still out and readable.
            eventually(DEADLINE, "the refused lease back", || {
                refused.leases_out() == 0
            })
            .await;
            eventually(
                DEADLINE,
                "the refused call's lease on the held buffer back",
                || held.leases_out() == 1,
            )
            .await;
            let child_pid = link.process().pid;
            let table = parent.table().await;
            let mapping = |id| maps(&table, id, child_pid);
            assert!(
                mapping(held.id()),
                "{flavor}: the importer still maps the held buffer"
            );
            assert!(
                !mapping(refused.id()),
                "{flavor}: it maps nothing of the refused one"
            );
            assert!(link.is_connected());
            let first = link
                .remote::<PeekHeld>("holder.peek")
                .send(PeekHeld)
                .await
                .unwrap();
            assert_eq!(first, vec![pattern(1, 0)]);
            // One lease over a buffer it maps and a new one it cannot open (then a lease
            // of its own): the part opened goes back with the lease, once — a second
            // `Release` of it would be an unknown lease, and the link cut.
            let new = parent.pattern_buffer(64, 4).await;
            let got = holder
                .send(Hold {
                    buffers: vec![
                        warm.share(),
                        new.share().lease_with_previous(),
                        held.share(),
                    ],
                })
                .await;
            assert!(
                matches!(&got, Err(ActorError::Remote(CallFault::OfferRefused(_)))),
                "{flavor}: a lease over several buffers, one part unopenable: {got:?}"
            );
            eventually(DEADLINE, "every lease of the refused call back", || {
                warm.leases_out() == 0 && new.leases_out() == 0 && held.leases_out() == 1
            })
            .await;
            let table = parent.table().await;
            let mapping = |id| maps(&table, id, child_pid);
            assert!(
                mapping(warm.id()),
                "{flavor}: the part it maps stays mapped"
            );
            assert!(
                !mapping(new.id()),
                "{flavor}: it maps nothing of the new one"
            );
            assert!(link.is_connected());
            assert!(parent.events.down_reason(link.link_id()).is_none());
            link.close();
            assert!(exited(&mut child, DEADLINE).await.success());
        }
    });
}

/// A peer that ends in the middle of a frame while our reading is paused (its call holds
/// the only call slot) and our writer meets the closed socket first (a heartbeat ping):
/// the reader's verdict says how the link ended, not the write. The writer leaves the
/// verdict to the reader for at most `READER_VERDICT_TRIES` × 100 ms (1 s): a call that
/// ends within that lets the reader read the half frame — `Truncated`; one that outlives
/// it does not hold the link open, which then ends without a reason.
#[test]
fn a_peer_gone_mid_frame_while_reading_is_paused_leaves_the_verdict_to_the_reader() {
    use baton::messages::codec::frame_bytes;
    use baton::messages::protocol::Call;
    use std::io::Write;
    let _serial = serial();
    run(async {
        for (nap_ms, truncated) in [(400_u32, true), (5000, false)] {
            let ns = peer::namespace("verdict");
            let backend: SharedBackend = Arc::new(HostBackend::with_namespace(&ns).unwrap());
            let parent = Parent::start_configured(&ns, backend, |c| {
                c.limits(LinkLimits {
                    calls_in_flight: 1,
                    ..LinkLimits::default()
                })
                // Pings fast, so the writer meets the closed socket at once; no silence cut.
                .heartbeat(baton::actors::Heartbeat {
                    interval: Duration::from_millis(50),
                    deadline: Duration::from_secs(60),
                })
            });
            parent
                .node
                .register::<Nap>("nap", Napper.start().recipient());
            let (link, node_side) = parent.raw_link().await;
            let link_id = node_side.link_id();
            let call = Wire::Call(Call {
                id: 1,
                target: "nap".into(),
                type_name: "test.Nap".into(),
                payload: bincode::serde::encode_to_vec(
                    Nap {
                        ms: nap_ms,
                        reply_bytes: 0,
                    },
                    bincode::config::standard(),
                )
                .unwrap(),
                offers: Vec::new(),
            });
            spawn_blocking(move || {
                let mut link = link;
                link.send(&call, &[]).unwrap();
                // Half of another frame, then the peer is gone (both descriptors closed).
                let frame = frame_bytes(&call, 0).unwrap();
                let mut socket = std::os::unix::net::UnixStream::from(
                    link.as_fd().try_clone_to_owned().unwrap(),
                );
                socket.write_all(&frame[..frame.len() / 2]).unwrap();
            })
            .await
            .unwrap();
            eventually(DEADLINE, "the link down", || {
                parent.events.down_reason(link_id).is_some()
            })
            .await;
            let reason = parent.events.down_reason(link_id).unwrap();
            if truncated {
                assert!(
                    reason.as_deref().is_some_and(|r| r.contains("Truncated")),
                    "a call that ended within the writer's wait: {reason:?}"
                );
            } else {
                assert_eq!(reason, None, "a call that outlived the writer's wait");
            }
        }
    });
}

/// Sums what it is sent (the other host's side of the test below).
struct Summer;

impl Actor for Summer {
    type Context = Context<Self>;
}

impl Handler<Sum> for Summer {
    type Result = u64;
    fn handle(&mut self, msg: Sum, _: &mut Context<Self>) -> u64 {
        msg.buffers
            .into_iter()
            .map(|b| {
                let lease = b.open().expect("a landed copy opens");
                lease
                    .to_vec()
                    .expect("readable")
                    .iter()
                    .map(|&x| u64::from(x))
                    .sum::<u64>()
            })
            .sum()
    }
}

#[test]
fn a_peer_on_another_host_cannot_make_us_receive_more_copies_than_the_bound() {
    use baton::actors::{HostSettings, Node, NodeConfig};
    use baton::ipc::tcp::HostId;
    let _serial = serial();
    run(async {
        let session = baton::Session::generate().unwrap();
        let config = |host: &str| {
            NodeConfig::new(session.clone())
                .hosts(HostSettings {
                    host: HostId::named(host),
                    ..HostSettings::default()
                })
                .limits(LinkLimits {
                    copy_bytes: 1 << 20,
                    ..LinkLimits::default()
                })
        };
        let ours = Node::with_config(config("bound-a"), Arc::new(HostBackend::new().unwrap()));
        let theirs = Node::with_config(config("bound-b"), Arc::new(HostBackend::new().unwrap()));
        ours.register::<Sum>("sum", Summer.start().recipient());
        let mut listening = ours.listen_tcp("127.0.0.1:0").unwrap();
        let peer = theirs.connect_tcp(listening.local_addr()).await.unwrap();
        listening.accept_timeout(DEADLINE).await.unwrap();
        let sum = peer.remote::<Sum>("sum");

        // Two 768 KiB buffers in one message: 1.5 MiB of copies, past the 1 MiB bound.
        let big: Vec<_> = (0..2)
            .map(|_| {
                let b = theirs.allocate::<u32>(192 << 10).unwrap();
                b.write_at(0, &vec![1u32; 192 << 10]).unwrap();
                b
            })
            .collect();
        let refused = sum
            .send(Sum {
                buffers: big.iter().map(|b| b.share()).collect(),
            })
            .await;
        assert!(
            matches!(refused, Err(ActorError::Remote(CallFault::OfferRefused(_)))),
            "refused, typed: {refused:?}"
        );
        for b in &big {
            b.returned_within(DEADLINE)
                .await
                .expect("the leases come back");
        }
        // The link is unharmed: one of them alone fits.
        let total = sum
            .send(Sum {
                buffers: vec![big[0].share()],
            })
            .await
            .expect("within the bound");
        assert_eq!(total, 192 << 10);
        assert!(peer.is_connected());
        peer.close_and_wait().await;
    });
}
