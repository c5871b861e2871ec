//! How a [`CudaBackend`](super::CudaBackend) is built: [`CudaBackendBuilder`] and its defaults (some read from
//! the environment), the constructors, and what the device supports (VMM and pools
//! shareable as POSIX fds), checked against the export asked for before anything else is
//! made. The fence half of a backend is made by its fence service (`cuda/ordering.rs`).

use super::backend::CudaBackend;
use super::context::{KeepCurrent, Quiet};
use super::event::DEFAULT_EVENT_LIMIT;
use super::fence::{DEFAULT_COUNTER_SLOTS, FenceKind, fence_kind_from_env};
use super::memory::Access;
use super::ordering::{FenceSettings, Fences};
use super::pool::DEFAULT_POOL_RELEASE_THRESHOLD;
use super::result;
use super::table::OnceTable;
use super::{CudaExport, DEVICE_ENV, EXPORT_ENV, SharedContext, SharedStream, probe, unavailable};
use crate::Result;
use baton_messages::DeviceUuid;
use cudarc::driver::{CudaContext, sys};
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// How many peer processes get a lane of a backend's fence inbox unless told otherwise
/// ([`CudaBackendBuilder::inbox_lanes`]).
pub const DEFAULT_INBOX_LANES: usize = 4096;

/// How many pooled events recorded for one process may wait for their work before a
/// sender offering it a buffer waits ([`StreamOrdering::fence_room`](crate::StreamOrdering::fence_room),
/// [`CudaBackendBuilder::event_backlog`]): each such event's work waits, through the other
/// process's bridge, on the work before it, and a host loop that runs ahead of that chain
/// would run the pool dry (`docs/ORDERING.md`, "Costs and limits").
pub const DEFAULT_EVENT_BACKLOG: usize = 8;

/// The variable that sets [`CudaBackendBuilder::event_backlog`] for backends built from
/// the environment.
pub const EVENT_BACKLOG_ENV: &str = "BATON_EVENT_BACKLOG";

/// How many streams of the user's at once may write their own fences unless told
/// otherwise ([`CudaBackendBuilder::stream_slots`]).
pub const DEFAULT_STREAM_SLOTS: usize = 4;

/// The most stream slots a backend has.
pub const MAX_STREAM_SLOTS: usize = 16;

/// The variable that sets [`CudaBackendBuilder::stream_slots`] for backends built from the
/// environment.
pub const STREAM_SLOTS_ENV: &str = "BATON_CUDA_STREAM_SLOTS";

/// [`STREAM_SLOTS_ENV`]'s value (at most [`MAX_STREAM_SLOTS`]), [`DEFAULT_STREAM_SLOTS`] if
/// unset or not a number (logged).
fn stream_slots_from_env() -> usize {
    match std::env::var(STREAM_SLOTS_ENV) {
        Err(_) => DEFAULT_STREAM_SLOTS,
        Ok(v) => match v.trim().parse::<usize>() {
            Ok(n) => n.min(MAX_STREAM_SLOTS),
            Err(_) => {
                tracing::warn!(value = %v, "{STREAM_SLOTS_ENV} is not a number: using the default");
                DEFAULT_STREAM_SLOTS
            }
        },
    }
}

/// [`EVENT_BACKLOG_ENV`]'s value, [`DEFAULT_EVENT_BACKLOG`] if unset or not a positive
/// number (logged).
fn event_backlog_from_env() -> usize {
    match std::env::var(EVENT_BACKLOG_ENV) {
        Err(_) => DEFAULT_EVENT_BACKLOG,
        Ok(v) => match v.trim().parse::<usize>() {
            Ok(n) if n > 0 => n,
            _ => {
                tracing::warn!(value = %v, "{EVENT_BACKLOG_ENV} is not a positive number: using the default");
                DEFAULT_EVENT_BACKLOG
            }
        },
    }
}

/// The largest pool allocation a backend makes or opens, by default:
/// [`POOL_SIZE_LIMIT_ENV`](super::POOL_SIZE_LIMIT_ENV) in bytes (a plain number) if set and
/// valid, else [`POOL_SIZE_LIMIT`](super::POOL_SIZE_LIMIT).
pub fn pool_size_limit_from_env() -> u64 {
    match std::env::var(super::POOL_SIZE_LIMIT_ENV) {
        Err(_) => super::POOL_SIZE_LIMIT,
        Ok(v) => match v.trim().parse::<u64>() {
            Ok(n) => n,
            Err(_) => {
                tracing::warn!(value = %v, "{} is not a number of bytes: using the default", super::POOL_SIZE_LIMIT_ENV);
                super::POOL_SIZE_LIMIT
            }
        },
    }
}

