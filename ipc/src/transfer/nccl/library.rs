//! NCCL loaded at run time (the file [`NCCL_LIB_ENV`] names if set, else `libnccl.so.2`,
//! else `libnccl.so` by the loader's search path), its entry points resolved
//! by name and declared to return the raw `ncclResult_t` integer — the way
//! `cuda/driver.rs` loads the CUDA driver, and for the same reason: a Rust enum of the
//! result codes (cudarc's `nccl::sys::ncclResult_t`) would be undefined behaviour the
//! moment a newer NCCL returned a code the bindings lack (2.30 added `ncclTimeout`).
//! Without the library, or with one older than 2.19 (the config layout used here is 2.17's;
//! 2.19 is the first whose aborts may run concurrently, as the engine's do), every call
//! returns
//! [`Error::NcclUnavailable`](crate::Error::NcclUnavailable), and builds never need NCCL.
//!
//! Before the library is loaded the process's `NCCL_NVLS_ENABLE` is set to `0` if unset:
//! NVLink SHARP (multicast) stays off, as on the machines Baton runs on, and Baton never
//! calls `cuMulticastCreate`. Set it in the launcher's environment to choose otherwise.
//!
//! # Safety
//!
//! Each field of [`Api`] has the C prototype of its symbol in `nccl.h` (2.17 through
//! 2.30), with `ncclResult_t` and `ncclDataType_t` as `c_int` (C enums whose values fit in
//! an `int`: same size and calling convention on the Linux ABIs NCCL ships for),
//! `ncclComm_t` and `cudaStream_t` as pointers, and `ncclUniqueId` as a `#[repr(C)]`
//! struct of 128 bytes passed by value as C does. [`Config`] is `ncclConfig_t`'s 2.17
//! layout, announced by its `size`, `magic` and `version` header, which later versions
//! read as such (fields they added keep their defaults). The library is never unloaded
//! (it lives in a `static`), so the function pointers never dangle. Every NCCL call that
//! touches the device runs with this engine's CUDA context bound on the calling thread.

use super::api::{CommHandle, Nccl, OpHandle, Progress, Rank, UniqueId};
use crate::transfer::Region;
use crate::{Error, Result};
use cudarc::driver::{CudaContext, CudaEvent, CudaStream};
use std::collections::HashMap;
use std::ffi::{CStr, c_char, c_int, c_uint, c_void};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};

/// `ncclResult_t`: `0` is `ncclSuccess`, `7` is `ncclInProgress`.
type RawResult = c_int;
const SUCCESS: RawResult = 0;
const IN_PROGRESS: RawResult = 7;
/// `ncclUint8`.
const UINT8: c_int = 1;
/// The oldest NCCL whose `ncclConfig_t` starts with the layout of [`Config`].
const CONFIG_VERSION: c_int = 21700;
/// The oldest NCCL the engine runs on: 2.19, the first whose `ncclCommAbort` may run on
/// several threads at once (NVIDIA/nccl #992), as the engine's aborts do.
const MIN_VERSION: c_int = 21900;

type RawComm = *mut c_void;
type RawStream = *mut c_void;

/// `ncclUniqueId`.
#[repr(C)]
#[derive(Clone, Copy)]
struct RawUniqueId {
    internal: [c_char; 128],
}

/// `ncclConfig_t` as NCCL 2.17 lays it out (`NCCL_CONFIG_INITIALIZER` fills it).
#[repr(C)]
struct Config {
    size: usize,
    magic: c_uint,
    version: c_uint,
    blocking: c_int,
    cga_cluster_size: c_int,
    min_ctas: c_int,
    max_ctas: c_int,
    net_name: *const c_char,
    split_share: c_int,
}

impl Config {
    /// `NCCL_CONFIG_INITIALIZER` with `blocking = 0`: init and enqueue return at once
    /// (`ncclInProgress`) so that a stuck init can be aborted.
    fn non_blocking() -> Self {
        // NCCL_CONFIG_UNDEF_INT: NCCL's default for the field.
        const UNDEF: c_int = c_int::MIN;
        Config {
            size: size_of::<Config>(),
            magic: 0xcafe_beef,
            version: CONFIG_VERSION as c_uint,
            blocking: 0,
            cga_cluster_size: UNDEF,
            min_ctas: UNDEF,
            max_ctas: UNDEF,
            net_name: std::ptr::null(),
            split_share: UNDEF,
        }
    }
}

