//! Whose fault each error is: every variant's kind pinned (see `fault`).

use super::*;
use baton_messages::{ActorId, BootId};

fn process() -> ProcessId {
    ProcessId {
        boot: BootId([1; 16]),
        pid: 7,
        start_ticks: 9,
    }
}

fn exporter() -> ExporterId {
    ExporterId {
        process: process(),
        actor: ActorId::new(1),
    }
}

fn io_error() -> Error {
    Error::Io {
        op: "open",
        source: io::Error::from_raw_os_error(24),
    }
}

/// One error of every variant, with the kind it must have: a new variant fails to
/// compile in `fault` until it is given one, and is pinned here.
fn every_variant() -> Vec<(Error, Fault)> {
    let (alloc, generation) = (AllocationId::new(3), Generation::new(2));
    vec![
        (
            Error::Message(baton_messages::Error::BadMagic { got: [0, 1] }),
            Fault::Peer,
        ),
        (
            Error::UnexpectedMessage {
                expected: "Hello",
                got: "Ping",
            },
            Fault::Peer,
        ),
        (
            Error::PeerIdentityMismatch {
                claimed: process(),
                actual_pid: 8,
            },
            Fault::Peer,
        ),
        (Error::MissingFds { need: 2, have: 1 }, Fault::Peer),
        (Error::UnexpectedFds, Fault::Peer),
        (Error::MissingFdSlot { slot: 1 }, Fault::Peer),
        (
            Error::UnsealedMemory {
                exporter: exporter(),
            },
            Fault::Peer,
        ),
        (Error::BadToken, Fault::Peer),
        (Error::PeerNotAllowed { uid: 1, pid: 2 }, Fault::Peer),
        (
            Error::FenceRefused {
                producer: process(),
                reason: crate::inbox::FenceRefusal::NoLane,
            },
            Fault::Peer,
        ),
        (
            Error::Refused {
                reason: RefuseReason::BadToken,
            },
            Fault::Refused,
        ),
        (
            Error::TooManyHostLinks {
                limit: 2,
                scope: "in all",
            },
            Fault::Refused,
        ),
        (
            Error::SegmentNotFound {
                exporter: exporter(),
                alloc,
            },
            Fault::Handle,
        ),
        (
            Error::MemoryTooSmall {
                claimed: 8,
                actual: 4,
            },
            Fault::Handle,
        ),
        (
            Error::SegmentOwnerMismatch {
                exporter: exporter(),
            },
            Fault::Handle,
        ),
        (
            Error::StaleHandle {
                alloc,
                generation,
                current: Generation::new(3),
            },
            Fault::Handle,
        ),
        (
            Error::ForeignHandle {
                exporter: exporter(),
            },
            Fault::Handle,
        ),
        (
            Error::AllocationGone {
                exporter: exporter(),
                alloc,
            },
            Fault::Handle,
        ),
        (io_error(), Fault::Local),
        (
            Error::Cuda {
                op: "cuIpcOpenMemHandle_v2",
                code: CudaError::INVALID_VALUE,
            },
            Fault::Local,
        ),
        (
            Error::UnsupportedBackend {
                kind: BackendKind::CudaLegacy,
            },
            Fault::Local,
        ),
        (
            Error::NotMapped {
                exporter: exporter(),
                alloc,
            },
            Fault::Local,
        ),
        (Error::WrittenInPlace { alloc }, Fault::Local),
        (
            Error::PoolNotImported {
                exporter: exporter(),
                pool: 4,
            },
            Fault::Local,
        ),
        (Error::DescriptorsLost { slot: 0 }, Fault::Local),
        (
            Error::DeviceNotFound {
                device: DeviceUuid([5; 16]),
                here: DeviceUuid([6; 16]),
            },
            Fault::Local,
        ),
        (
            Error::DeviceUnreachable {
                device: DeviceUuid([5; 16]),
                here: DeviceUuid([6; 16]),
            },
            Fault::Local,
        ),
        (
            Error::PoolAcrossDevices {
                device: DeviceUuid([5; 16]),
                here: DeviceUuid([6; 16]),
            },
            Fault::Local,
        ),
        (
            Error::PoolTooLarge {
                size: 6 << 30,
                limit: 5 << 30,
            },
            Fault::Local,
        ),
        (
            Error::BackendUnavailable {
                backend: "cuda",
                reason: "no driver".into(),
            },
            Fault::Local,
        ),
        (Error::EventsExhausted { limit: 4 }, Fault::Local),
        (Error::FencesExhausted { limit: 4 }, Fault::Local),
        (Error::Shm("mmap failed".into()), Fault::Local),
        (Error::NoToken { why: None }, Fault::Usage),
        (
            Error::InsecureSocketDir {
                path: PathBuf::from("/tmp/x"),
                reason: "world-writable",
            },
            Fault::Usage,
        ),
        (Error::ZeroSize, Fault::Usage),
        (
            Error::PeerInOtherPidNamespace {
                pid: None,
                why: "no pidfd",
            },
            Fault::Usage,
        ),
        (
            Error::PeerInOtherPidNamespace {
                pid: Some(9),
                why: "no pidfs",
            },
            Fault::Usage,
        ),
        (
            Error::EventAcrossPidNamespaces { peer: process() },
            Fault::Local,
        ),
        (
            Error::SegmentAcrossPidNamespaces {
                exporter: exporter(),
                alloc: AllocationId::new(3),
            },
            Fault::Local,
        ),
        (
            Error::OutOfBounds {
                offset: 4,
                len: 8,
                size: 8,
            },
            Fault::Usage,
        ),
        (Error::SharedMapping { alloc, views: 2 }, Fault::Usage),
        (Error::InPlace { alloc }, Fault::Usage),
        (
            Error::SlabFull {
                requested: 64,
                largest_free: 32,
            },
            Fault::Usage,
        ),
        (
            Error::NotBorrowable {
                ptr: 0x1000,
                reason: "not a CUDA allocation".into(),
            },
            Fault::Usage,
        ),
        (Error::Closed, Fault::Ended),
        (
            Error::Timeout {
                op: "handshake",
                after: Duration::from_secs(1),
            },
            Fault::Ended,
        ),
        // Hosts (issue 26): the TCP host link and the transfer engines.
        (
            Error::Tampered {
                what: "transport message",
            },
            Fault::Peer,
        ),
        (Error::HostKeyNotPinned { key: "00ff".into() }, Fault::Peer),
        (
            Error::HostClaimMismatch {
                claimed: process(),
                announced: process(),
            },
            Fault::Peer,
        ),
        (Error::DescriptorsOverTcp { nfds: 1 }, Fault::Usage),
        (
            Error::RegionUnsupported {
                engine: "tcp",
                reason: "device memory",
            },
            Fault::Usage,
        ),
        (Error::TransferAborted { id: 1 }, Fault::Ended),
        (
            Error::TransferPeerGone {
                id: 1,
                why: "connection closed".into(),
            },
            Fault::Ended,
        ),
        (Error::TransferCorrupt { id: 1 }, Fault::Peer),
        (
            Error::TransferSizeMismatch {
                id: 1,
                sent: 8,
                room: 4,
            },
            Fault::Peer,
        ),
        (
            Error::TransferFailed {
                id: 1,
                reason: "the communicator failed".into(),
            },
            Fault::Ended,
        ),
        (
            Error::NcclUnavailable {
                reason: "no libnccl.so.2".into(),
            },
            Fault::Local,
        ),
        (
            Error::Nccl {
                op: "ncclCommInitRankConfig",
                code: 2,
                message: "unhandled system error".into(),
            },
            Fault::Local,
        ),
        (
            Error::BadRendezvous {
                reason: "wrong length",
            },
            Fault::Peer,
        ),
        (
            Error::RendezvousElsewhere {
                named: Some(std::net::Ipv4Addr::new(10, 9, 9, 9).into()),
                link: std::net::Ipv4Addr::LOCALHOST.into(),
            },
            Fault::Peer,
        ),
    ]
}

