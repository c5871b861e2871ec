//! Whose fault each error is: every variant's kind pinned (see `fault`).

use super::*;
use baton_ipc::Fault;
use baton_messages::{ActorId, BootId};
use std::os::unix::process::ExitStatusExt;

fn process() -> ProcessId {
    ProcessId {
        boot: BootId([1; 16]),
        pid: 7,
        start_ticks: 9,
    }
}

/// One error of every variant of this crate's own, with the kind it must have (the
/// `Ipc` variant is pinned by the nesting test below).
fn every_own_variant() -> Vec<(ActorError, Fault)> {
    let (lease, buffer) = (LeaseId::new(4), BufferId::next());
    let secs = Duration::from_secs(1);
    vec![
        (ActorError::UnknownLease { lease }, Fault::Peer),
        (
            ActorError::ForeignOffer {
                claimed: ExporterId {
                    process: process(),
                    actor: ActorId::new(2),
                },
            },
            Fault::Peer,
        ),
        (ActorError::DuplicateLease { lease }, Fault::Peer),
        (ActorError::UnknownCall { id: 3 }, Fault::Peer),
        (ActorError::Unexpected { got: "Hello" }, Fault::Peer),
        (ActorError::TooManyOffers { count: 9, max: 8 }, Fault::Peer),
        (ActorError::TooManyLeases { max: 8 }, Fault::Peer),
        (
            ActorError::TooManyHeld {
                messages: 8,
                bytes: 0,
                max_messages: 8,
                max_bytes: 64,
            },
            Fault::Peer,
        ),
        (ActorError::TooManyFences { count: 9, max: 8 }, Fault::Peer),
        (
            ActorError::PeerNotReading {
                peer: process(),
                queued: 1 << 20,
            },
            Fault::Peer,
        ),
        (ActorError::TooManyStatusRequests { max: 4 }, Fault::Peer),
        (ActorError::Remote(CallFault::NoSuchActor), Fault::Refused),
        (
            ActorError::ForwardRefused {
                reason: "writable".into(),
            },
            Fault::Refused,
        ),
        (
            ActorError::BundleTooLarge { needs: 8, len: 4 },
            Fault::Handle,
        ),
        (
            ActorError::Version(baton_messages::VersionFault::Stale {
                committed: 3,
                got: 2,
            }),
            Fault::Refused,
        ),
        (
            ActorError::InfeasibleDeadline {
                left: Duration::ZERO,
                min: Duration::from_millis(1),
                max: Duration::from_secs(86_400),
            },
            Fault::Usage,
        ),
        (
            ActorError::SyncOver {
                version: 2,
                why: "its deadline passed",
            },
            Fault::Ended,
        ),
        (
            ActorError::OfferRefused(baton_ipc::Error::DescriptorsLost { slot: 0 }),
            Fault::Local,
        ),
        (
            ActorError::Spawn {
                name: "child".into(),
                source: std::io::Error::from_raw_os_error(2),
            },
            Fault::Local,
        ),
        (
            ActorError::Encode {
                what: "a call",
                reason: "too deep".into(),
            },
            Fault::Usage,
        ),
        (
            ActorError::Decode {
                what: "a reply",
                reason: "wrong type".into(),
            },
            Fault::Usage,
        ),
        (
            ActorError::WrongElementType {
                expected: DType::F32,
                got: None,
            },
            Fault::Usage,
        ),
        (
            ActorError::OutOfBounds {
                index: 1,
                len: 2,
                size: 2,
            },
            Fault::Usage,
        ),
        (ActorError::UnknownBuffer(buffer), Fault::Usage),
        (ActorError::NotOwned, Fault::Usage),
        (ActorError::NotReceived, Fault::Usage),
        (
            ActorError::TooManyDescriptors {
                count: 300,
                max: 253,
            },
            Fault::Usage,
        ),
        (ActorError::TooManyStreams { max: 4 }, Fault::Usage),
        (
            ActorError::NoParent {
                var: "BATON_PARENT",
            },
            Fault::Usage,
        ),
        (ActorError::BufferLeased { buffer, leases: 1 }, Fault::Usage),
        (
            ActorError::LeaseConflict {
                buffer,
                wanted: "writable",
                reason: "other leases on it are out",
            },
            Fault::Usage,
        ),
        (ActorError::NotHostMemory, Fault::Usage),
        (ActorError::NoSuchTensor { name: "w".into() }, Fault::Usage),
        (
            ActorError::LinkClosed {
                peer: process(),
                cause: LinkEnd::Closed,
            },
            Fault::Ended,
        ),
        (
            ActorError::Orphaned {
                exporter: process(),
            },
            Fault::Ended,
        ),
        (ActorError::RevokeDeadline { lease }, Fault::Ended),
        (
            ActorError::Unresponsive {
                peer: process(),
                silent_for: secs,
            },
            Fault::Ended,
        ),
        (ActorError::PeerExited { peer: process() }, Fault::Ended),
        (
            ActorError::Mailbox(actix::MailboxError::Closed),
            Fault::Ended,
        ),
        (
            ActorError::Timeout {
                op: "call",
                after: secs,
            },
            Fault::Ended,
        ),
        (
            ActorError::NotReturned {
                buffer,
                leases: 1,
                holders: vec![(LeaseId::new(1), process())],
                after: secs,
            },
            Fault::Ended,
        ),
        (ActorError::NotListening, Fault::Ended),
        (
            ActorError::ChildExited {
                pid: 9,
                status: std::process::ExitStatus::from_raw(0),
            },
            Fault::Ended,
        ),
    ]
}