/// `ncclSend`/`ncclRecv`: buffer, count, data type, peer rank, communicator, stream.
type PointToPoint =
    unsafe extern "C" fn(*mut c_void, usize, c_int, c_int, RawComm, RawStream) -> RawResult;

/// The entry points, by name.
struct Api {
    get_version: unsafe extern "C" fn(*mut c_int) -> RawResult,
    get_unique_id: unsafe extern "C" fn(*mut RawUniqueId) -> RawResult,
    comm_init_rank_config:
        unsafe extern "C" fn(*mut RawComm, c_int, RawUniqueId, c_int, *mut Config) -> RawResult,
    /// `ncclSend`, whose buffer is `const void*`: the same in the ABI as `void*`.
    send: PointToPoint,
    /// `ncclRecv`.
    recv: PointToPoint,
    comm_get_async_error: unsafe extern "C" fn(RawComm, *mut c_int) -> RawResult,
    comm_abort: unsafe extern "C" fn(RawComm) -> RawResult,
    get_error_string: unsafe extern "C" fn(RawResult) -> *const c_char,
}

/// The library's file names, most specific first.
const LIBRARY_NAMES: [&str; 2] = ["libnccl.so.2", "libnccl.so"];

/// The environment variable that names the NCCL library to load (a path, e.g. the
/// `lib/libnccl.so.2` of the `nvidia-nccl-cu12` wheel); when set, only that file is tried.
pub const NCCL_LIB_ENV: &str = "BATON_NCCL_LIB";

fn load_api() -> std::result::Result<Api, String> {
    if std::env::var_os("NCCL_NVLS_ENABLE").is_none() {
        // SAFETY: edition 2024 marks `set_var` unsafe because another thread may read the
        // environment at the same moment (a C `getenv`). This runs once, before NCCL (the
        // reader that matters) is loaded; a launcher that must rule out any race sets the
        // variable itself (module docs), and then this line does not run.
        unsafe { std::env::set_var("NCCL_NVLS_ENABLE", "0") };
    }
    let mut tried = Vec::new();
    let named = std::env::var_os(NCCL_LIB_ENV).filter(|p| !p.is_empty());
    let names: Vec<std::ffi::OsString> = match named {
        Some(path) => vec![path],
        None => LIBRARY_NAMES.iter().map(Into::into).collect(),
    };
    let lib = names
        .iter()
        .find_map(|name| {
            // SAFETY: loading libnccl runs its initialisers, which NCCL supports in any
            // process (it is loaded by every framework that uses it the same way).
            match unsafe { libloading::Library::new(name) } {
                Ok(lib) => Some(lib),
                Err(e) => {
                    tried.push(format!("{}: {e}", name.to_string_lossy()));
                    None
                }
            }
        })
        .ok_or_else(|| {
            format!(
                "NCCL was not found ({}): install NCCL 2.19 or newer (e.g. the nvidia-nccl-cu12 \
                 wheel) and put its lib directory on LD_LIBRARY_PATH, or name the library's \
                 path in {NCCL_LIB_ENV}",
                tried.join("; ")
            )
        })?;
    // The library stays loaded for the process's life, so its symbols never dangle.
    let lib: &'static libloading::Library = Box::leak(Box::new(lib));
    macro_rules! sym {
        ($name:literal) => {
            // SAFETY: the field's type is the symbol's C prototype (module docs); the
            // pointer is copied out of a library that is never unloaded.
            unsafe {
                *lib.get($name.as_bytes()).map_err(|_| {
                    format!(
                        "the NCCL library has no {}: install NCCL 2.19 or newer",
                        $name
                    )
                })?
            }
        };
    }
    let api = Api {
        get_version: sym!("ncclGetVersion"),
        get_unique_id: sym!("ncclGetUniqueId"),
        comm_init_rank_config: sym!("ncclCommInitRankConfig"),
        send: sym!("ncclSend"),
        recv: sym!("ncclRecv"),
        comm_get_async_error: sym!("ncclCommGetAsyncError"),
        comm_abort: sym!("ncclCommAbort"),
        get_error_string: sym!("ncclGetErrorString"),
    };
    let mut version = 0;
    // SAFETY: writes one int.
    let r = unsafe { (api.get_version)(&mut version) };
    if r != SUCCESS || version < MIN_VERSION {
        return Err(format!(
            "the NCCL library is version {version} (ncclGetVersion returned {r}): Baton needs \
             2.19 (21900) or newer"
        ));
    }
    Ok(api)
}

