//! The calls that start a forward ([`Peer::forward`], [`Lease::forward_to`]; see
//! [`relay`](crate::relay) for the design and `link/forward.rs` for the links' side), and
//! what a forward to another host shares with the links that carry it: the pin that keeps
//! the lease a copy reads from ([`LeasePin`]) and the deadlines of copies.

use crate::buffer::{Element, IncomingLease, Lease};
use crate::error::ActorError;
use crate::link_ref::{AskForward, ForwardCopy, LinkRef};
use crate::node_core::Peer;
use baton_ipc::transfer::nccl::NcclConfig;
use baton_ipc::{ExportedFence, Imported, MemPtr};
use baton_messages::LeaseId;
use futures_util::future::Either;
use std::any::Any;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::oneshot;

/// The slowest a copy may move and still land by its deadline: a copy of `n` bytes has
/// the heartbeat deadline plus `n / FLOOR_BYTES_PER_SEC` seconds.
pub(crate) const FLOOR_BYTES_PER_SEC: u64 = 16 << 20;

/// How long a copy of `len` bytes may take (see [`FLOOR_BYTES_PER_SEC`]).
pub(crate) fn copy_deadline(heartbeat: Duration, len: usize) -> Duration {
    heartbeat + Duration::from_secs(len as u64 / FLOOR_BYTES_PER_SEC)
}

/// Keeps one of our leases on another process's buffer from going back to its exporter
/// while a copy to another host reads from our mapping of it: if the lease's guard drops
/// meanwhile, its `Release` waits (`LinkState::defer_release`) until the last pin drops —
/// which a send does only once its engine no longer touches the memory. So the exporter
/// counts the lease, and neither writes nor frees the buffer, while the bytes are read.
pub(crate) struct LeasePin {
    link: LinkRef,
    lease: LeaseId,
}

impl LeasePin {
    /// Pins `lease`, held over `link` (the exporter's); its guard must be alive.
    pub(crate) fn new(link: LinkRef, lease: LeaseId) -> Self {
        link.state.pin(lease);
        Self { link, lease }
    }
}

impl Drop for LeasePin {
    fn drop(&mut self) {
        let Some(release) = self.link.state.unpin(self.lease) else {
            return;
        };
        tracing::debug!(lease = %self.lease, "the copies of a dropped lease are done: its release goes");
        if self.link.is_alive() {
            self.link.do_send(release);
        } else if let Some(pending) = release.pending {
            // The exporter is gone; the mapping still must outlive our work on it.
            pending.wait();
        }
    }
}

/// How long a forward to another host may wait for its copy to land: the receiver's own
/// deadline for it ([`copy_deadline`], with the rendezvous of a first device copy), and a
/// heartbeat deadline more for its answer.
pub(crate) fn forward_deadline(heartbeat: Duration, rendezvous: Duration, len: usize) -> Duration {
    copy_deadline(heartbeat * 2 + rendezvous, len)
}

impl<T: Element> Lease<T> {
    /// Passes this buffer on to `to`, zero-copy: the exporter leases it to `to` directly
    /// (its ledger counts `to` as a holder), and this node relays the offer, which arrives
    /// in `to`'s inbox ([`Node::set_inbox`](crate::Node::set_inbox)) as an
    /// [`Offered`](crate::Offered) from this process. Returns the lease id `to` sees.
    /// To a peer on another host, a copy instead (see [`Peer::forward`]).
    ///
    /// This lease stays this node's to drop: the forwarded one is independent of it.
    /// See [`Peer::forward`] and `docs/FORWARDING.md`.
    ///
    /// # Errors
    /// As [`Peer::forward`].
    pub fn forward_to(
        &self,
        to: &Peer,
    ) -> impl Future<Output = Result<LeaseId, ActorError>> + 'static {
        to.forward(self)
    }
}

