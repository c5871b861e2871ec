//! The NCCL calls the engine makes, as a trait: [`Nccl`] is implemented by the library
//! loaded at run time (`super::library`) and, in tests, by a fake that records calls and
//! can hold a transfer forever or raise an asynchronous error.

use crate::transfer::Region;
use crate::{Error, MemPtr, Result};
use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV6};

/// The device address of `region`: NCCL moves device memory only.
///
/// # Errors
/// [`Error::RegionUnsupported`] for host memory.
pub fn device_addr(region: &Region) -> Result<u64> {
    match region.ptr {
        MemPtr::Device(addr) => Ok(addr),
        MemPtr::Host(_) => Err(Error::RegionUnsupported {
            engine: "nccl",
            reason: "NCCL moves device memory; use the TCP engine for host memory",
        }),
    }
}

/// A rank in a 2-rank communicator: 0 (the lower identity) or 1.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Rank(pub u8);

impl Rank {
    /// The other rank of the pair.
    pub fn other(self) -> Rank {
        Rank(1 - self.0)
    }
}

/// `ncclUniqueId`: the 128 opaque bytes one side makes (`ncclGetUniqueId`) and both pass
/// to their init. It names the maker's bootstrap socket: carry it only over an
/// authenticated control plane.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct UniqueId(pub [u8; 128]);

impl fmt::Debug for UniqueId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Never logged: it is the way into the maker's bootstrap.
        f.write_str("UniqueId(..)")
    }
}

/// Where NCCL puts the bootstrap address in an `ncclUniqueId`: `struct ncclBootstrapHandle
/// { uint64_t magic; union ncclSocketAddress addr; }` (NCCL 2.12 and later, 2.19 to 2.28
/// checked), the address a `sockaddr_in` or `sockaddr_in6` in this host's byte order.
const ADDR_AT: usize = 8;

impl UniqueId {
    /// The address of the bootstrap socket the id's maker listens on — where a rank that
    /// initialises a communicator with this id connects first (`bootstrapInit` of NCCL's
    /// `bootstrap.cc`); `None` if the id holds no IPv4 or IPv6 socket address there.
    pub fn bootstrap_addr(&self) -> Option<SocketAddr> {
        let b = &self.0[ADDR_AT..];
        let family = u16::from_ne_bytes([b[0], b[1]]);
        let port = u16::from_be_bytes([b[2], b[3]]);
        if family == rustix::net::AddressFamily::INET.as_raw() {
            let ip = Ipv4Addr::new(b[4], b[5], b[6], b[7]);
            Some(SocketAddr::new(IpAddr::V4(ip), port))
        } else if family == rustix::net::AddressFamily::INET6.as_raw() {
            let word = |at: usize| u32::from_be_bytes(b[at..at + 4].try_into().expect("4 bytes"));
            let ip: [u8; 16] = b[8..24].try_into().expect("16 bytes");
            let scope = u32::from_ne_bytes(b[24..28].try_into().expect("4 bytes"));
            let v6 = SocketAddrV6::new(Ipv6Addr::from(ip), port, word(4), scope);
            Some(SocketAddr::V6(v6))
        } else {
            None
        }
    }

    /// An id laid out as NCCL lays its own: `magic`, then `addr` as a socket address
    /// (for fakes and tests: an id NCCL would read as naming `addr`).
    #[cfg(any(test, feature = "testing"))]
    pub fn naming(magic: u64, addr: SocketAddr) -> UniqueId {
        let mut uid = [0u8; 128];
        uid[..ADDR_AT].copy_from_slice(&magic.to_le_bytes());
        let b = &mut uid[ADDR_AT..];
        b[2..4].copy_from_slice(&addr.port().to_be_bytes());
        match addr {
            SocketAddr::V4(v4) => {
                b[..2].copy_from_slice(&rustix::net::AddressFamily::INET.as_raw().to_ne_bytes());
                b[4..8].copy_from_slice(&v4.ip().octets());
            }
            SocketAddr::V6(v6) => {
                b[..2].copy_from_slice(&rustix::net::AddressFamily::INET6.as_raw().to_ne_bytes());
                b[4..8].copy_from_slice(&v6.flowinfo().to_be_bytes());
                b[8..24].copy_from_slice(&v6.ip().octets());
                b[24..28].copy_from_slice(&v6.scope_id().to_ne_bytes());
            }
        }
        UniqueId(uid)
    }
}

/// A communicator the implementation made (`ncclComm_t`, or a fake's number).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CommHandle(pub usize);

/// A send or receive the implementation launched.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct OpHandle(pub u64);

/// Where an asynchronous thing is.
#[derive(Debug)]
pub enum Progress {
    /// Still going (`ncclInProgress`, an event not yet reached).
    Pending,
    /// Completed.
    Done,
    /// Failed; the communicator must be aborted.
    Failed(Error),
}

/// The NCCL calls of the engine. Every call returns at once (communicators are made
/// non-blocking): waits are the engine's polls.
pub trait Nccl: Send + Sync + fmt::Debug {
    /// `ncclGetUniqueId`.
    ///
    /// # Errors
    /// [`Error::Nccl`](crate::Error::Nccl).
    fn unique_id(&self) -> Result<UniqueId>;
    /// `ncclCommInitRankConfig` for 2 ranks, non-blocking: returns a communicator whose
    /// init goes on; [`comm_progress`](Self::comm_progress) says when it is ready.
    ///
    /// # Errors
    /// [`Error::Nccl`](crate::Error::Nccl).
    fn init(&self, uid: &UniqueId, rank: Rank) -> Result<CommHandle>;
    /// `ncclCommGetAsyncError`: whether the init (or an enqueue) is in progress, done, or
    /// the communicator failed.
    fn comm_progress(&self, comm: CommHandle) -> Progress;
    /// `ncclSend` of `src` to the other rank, on the communicator's stream.
    ///
    /// # Errors
    /// [`Error::Nccl`](crate::Error::Nccl); the communicator must then be aborted.
    ///
    /// # Safety
    /// `src` is device memory that stays valid until the operation is done or its
    /// communicator aborted.
    unsafe fn send(&self, comm: CommHandle, src: Region, to: Rank) -> Result<OpHandle>;
    /// `ncclRecv` into `dst` from the other rank, on the communicator's stream.
    ///
    /// # Errors
    /// As [`send`](Self::send).
    ///
    /// # Safety
    /// As [`send`](Self::send), for `dst`.
    unsafe fn recv(&self, comm: CommHandle, dst: Region, from: Rank) -> Result<OpHandle>;
    /// Whether the operation completed on the device.
    fn op_progress(&self, op: OpHandle) -> Progress;
    /// Forgets an operation (done, or its communicator aborted).
    fn release_op(&self, op: OpHandle);
    /// `ncclCommAbort`: stops the communicator's operations and frees it. Returns once
    /// its kernels no longer run, so no memory of its operations is touched after.
    /// Never `ncclCommDestroy` on a communicator that may be stuck: that waits for it.
    fn abort(&self, comm: CommHandle);
}