/// How to make a [`CudaBackend`](super::CudaBackend): [`CudaBackend::builder`].
#[derive(Debug, Clone)]
#[must_use]
pub struct CudaBackendBuilder {
    pub(super) ordinal: usize,
    pub(super) export: CudaExport,
    pub(super) fence: FenceKind,
    pub(super) event_limit: usize,
    pub(super) counter_slots: usize,
    pub(super) inbox_lanes: usize,
    pub(super) fence_deadline: Duration,
    pub(super) event_backlog: usize,
    pub(super) stream_slots: usize,
    pub(super) pool_release_threshold: u64,
    pub(super) pool_size_limit: u64,
}

impl CudaBackendBuilder {
    /// How the backend exports what it allocates (default [`CudaExport::Legacy`]).
    pub fn export(mut self, export: CudaExport) -> Self {
        self.export = export;
        self
    }

    /// Which fences the backend records ([`CudaBackend::record_fence`], and the acquire and
    /// release fences of [`StreamOrdering::export_fence`](crate::StreamOrdering::export_fence); default [`FenceKind::Counter`]).
    /// [`FenceKind::Counter`] on a device without 64-bit stream memory operations falls
    /// back to events ([`CudaBackend::fence_kind`] says which is used).
    pub fn fence(mut self, fence: FenceKind) -> Self {
        self.fence = fence;
        self
    }

    /// At most this many interprocess events lent out at once (default
    /// [`DEFAULT_EVENT_LIMIT`]; the driver limits live IPC events too).
    pub fn event_limit(mut self, limit: usize) -> Self {
        self.event_limit = limit;
        self
    }

    /// The counter fences' slots: at most this many counter fences lent out or not yet
    /// landed at once (default [`DEFAULT_COUNTER_SLOTS`], 8 bytes of device memory each).
    /// A frame that drops thousands of leases at once records as many release fences.
    pub fn counter_slots(mut self, slots: usize) -> Self {
        self.counter_slots = slots;
        self
    }

    /// How many peer processes, over the backend's life, get a lane of its fence inbox
    /// (default [`DEFAULT_INBOX_LANES`]; 64 bytes of device memory each). Fences from peers
    /// past that are made complete before they are sent (host-synchronised, slower).
    pub fn inbox_lanes(mut self, lanes: usize) -> Self {
        self.inbox_lanes = lanes;
        self
    }

    /// How long a peer may leave the fence values it named unwritten, with no progress,
    /// before our waits on them are released and it is cut (default
    /// [`crate::inbox::fence_deadline_from_env`]: `BATON_FENCE_DEADLINE_MS`, else 10 s).
    /// Raise it for kernels that run longer than that on a leased buffer.
    pub fn fence_deadline(mut self, deadline: Duration) -> Self {
        self.fence_deadline = deadline;
        self
    }

    /// How many pooled events recorded for one peer may wait for their work before a call
    /// offering that peer a buffer waits for them ([`StreamOrdering::fence_room`](crate::StreamOrdering::fence_room); default
    /// [`DEFAULT_EVENT_BACKLOG`], or `BATON_EVENT_BACKLOG`). At least 1.
    pub fn event_backlog(mut self, backlog: usize) -> Self {
        self.event_backlog = backlog.max(1);
        self
    }

    /// How many streams of the user's at once may write the release fences of leases used
    /// on them alone themselves (`Lease::wait_on`; one driver call, where a release stream
    /// takes a mark record and two: docs/ORDERING.md, "Costs and limits"); default
    /// [`DEFAULT_STREAM_SLOTS`], or `BATON_CUDA_STREAM_SLOTS`; at most
    /// [`MAX_STREAM_SLOTS`]. Each is a slot of every peer's lane and of ours, and keeps
    /// the stream alive while bound to it. `0`: every fence takes a release stream.
    pub fn stream_slots(mut self, slots: usize) -> Self {
        self.stream_slots = slots.min(MAX_STREAM_SLOTS);
        self
    }