impl Peer {
    /// Forwards a buffer this node leased from another process to this peer (A → B → C,
    /// zero-copy): asks the exporter, over the link the lease came by, to grant this peer
    /// a lease of its own, and passes the exporter's offer on. The peer finds it in its
    /// inbox ([`Node::set_inbox`](crate::Node::set_inbox)); the exporter's lease table
    /// lists it as a holder ([`BufferLeases::forwarded`](crate::BufferLeases::forwarded))
    /// until it gives the buffer back or dies — also if this node dies first. Returns the
    /// lease id the peer sees (this node's name for the forwarded lease).
    ///
    /// **To a peer on another host** (a host link, [`PeerInfo::host`](baton_ipc::PeerInfo::host)),
    /// the buffer cannot be mapped there: it arrives as a *copy* in memory the peer's node
    /// owns, in its inbox as from this process, moved by the engine that moves this node's
    /// own buffers (TCP for host memory, NCCL for device memory) and read from this node's
    /// mapping of the lease. The lease stays held meanwhile — if it is dropped before the
    /// bytes landed, its release to the exporter waits until the engine no longer reads
    /// them — and the future resolves once the peer gave the copy's lease back, i.e. once
    /// the bytes landed (device memory: after the work queued on the buffer before its
    /// offer to us, as for our own buffers). A lease that is itself a copy from another
    /// host is forwarded the same way. Such a copy cannot be forwarded zero-copy to a
    /// peer of this host: its exporter sends no handle over a host link, and refuses
    /// ([`ActorError::ForwardRefused`]); send the copy on as a buffer instead.
    ///
    /// # Errors
    /// [`ActorError::Orphaned`] if the exporter is gone; [`ActorError::LinkClosed`] if a
    /// link goes down first; [`ActorError::ForwardRefused`] if the exporter refused (the
    /// lease is back, the peer is the exporter itself, a limit) — or, to another host, if
    /// the lease is writable (a [`LeaseMut`](crate::LeaseMut): the peer would write a
    /// copy) or the peer refused the copy or it did not land; [`ActorError::Timeout`]
    /// after the heartbeat deadline (to another host: the copy's deadline, from its size).
    pub fn forward<T: Element>(
        &self,
        lease: &Lease<T>,
    ) -> impl Future<Output = Result<LeaseId, ActorError>> + 'static {
        let incoming = lease.incoming();
        if self.info.host().is_some() {
            return Either::Left(self.forward_copy(incoming));
        }
        let upstream = incoming.link.clone();
        let exporter = upstream.peer();
        let asked = if !upstream.is_alive() {
            Err(ActorError::Orphaned { exporter })
        } else if !self.link.is_alive() {
            Err(ActorError::link_closed(self.process()))
        } else if self.process() == exporter {
            Err(ActorError::ForwardRefused {
                reason: format!("{exporter} is the buffer's exporter: it has the buffer"),
            })
        } else {
            let (tx, rx) = oneshot::channel();
            upstream.do_send(AskForward {
                lease: incoming.lease,
                to: self.process(),
                downstream: self.link.clone(),
                reply: tx,
            });
            Ok(rx)
        };
        let after = self.link_deadline;
        Either::Right(async move {
            let rx = asked?;
            match tokio::time::timeout(after, rx).await {
                Ok(Ok(result)) => result,
                Ok(Err(_)) => Err(ActorError::link_closed(exporter)),
                Err(_) => Err(ActorError::Timeout {
                    op: "forward",
                    after,
                }),
            }
        })
    }

    /// [`forward`](Self::forward) to a peer on another host: a copy, read from our view
    /// of the lease, pinned until the engine lets go of it (see `link/copy.rs`).
    fn forward_copy(
        &self,
        incoming: &IncomingLease,
    ) -> impl Future<Output = Result<LeaseId, ActorError>> + 'static {
        let to = self.process();
        let prepared = self.prepare_copy(incoming);
        let link = self.link.clone();
        let device = matches!(incoming.imported().ptr(), MemPtr::Device(_));
        let rendezvous = if device {
            NcclConfig::default().rendezvous_timeout
        } else {
            Duration::ZERO
        };
        let after = forward_deadline(self.link_deadline, rendezvous, incoming.imported().len());
        let forwarded = async move {
            let (view, keep, fence) = prepared?;
            let fence = match (device, fence) {
                // A host copy starts at once: the work before it is waited for here.
                (false, Some(fence)) => {
                    let waited = tokio::task::spawn_blocking(move || fence.synchronize()).await;
                    waited.map_err(|_| ActorError::link_closed(to))??;
                    None
                }
                (_, fence) => fence,
            };
            let (reply, rx) = oneshot::channel();
            link.do_send(ForwardCopy {
                view,
                keep,
                fence,
                reply,
            });
            rx.await.unwrap_or(Err(ActorError::link_closed(to)))
        };
        async move {
            tokio::time::timeout(after, forwarded)
                .await
                .unwrap_or(Err(ActorError::Timeout {
                    op: "forward",
                    after,
                }))
        }
    }

    /// What a copy of `incoming` to another host reads and keeps: a view of its bytes of
    /// our own, the pin on our lease (or, for a copy that landed here, the buffer), and
    /// the fence its send follows. Done while the lease is alive (its `Release` cannot
    /// have gone before the pin).
    #[allow(clippy::type_complexity)]
    fn prepare_copy(
        &self,
        incoming: &IncomingLease,
    ) -> Result<
        (
            Imported,
            Box<dyn Any + Send + Sync>,
            Option<Arc<dyn ExportedFence>>,
        ),
        ActorError,
    > {
        if incoming.held.is_writable() {
            return Err(ActorError::ForwardRefused {
                reason: "a writable lease does not cross hosts: the receiver would get a copy to write (send the result back as a buffer of its own)".into(),
            });
        }
        if !self.link.is_alive() {
            return Err(ActorError::link_closed(self.process()));
        }
        let view = incoming.live()?;
        let me = baton_ipc::process::current();
        let fence = match incoming.order.acquire() {
            Some((producer, fence)) => view
                .backend()
                .ordering()
                .relay_fence(producer, fence, &me)?,
            None => None,
        };
        let keep: Box<dyn Any + Send + Sync> = match &incoming.copy {
            Some(cell) => Box::new(Arc::clone(cell)),
            None => Box::new(LeasePin::new(incoming.link.clone(), incoming.lease)),
        };
        Ok((view.another_view()?, keep, fence))
    }
}