#[test]
fn every_variant_has_the_kind_it_is_pinned_to() {
    for (error, kind) in every_variant() {
        assert_eq!(error.fault(), kind, "{error:?}");
    }
}

/// The two questions a node asks are the kinds `Peer` and `Local`, and no error is both.
#[test]
fn peer_fault_and_local_open_failure_read_the_kind() {
    let mut peer = 0;
    let mut local = 0;
    for (error, kind) in every_variant() {
        assert_eq!(error.is_peer_fault(), kind == Fault::Peer, "{error:?}");
        assert_eq!(
            error.is_local_open_failure(),
            kind == Fault::Local,
            "{error:?}"
        );
        assert!(!(error.is_peer_fault() && error.is_local_open_failure()));
        peer += usize::from(error.is_peer_fault());
        local += usize::from(error.is_local_open_failure());
    }
    // Issue 26 added six peer faults (a tampered or unpinned TCP peer, a host claim that
    // does not match, a corrupt transfer, a size disagreement, a bad rendezvous) and two
    // local failures (no NCCL, an NCCL call that failed); issue 46 three local ones (a
    // device visible but out of peer reach, pool memory of another GPU, pool memory past
    // the size the driver imports); issue 51 two (an interprocess event or a named segment
    // that a container's namespaces cannot reach).
    assert_eq!(
        (peer, local),
        (10 + 6 + 1, 12 + 2 + 3 + 2),
        "the lists as they stood before the kinds, with issue 26's host variants, issue 45's rendezvous naming another host, issue 46's device refusals and issue 51's namespace refusals"
    );
}

/// A handle that does not check is no local failure: an open that fails so drops the
/// peer's link, and the drop is not logged as a protocol breach.
#[test]
fn a_bad_handle_is_neither_local_nor_a_protocol_breach() {
    let stale = Error::StaleHandle {
        alloc: AllocationId::new(1),
        generation: Generation::new(1),
        current: Generation::new(2),
    };
    assert!(!stale.is_local_open_failure());
    assert!(!stale.is_peer_fault());
    assert_eq!(stale.fault(), Fault::Handle);
}