    /// Bytes of freed memory the backend's pool keeps reserved for later allocations when
    /// a stream synchronises (`CU_MEMPOOL_ATTR_RELEASE_THRESHOLD`; default
    /// [`DEFAULT_POOL_RELEASE_THRESHOLD`]). `0` gives everything back at every synchronise
    /// (slow allocations); `u64::MAX` never gives anything back unless
    /// [`CudaBackend::trim_pool`] is called.
    pub fn pool_release_threshold(mut self, bytes: u64) -> Self {
        self.pool_release_threshold = bytes;
        self
    }

    /// The largest stream-ordered pool allocation the backend makes or opens (default
    /// [`pool_size_limit_from_env`]: `BATON_CUDA_POOL_LIMIT`, else
    /// [`POOL_SIZE_LIMIT`](super::POOL_SIZE_LIMIT)). Larger ones are refused with
    /// [`Error::PoolTooLarge`](crate::Error::PoolTooLarge) before any driver call: on the
    /// drivers measured, importing one crashes the importing process inside the driver.
    /// Raise it only for a driver measured to import more (`bench/pool_size_driver.py`).
    pub fn pool_size_limit(mut self, bytes: u64) -> Self {
        self.pool_size_limit = bytes;
        self
    }

    /// The backend.
    ///
    /// # Errors
    /// [`Error::BackendUnavailable`](crate::Error::BackendUnavailable) if there is no driver or no such device, or if the
    /// device cannot export as asked (VMM or pools shareable as POSIX fds);
    /// [`Error::Cuda`](crate::Error::Cuda) if the context, streams or pool cannot be made.
    pub fn build(self) -> Result<CudaBackend> {
        CudaBackend::build(self)
    }
}

impl CudaBackend {
    /// A backend on device `ordinal` (of those this process sees), exporting as `export`,
    /// with its own non-blocking stream on the device's primary context, and counter fences
    /// (IPC events on a device without 64-bit stream memory operations).
    ///
    /// # Errors
    /// As [`CudaBackendBuilder::build`].
    pub fn new(ordinal: usize, export: CudaExport) -> Result<Self> {
        Self::builder(ordinal).export(export).build()
    }

    /// As [`new`](Self::new), keeping at most `event_limit` interprocess events alive.
    ///
    /// # Errors
    /// As [`new`](Self::new).
    pub fn with_event_limit(
        ordinal: usize,
        export: CudaExport,
        event_limit: usize,
    ) -> Result<Self> {
        Self::builder(ordinal)
            .export(export)
            .event_limit(event_limit)
            .build()
    }

    /// A builder for a backend on device `ordinal`, with the defaults of [`new`](Self::new).
    pub fn builder(ordinal: usize) -> CudaBackendBuilder {
        CudaBackendBuilder {
            ordinal,
            export: CudaExport::Legacy,
            fence: FenceKind::Counter,
            event_limit: DEFAULT_EVENT_LIMIT,
            counter_slots: DEFAULT_COUNTER_SLOTS,
            inbox_lanes: DEFAULT_INBOX_LANES,
            fence_deadline: crate::inbox::fence_deadline_from_env(),
            event_backlog: event_backlog_from_env(),
            stream_slots: stream_slots_from_env(),
            pool_release_threshold: DEFAULT_POOL_RELEASE_THRESHOLD,
            pool_size_limit: pool_size_limit_from_env(),
        }
    }

    /// The backend [`DEVICE_ENV`], [`EXPORT_ENV`] and [`FENCE_ENV`](super::FENCE_ENV) ask for (device 0,
    /// legacy export, counter fences by default).
    ///
    /// # Errors
    /// As [`new`](Self::new); [`Error::BackendUnavailable`](crate::Error::BackendUnavailable) for unparsable variables.
    pub fn from_env() -> Result<Self> {
        let export = CudaExport::from_env()?;
        let fence = fence_kind_from_env()?;
        let ordinal = match std::env::var(DEVICE_ENV) {
            Err(_) => 0,
            Ok(v) => v
                .trim()
                .parse()
                .map_err(|_| unavailable(format!("{DEVICE_ENV}={v:?} is not a device ordinal")))?,
        };
        Self::builder(ordinal).export(export).fence(fence).build()
    }