fn api() -> Result<&'static Api> {
    static API: OnceLock<std::result::Result<Api, String>> = OnceLock::new();
    API.get_or_init(load_api)
        .as_ref()
        .map_err(|reason| Error::NcclUnavailable {
            reason: reason.clone(),
        })
}

/// Whether NCCL can be used in this process (loads it once), and if not, why.
///
/// # Errors
/// [`Error::NcclUnavailable`].
pub fn available() -> Result<i32> {
    let api = api()?;
    let mut version = 0;
    // SAFETY: writes one int.
    check(api, "ncclGetVersion", unsafe {
        (api.get_version)(&mut version)
    })?;
    Ok(version)
}

fn check(api: &Api, op: &'static str, code: RawResult) -> Result<()> {
    if code == SUCCESS {
        return Ok(());
    }
    Err(nccl_error(api, op, code))
}

fn nccl_error(api: &Api, op: &'static str, code: RawResult) -> Error {
    // SAFETY: ncclGetErrorString returns a static string for any code (known or not).
    let text = unsafe { (api.get_error_string)(code) };
    let message = if text.is_null() {
        String::new()
    } else {
        // SAFETY: a NUL-terminated static string (above).
        unsafe { CStr::from_ptr(text) }
            .to_string_lossy()
            .into_owned()
    };
    Error::Nccl { op, code, message }
}

/// One communicator: its NCCL handle and the stream its operations run on.
struct Comm {
    raw: RawComm,
    stream: Arc<CudaStream>,
}

/// Where an operation is. A non-blocking communicator takes one enqueue at a time: while
/// one is in progress (`ncclInProgress`, until `ncclCommGetAsyncError` says done), later
/// operations of that communicator wait here, in order, and are enqueued by the polls.
enum OpState {
    /// Not yet given to NCCL.
    Waiting {
        ptr: u64,
        len: usize,
        peer: Rank,
        send: bool,
    },
    /// NCCL is still enqueueing it.
    Enqueueing,
    /// Enqueued; the event is recorded after it on the communicator's stream.
    Enqueued(CudaEvent),
}

/// One operation of a communicator.
struct Op {
    comm: CommHandle,
    state: OpState,
}

#[derive(Default)]
struct Tables {
    comms: HashMap<usize, Comm>,
    ops: HashMap<u64, Op>,
}

/// NCCL from the library, on one device (`ctx`): each communicator gets a stream of its
/// own, so a stuck one holds up no other.
pub struct LibraryNccl {
    api: &'static Api,
    ctx: Arc<CudaContext>,
    tables: Mutex<Tables>,
    next_op: AtomicU64,
}

impl std::fmt::Debug for LibraryNccl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LibraryNccl")
            .field("device", &self.ctx.ordinal())
            .finish_non_exhaustive()
    }
}

// SAFETY: the raw communicator pointers in `tables` are only used under its mutex or after
// being taken out of it (NCCL allows a communicator to be used from any thread, one call at
// a time); cudarc's context, stream and event types are `Send + Sync`.
unsafe impl Send for LibraryNccl {}
// SAFETY: as above.
unsafe impl Sync for LibraryNccl {}

impl LibraryNccl {
    /// Loads NCCL (once per process) for the device of `ctx`.
    ///
    /// # Errors
    /// [`Error::NcclUnavailable`].
    pub fn new(ctx: Arc<CudaContext>) -> Result<Self> {
        Ok(Self {
            api: api()?,
            ctx,
            tables: Mutex::new(Tables::default()),
            next_op: AtomicU64::new(1),
        })
    }

    fn bind(&self) -> Result<()> {
        self.ctx.bind_to_thread().map_err(|e| Error::Nccl {
            op: "cuCtxSetCurrent",
            code: -1,
            message: e.to_string(),
        })
    }