#[test]
fn every_variant_has_the_kind_it_is_pinned_to() {
    for (error, kind) in every_own_variant() {
        assert_eq!(error.fault(), kind, "{error:?}");
        assert_eq!(error.is_peer_fault(), kind == Fault::Peer, "{error:?}");
    }
}

/// The peer faults are the list as it stood before the kinds — the protocol breaches
/// from `UnknownLease` to `TooManyStatusRequests` — and `TooManyHeld` (a host link's
/// messages waiting in order past the bound), none of the cuts this node decides (a
/// revoke deadline, silence, an exit).
#[test]
fn the_peer_faults_are_the_protocol_breaches() {
    let peer = every_own_variant()
        .into_iter()
        .filter(|(e, _)| e.is_peer_fault())
        .count();
    assert_eq!(peer, 11);
    for e in [
        ActorError::RevokeDeadline {
            lease: LeaseId::new(1),
        },
        ActorError::Unresponsive {
            peer: process(),
            silent_for: Duration::ZERO,
        },
        ActorError::PeerExited { peer: process() },
        ActorError::OfferRefused(baton_ipc::Error::Closed),
    ] {
        assert!(!e.is_peer_fault(), "{e:?}");
    }
}

/// An `Ipc` error is what it wraps: nested kinds, as rustls nests them.
#[test]
fn an_ipc_error_has_the_kind_it_wraps() {
    for (inner, kind) in [
        (baton_ipc::Error::BadToken, Fault::Peer),
        (baton_ipc::Error::UnexpectedFds, Fault::Peer),
        (baton_ipc::Error::DescriptorsLost { slot: 0 }, Fault::Local),
        (baton_ipc::Error::Closed, Fault::Ended),
        (baton_ipc::Error::ZeroSize, Fault::Usage),
        (
            baton_ipc::Error::MemoryTooSmall {
                claimed: 2,
                actual: 1,
            },
            Fault::Handle,
        ),
    ] {
        let outer = ActorError::from(inner);
        assert_eq!(outer.fault(), kind, "{outer:?}");
        assert_eq!(outer.is_peer_fault(), kind == Fault::Peer, "{outer:?}");
    }
}

/// `link_closed` says the peer died only for a process of this host that is gone: a
/// reaped child, a zombie; never for a live one, nor for a peer of another host (whose
/// life this host cannot see).
#[test]
fn a_closed_link_says_the_peer_died_only_when_its_process_is_gone_here() {
    let cause = |peer| match ActorError::link_closed(peer) {
        ActorError::LinkClosed { cause, .. } => cause,
        other => panic!("{other:?}"),
    };
    assert_eq!(cause(baton_ipc::process::current()), LinkEnd::Closed);
    assert_eq!(cause(process()), LinkEnd::Closed, "another boot's process");

    let mut child = std::process::Command::new("sleep")
        .arg("30")
        .spawn()
        .unwrap();
    let pid = child.id();
    let peer = ProcessId {
        boot: baton_ipc::process::boot_id(),
        pid,
        start_ticks: baton_ipc::process::start_ticks(pid).unwrap(),
    };
    assert_eq!(cause(peer), LinkEnd::Closed, "alive");
    child.kill().unwrap();
    // Killed, not reaped yet: a zombie is dead.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while cause(peer) != LinkEnd::PeerDied {
        assert!(
            std::time::Instant::now() < deadline,
            "the zombie was never seen dead"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    let e = ActorError::link_closed(peer);
    assert!(e.to_string().contains("the peer process died"), "{e}");
    child.wait().unwrap();
    assert_eq!(cause(peer), LinkEnd::PeerDied, "reaped");
}
