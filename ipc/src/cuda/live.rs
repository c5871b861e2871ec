//! Live-memory accounting: what a [`CudaBackend`](super::CudaBackend) holds now, exported
//! and imported ([`LiveMemory`]). Each allocation or mapping the backend makes with the
//! driver owns a token that counts it until the memory is released: exact, per backend,
//! unlike device-wide free memory.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

/// What a [`CudaBackend`](super::CudaBackend) holds now, exported and imported: allocations and mappings it
/// made with the driver that are not released yet, and their bytes. Memory opened in the
/// process that exported it is the exporter's own and is not counted again. A pool
/// allocation counts until its `cuMemFreeAsync` is queued.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LiveMemory {
    /// Allocations this backend made and has not freed.
    pub exported: usize,
    /// Their bytes (VMM: rounded up to the granularity).
    pub exported_bytes: usize,
    /// Other processes' allocations this backend maps.
    pub imported: usize,
    /// Their bytes, as the handles claim them.
    pub imported_bytes: usize,
}

impl LiveMemory {
    /// Whether the backend holds nothing.
    pub fn is_empty(&self) -> bool {
        *self == LiveMemory::default()
    }
}

#[derive(Debug, Default)]
pub(super) struct LiveCounters {
    exported: AtomicUsize,
    exported_bytes: AtomicUsize,
    imported: AtomicUsize,
    imported_bytes: AtomicUsize,
}

impl LiveCounters {
    pub(super) fn snapshot(&self) -> LiveMemory {
        LiveMemory {
            exported: self.exported.load(Ordering::SeqCst),
            exported_bytes: self.exported_bytes.load(Ordering::SeqCst),
            imported: self.imported.load(Ordering::SeqCst),
            imported_bytes: self.imported_bytes.load(Ordering::SeqCst),
        }
    }
}

/// One counted allocation or mapping: counted while this lives. Declared after the memory
/// it counts in its owner, so that it drops after that memory is released.
pub(super) struct LiveToken {
    counters: Arc<LiveCounters>,
    imported: bool,
    bytes: usize,
}

impl LiveToken {
    pub(super) fn new(counters: &Arc<LiveCounters>, imported: bool, bytes: usize) -> Self {
        let (n, b) = if imported {
            (&counters.imported, &counters.imported_bytes)
        } else {
            (&counters.exported, &counters.exported_bytes)
        };
        n.fetch_add(1, Ordering::SeqCst);
        b.fetch_add(bytes, Ordering::SeqCst);
        Self {
            counters: Arc::clone(counters),
            imported,
            bytes,
        }
    }
}

impl Drop for LiveToken {
    fn drop(&mut self) {
        let c = &self.counters;
        let (n, b) = if self.imported {
            (&c.imported, &c.imported_bytes)
        } else {
            (&c.exported, &c.exported_bytes)
        };
        n.fetch_sub(1, Ordering::SeqCst);
        b.fetch_sub(self.bytes, Ordering::SeqCst);
    }
}