    fn tables(&self) -> std::sync::MutexGuard<'_, Tables> {
        self.tables.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn progress(&self, raw: RawComm) -> Progress {
        let mut state = SUCCESS;
        // SAFETY: `raw` is a live communicator (the caller holds the tables' lock, and
        // only `abort` removes it).
        let r = unsafe { (self.api.comm_get_async_error)(raw, &mut state) };
        match (r, state) {
            (SUCCESS, SUCCESS) => Progress::Done,
            (SUCCESS, IN_PROGRESS) => Progress::Pending,
            (SUCCESS, code) => {
                Progress::Failed(nccl_error(self.api, "ncclCommGetAsyncError", code))
            }
            (r, _) => Progress::Failed(nccl_error(self.api, "ncclCommGetAsyncError", r)),
        }
    }

    /// Enqueues the oldest operation of `comm` not yet enqueued, if NCCL is done with the
    /// previous one: `ncclSend`/`ncclRecv` on the communicator's stream, then an event.
    ///
    /// # Safety
    /// The operations' memory is valid until they end (the promise of [`Nccl::send`]).
    unsafe fn advance(&self, tables: &mut Tables, comm: CommHandle) -> Result<()> {
        let Some(c) = tables.comms.get(&comm.0) else {
            return Ok(());
        };
        let mut mine: Vec<u64> = (tables.ops.iter())
            .filter(|(_, o)| o.comm == comm && !matches!(o.state, OpState::Enqueued(_)))
            .map(|(id, _)| *id)
            .collect();
        mine.sort_unstable();
        let Some(&first) = mine.first() else {
            return Ok(());
        };
        let op = tables.ops.get_mut(&first).expect("listed");
        if matches!(op.state, OpState::Enqueueing) {
            match self.progress(c.raw) {
                Progress::Done => op.state = OpState::Enqueued(self.record(&c.stream)?),
                Progress::Pending => return Ok(()),
                Progress::Failed(e) => return Err(e),
            }
            // SAFETY: the caller's promise.
            return unsafe { self.advance(tables, comm) };
        }
        let OpState::Waiting {
            ptr,
            len,
            peer,
            send,
        } = op.state
        else {
            unreachable!("neither enqueued nor enqueueing")
        };
        let stream = c.stream.cu_stream() as RawStream;
        let (name, call) = if send {
            ("ncclSend", self.api.send)
        } else {
            ("ncclRecv", self.api.recv)
        };
        // SAFETY: `ptr` is device memory valid until the operation ends (the caller's
        // promise; ncclSend only reads it); `c.raw` is live (held under the lock); the
        // stream is the communicator's.
        let code = unsafe {
            call(
                ptr as *mut c_void,
                len,
                UINT8,
                c_int::from(peer.0),
                c.raw,
                stream,
            )
        };
        match code {
            SUCCESS => {
                op.state = OpState::Enqueued(self.record(&c.stream)?);
                // SAFETY: the caller's promise.
                unsafe { self.advance(tables, comm) }
            }
            IN_PROGRESS => {
                op.state = OpState::Enqueueing;
                Ok(())
            }
            code => Err(nccl_error(self.api, name, code)),
        }
    }

    /// Queues an operation and enqueues what NCCL can take now.
    ///
    /// # Safety
    /// As [`Nccl::send`].
    unsafe fn launch(
        &self,
        comm: CommHandle,
        region: Region,
        peer: Rank,
        send: bool,
    ) -> Result<OpHandle> {
        let ptr = super::api::device_addr(&region)?;
        self.bind()?;
        let mut tables = self.tables();
        if !tables.comms.contains_key(&comm.0) {
            return Err(Error::Nccl {
                op: if send { "ncclSend" } else { "ncclRecv" },
                code: 4,
                message: "communicator already aborted".into(),
            });
        }
        let id = self.next_op.fetch_add(1, Ordering::Relaxed);
        let state = OpState::Waiting {
            ptr,
            len: region.len,
            peer,
            send,
        };
        tables.ops.insert(id, Op { comm, state });
        // SAFETY: the caller's promise.
        unsafe { self.advance(&mut tables, comm) }?;
        Ok(OpHandle(id))
    }

    fn record(&self, stream: &CudaStream) -> Result<CudaEvent> {
        stream.record_event(None).map_err(|e| Error::Nccl {
            op: "cuEventRecord",
            code: -1,
            message: e.to_string(),
        })
    }
}

