//! Allocation counts (issue 48, item 4): this executable's global allocator is the system's,
//! counting each `alloc`, `alloc_zeroed` and `realloc` call of the process (every thread).
//! Both ends of a handoff are this executable (the consumer is re-spawned from it), so
//! each side counts its own; a part reads the counter before and after its handoffs and
//! reports the difference per handoff. One relaxed atomic add per call: a few nanoseconds,
//! the same in every run.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicU64, Ordering};

/// The system allocator, counting its calls.
pub(crate) struct Counting;

static CALLS: AtomicU64 = AtomicU64::new(0);

// SAFETY: every method hands the call to `System` unchanged, which upholds `GlobalAlloc`'s
// contract; counting touches no memory of the caller's.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        CALLS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: the caller's contract for `alloc`, passed on as it is.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        CALLS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: the caller's contract for `alloc_zeroed`, passed on as it is.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        CALLS.fetch_add(1, Ordering::Relaxed);
        // SAFETY: the caller's contract for `realloc`, passed on as it is.
        unsafe { System.realloc(ptr, layout, new_size) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: the caller's contract for `dealloc`, passed on as it is.
        unsafe { System.dealloc(ptr, layout) }
    }
}

/// Allocations (`alloc`, `alloc_zeroed`, `realloc` calls) this process has made so far.
pub(crate) fn allocations() -> u64 {
    CALLS.load(Ordering::Relaxed)
}