    pub(super) fn build(b: CudaBackendBuilder) -> Result<Self> {
        let count = probe()?;
        let ordinal = b.ordinal;
        if ordinal >= count {
            return Err(unavailable(format!(
                "there is no CUDA device {ordinal}: this process sees {count}"
            )));
        }
        // cudarc binds the context it makes (and binds it again to make streams): put the
        // caller's back afterwards, also on error (locals drop before `keep`).
        let keep = KeepCurrent::new()?;
        let ctx =
            CudaContext::new(ordinal).map_err(result::from_driver("cuDevicePrimaryCtxRetain"))?;
        let stream = ctx
            .new_stream()
            .map_err(result::from_driver("cuStreamCreate"))?;
        let side = ctx
            .new_stream()
            .map_err(result::from_driver("cuStreamCreate"))?;
        let dev = ctx.cu_device();
        let ctx: SharedContext = Arc::new(Quiet::new(ctx));
        let stream: SharedStream = Arc::new(Quiet::new(stream));
        let side: SharedStream = Arc::new(Quiet::new(side));
        drop(keep);
        // SAFETY: the driver is initialised (`probe`); `dev` comes from the context.
        let uuid = unsafe { result::device_uuid(dev) }?;
        let vmm_granularity = vmm_support(dev)?;
        if b.export == CudaExport::Vmm && vmm_granularity.is_none() {
            return Err(unavailable(format!(
                "device {ordinal} cannot share VMM memory as POSIX file descriptors: use {EXPORT_ENV}=legacy"
            )));
        }
        let pools_supported = pool_support(dev)?;
        if b.export == CudaExport::Pool && !pools_supported {
            return Err(unavailable(format!(
                "device {ordinal} cannot share memory pools as POSIX file descriptors: use {EXPORT_ENV}=legacy"
            )));
        }
        let access = Access { ctx, stream };
        let settings = FenceSettings {
            ordinal: b.ordinal,
            fence: b.fence,
            event_limit: b.event_limit,
            counter_slots: b.counter_slots,
            inbox_lanes: b.inbox_lanes,
            fence_deadline: b.fence_deadline,
            event_backlog: b.event_backlog,
            stream_slots: b.stream_slots,
        };
        let fences = Fences::new(&access, dev, DeviceUuid(uuid), side, &settings)?;
        let backend = Self {
            export: b.export,
            device: DeviceUuid(uuid),
            dev,
            vmm_granularity,
            pools_supported,
            pool_release_threshold: b.pool_release_threshold,
            pool_size_limit: b.pool_size_limit,
            access,
            counters: Arc::default(),
            opens: AtomicU64::new(0),
            pool: OnceTable::default(),
            imported_pools: OnceTable::default(),
            retired_pools: Mutex::default(),
            gather: std::sync::OnceLock::new(),
            fences,
        };
        if b.export == CudaExport::Pool {
            // Made now, so that a pool that cannot be made is an error here, not at the
            // first allocation.
            backend.export_pool()?;
        }
        Ok(backend)
    }
}

/// The VMM granularity of `dev` if it supports VMM memory shared as POSIX fds.
fn vmm_support(dev: sys::CUdevice) -> Result<Option<usize>> {
    use result::attr::{
        HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED, VIRTUAL_ADDRESS_MANAGEMENT_SUPPORTED,
    };
    // SAFETY: the driver is initialised; `dev` is a valid device.
    let vmm = unsafe { result::device_attribute(dev, VIRTUAL_ADDRESS_MANAGEMENT_SUPPORTED) }?;
    // SAFETY: as above.
    let fd = unsafe { result::device_attribute(dev, HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED) }?;
    if vmm == 0 || fd == 0 {
        return Ok(None);
    }
    // SAFETY: as above; the properties name `dev`.
    let g = unsafe { result::mem_granularity(&result::vmm_prop(dev)) }?;
    Ok(Some(g.max(1)))
}

/// Whether `dev` has memory pools that can be shared as POSIX fds.
fn pool_support(dev: sys::CUdevice) -> Result<bool> {
    use result::attr::{MEMORY_POOLS_SUPPORTED, MEMPOOL_SUPPORTED_HANDLE_TYPES};
    /// `CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR`, as a bit of the mask.
    const POSIX_FD_BIT: i32 = 1;
    // SAFETY: the driver is initialised; `dev` is a valid device.
    let pools = unsafe { result::device_attribute(dev, MEMORY_POOLS_SUPPORTED) }?;
    // SAFETY: as above. A driver that does not know the attribute supports no such pools.
    let types =
        unsafe { result::device_attribute(dev, MEMPOOL_SUPPORTED_HANDLE_TYPES) }.unwrap_or(0);
    Ok(pools != 0 && types & POSIX_FD_BIT != 0)
}