impl Nccl for LibraryNccl {
    fn unique_id(&self) -> Result<UniqueId> {
        let mut raw = RawUniqueId { internal: [0; 128] };
        // SAFETY: writes 128 bytes into `raw`.
        check(self.api, "ncclGetUniqueId", unsafe {
            (self.api.get_unique_id)(&mut raw)
        })?;
        Ok(UniqueId(raw.internal.map(|c| c as u8)))
    }

    fn init(&self, uid: &UniqueId, rank: Rank) -> Result<CommHandle> {
        self.bind()?;
        let stream = self.ctx.new_stream().map_err(|e| Error::Nccl {
            op: "cuStreamCreate",
            code: -1,
            message: e.to_string(),
        })?;
        let mut raw: RawComm = std::ptr::null_mut();
        let mut config = Config::non_blocking();
        let id = RawUniqueId {
            internal: uid.0.map(|b| b as c_char),
        };
        // SAFETY: `raw` and `config` are valid for the call; NCCL copies the config.
        let code = unsafe {
            (self.api.comm_init_rank_config)(&mut raw, 2, id, c_int::from(rank.0), &mut config)
        };
        if (code != SUCCESS && code != IN_PROGRESS) || raw.is_null() {
            return Err(nccl_error(self.api, "ncclCommInitRankConfig", code));
        }
        self.tables()
            .comms
            .insert(raw as usize, Comm { raw, stream });
        Ok(CommHandle(raw as usize))
    }

    fn comm_progress(&self, comm: CommHandle) -> Progress {
        let tables = self.tables();
        match tables.comms.get(&comm.0) {
            Some(c) => self.progress(c.raw),
            None => Progress::Failed(Error::Nccl {
                op: "ncclCommGetAsyncError",
                code: 4,
                message: "communicator already aborted".into(),
            }),
        }
    }

    unsafe fn send(&self, comm: CommHandle, src: Region, to: Rank) -> Result<OpHandle> {
        // SAFETY: the caller's promise.
        unsafe { self.launch(comm, src, to, true) }
    }

    unsafe fn recv(&self, comm: CommHandle, dst: Region, from: Rank) -> Result<OpHandle> {
        // SAFETY: the caller's promise.
        unsafe { self.launch(comm, dst, from, false) }
    }

    fn op_progress(&self, op: OpHandle) -> Progress {
        if let Err(e) = self.bind() {
            return Progress::Failed(e);
        }
        let mut tables = self.tables();
        let Some(comm) = tables.ops.get(&op.0).map(|o| o.comm) else {
            return Progress::Failed(Error::Nccl {
                op: "ncclSend",
                code: 4,
                message: "operation already released".into(),
            });
        };
        // SAFETY: every queued operation's memory is valid until it ends (the promise of
        // `send`/`recv`, kept by the engine).
        if let Err(e) = unsafe { self.advance(&mut tables, comm) } {
            return Progress::Failed(e);
        }
        match &tables.ops[&op.0].state {
            OpState::Enqueued(ev) => match ev.try_is_complete() {
                Ok(true) => Progress::Done,
                Ok(false) => Progress::Pending,
                Err(e) => Progress::Failed(Error::Nccl {
                    op: "cuEventQuery",
                    code: -1,
                    message: e.to_string(),
                }),
            },
            OpState::Waiting { .. } | OpState::Enqueueing => Progress::Pending,
        }
    }

    fn release_op(&self, op: OpHandle) {
        let ev = self.tables().ops.remove(&op.0);
        if ev.is_some() {
            // Destroying a cudarc event binds its context.
            let _ = self.bind();
        }
        drop(ev);
    }

    fn abort(&self, comm: CommHandle) {
        let Some(c) = self.tables().comms.remove(&comm.0) else {
            return;
        };
        if let Err(e) = self.bind() {
            tracing::warn!(error = %e, "binding the CUDA context before ncclCommAbort failed");
        }
        // SAFETY: `c.raw` was live and is now out of the table: nothing else calls NCCL
        // with it; ncclCommAbort frees it.
        let code = unsafe { (self.api.comm_abort)(c.raw) };
        if code != SUCCESS {
            tracing::warn!(error = %nccl_error(self.api, "ncclCommAbort", code), "aborting an NCCL communicator");
        }
        drop(c.stream);
    }
}
