//! The transfer MAC, hashed off the copying thread.
//!
//! A transfer's MAC is keyed BLAKE3 of its payload under a key of its own,
//! `keyed_blake3(connection key, id ‖ len)` (little-endian `u64`s): a changed id or length
//! gives another key, so the MAC binds them as well as every payload byte. The payload is
//! cut into [`PIECE`]-byte pieces; each is a complete subtree of BLAKE3's tree (a piece is
//! a power-of-two number of BLAKE3 chunks, at an offset that is a multiple of its size), so
//! its chaining value can be computed on any thread, in any order, and the values merged
//! into BLAKE3's root ([`blake3::hazmat`]): the MAC equals
//! `blake3::keyed_hash(transfer key, payload)`, which the tests check for every shape of
//! tree.
//!
//! The copying thread says which bytes are there ([`PayloadMac::landed`]); an engine's
//! [`Hashers`] (a few threads, started at its first payload of more than one piece) hash
//! those pieces while the copy goes on. With no hashing threads the copying thread hashes
//! each piece itself as it lands.
//!
//! # Safety
//! A hashing thread reads a piece only through a [`PayloadMac`], which the copying thread
//! makes while it holds the transfer's touch: `PayloadMac::new`'s contract keeps the
//! memory valid and each landed piece unchanged until the `PayloadMac` is dropped, and its
//! drop takes back the pieces not yet started and waits out those being hashed, so no
//! hashing thread reads the memory once the copying thread ends its touch.

use super::lock;
use blake3::hazmat::{
    ChainingValue, HasherExt, Mode, merge_subtrees_non_root, merge_subtrees_root,
};
use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};

/// Payload bytes hashed as one piece: a power-of-two multiple of BLAKE3's chunk.
pub(super) const PIECE: usize = 1 << 20;

/// The MAC key of one transfer.
pub(super) fn transfer_key(connection: &[u8; 32], id: u64, len: u64) -> [u8; 32] {
    let mut ids = [0u8; 16];
    ids[..8].copy_from_slice(&id.to_le_bytes());
    ids[8..].copy_from_slice(&len.to_le_bytes());
    *blake3::keyed_hash(connection, &ids).as_bytes()
}

/// The payload's bytes, as the hashing threads read them.
#[derive(Debug, Clone, Copy)]
struct Span {
    ptr: *const u8,
    len: usize,
}

// SAFETY: the pointer is read only through `Batch::piece`, within `PayloadMac::new`'s
// contract (valid, and unchanged once landed, until the `PayloadMac` drops, which waits out
// every thread that reads it); sharing it between threads shares only reads.
unsafe impl Send for Span {}
// SAFETY: as for `Send`: every access is a read of bytes nobody writes meanwhile.
unsafe impl Sync for Span {}

/// One payload's pieces and their chaining values.
#[derive(Debug)]
struct Batch {
    span: Span,
    key: [u8; 32],
    piece: usize,
    state: Mutex<BatchState>,
    done: Condvar,
}

#[derive(Debug)]
struct BatchState {
    cvs: Vec<Option<ChainingValue>>,
    /// Pieces queued for the hashing threads and not yet done (hashed, or lost to a
    /// panic: `finish` hashes those itself).
    pending: usize,
}

impl Batch {
    fn pieces(&self) -> usize {
        self.span.len.div_ceil(self.piece)
    }

    /// Piece `i`'s bytes.
    ///
    /// # Safety
    /// Piece `i` has landed and its `PayloadMac` is alive.
    unsafe fn piece(&self, i: usize) -> &[u8] {
        let start = i * self.piece;
        let len = self.piece.min(self.span.len - start);
        let at = self.span.ptr.wrapping_add(start);
        // SAFETY: `PayloadMac::new`'s contract keeps the span valid and landed pieces
        // unchanged while the `PayloadMac` lives; the range is within the span.
        unsafe { std::slice::from_raw_parts(at, len) }
    }

    /// Piece `i`'s chaining value (of a payload of more than one piece).
    ///
    /// # Safety
    /// As [`Batch::piece`].
    unsafe fn chaining_value(&self, i: usize) -> ChainingValue {
        // SAFETY: passed on from the caller.
        let bytes = unsafe { self.piece(i) };
        blake3::Hasher::new_keyed(&self.key)
            .set_input_offset((i * self.piece) as u64)
            .update(bytes)
            .finalize_non_root()
    }

    fn store(&self, i: usize, cv: ChainingValue) {
        lock(&self.state).cvs[i] = Some(cv);
    }
}

/// The subtree over `cvs` (each a piece's chaining value, the pieces in order): BLAKE3's
/// left subtree holds the largest power of two of them that is less than all.
fn subtree(cvs: &[ChainingValue], key: &[u8; 32]) -> ChainingValue {
    if cvs.len() == 1 {
        return cvs[0];
    }
    let left = cvs.len().div_ceil(2).next_power_of_two();
    let (l, r) = (subtree(&cvs[..left], key), subtree(&cvs[left..], key));
    merge_subtrees_non_root(&l, &r, Mode::KeyedHash(key))
}

/// The root over two or more pieces' chaining values.
fn root(cvs: &[ChainingValue], key: &[u8; 32]) -> blake3::Hash {
    debug_assert!(cvs.len() >= 2);
    let left = cvs.len().div_ceil(2).next_power_of_two();
    let (l, r) = (subtree(&cvs[..left], key), subtree(&cvs[left..], key));
    merge_subtrees_root(&l, &r, Mode::KeyedHash(key))
}

#[derive(Debug, Default)]
struct Jobs {
    queue: VecDeque<(Arc<Batch>, usize)>,
    spawned: usize,
    closed: bool,
}

/// An engine's hashing threads.
#[derive(Debug)]
pub(super) struct Hashers {
    threads: AtomicUsize,
    jobs: Mutex<Jobs>,
    more: Condvar,
}

impl Hashers {
    /// Up to `threads` hashing threads (none: each copying thread hashes for itself),
    /// started when first needed.
    pub(super) fn new(threads: usize) -> Arc<Hashers> {
        Arc::new(Hashers {
            threads: AtomicUsize::new(threads),
            jobs: Mutex::new(Jobs::default()),
            more: Condvar::new(),
        })
    }

    /// How many hashing threads it has, or will have once used.
    pub(super) fn threads(&self) -> usize {
        self.threads.load(Ordering::Relaxed)
    }

    /// Sets how many: threads already started stay (a smaller count takes effect only
    /// before the first payload of more than one piece).
    pub(super) fn set_threads(&self, threads: usize) {
        self.threads.store(threads, Ordering::Relaxed);
    }

    /// A default for a machine with `cores` cores: one thread per core beyond the two
    /// copying threads, at least two and at most four (four hash faster than a copy on
    /// loopback); none on one core. Even on two cores, where hashing competes with the
    /// copy, the copy runs on while the hashing threads catch up: 0.84× of a plain copy on
    /// the 2-core development VM against 0.55× with the copying threads hashing (medians
    /// of 36 rounds, `docs/BENCHMARKS.md`).
    pub(super) fn default_threads(cores: usize) -> usize {
        if cores <= 1 {
            0
        } else {
            cores.saturating_sub(2).clamp(2, 4)
        }
    }

    /// Its threads end once their queue is empty; later payloads are hashed by their
    /// copying threads.
    pub(super) fn close(&self) {
        lock(&self.jobs).closed = true;
        self.more.notify_all();
    }

    /// Queues pieces `from..to` of `batch`: `false` if it has no threads (none asked for,
    /// closed, or none could start).
    fn submit(self: &Arc<Self>, batch: &Arc<Batch>, from: usize, to: usize) -> bool {
        let mut jobs = lock(&self.jobs);
        let threads = self.threads();
        if jobs.closed || threads == 0 {
            return false;
        }
        while jobs.spawned < threads {
            let pool = Arc::clone(self);
            let spawned = std::thread::Builder::new()
                .name("baton-tcp-hash".into())
                .spawn(move || pool.work());
            if spawned.is_err() {
                break;
            }
            jobs.spawned += 1;
        }
        if jobs.spawned == 0 {
            return false;
        }
        lock(&batch.state).pending += to - from;
        jobs.queue
            .extend((from..to).map(|i| (Arc::clone(batch), i)));
        drop(jobs);
        self.more.notify_all();
        true
    }

    /// Takes back `batch`'s pieces that no thread has started.
    fn withdraw(&self, batch: &Arc<Batch>) {
        let mut jobs = lock(&self.jobs);
        let before = jobs.queue.len();
        jobs.queue.retain(|(b, _)| !Arc::ptr_eq(b, batch));
        let taken = before - jobs.queue.len();
        drop(jobs);
        lock(&batch.state).pending -= taken;
    }

    fn work(&self) {
        loop {
            let (batch, i) = {
                let mut jobs = lock(&self.jobs);
                loop {
                    if let Some(job) = jobs.queue.pop_front() {
                        break job;
                    }
                    if jobs.closed {
                        return;
                    }
                    jobs = self.more.wait(jobs).unwrap_or_else(|p| p.into_inner());
                }
            };
            let cv = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                // SAFETY: the piece was queued by `PayloadMac::landed`, so it has landed;
                // its `PayloadMac` is alive: its drop waits until `pending` is back to
                // zero, and this piece counts until it is done below.
                unsafe { batch.chaining_value(i) }
            }));
            let mut state = lock(&batch.state);
            state.cvs[i] = cv.ok();
            state.pending -= 1;
            drop(state);
            batch.done.notify_all();
        }
    }
}

/// One payload's MAC as its bytes land.
#[derive(Debug)]
pub(super) struct PayloadMac<'h> {
    hashers: Option<&'h Arc<Hashers>>,
    batch: Arc<Batch>,
    /// Pieces hashed or queued.
    handed: usize,
}

impl<'h> PayloadMac<'h> {
    /// The MAC of the `len` bytes at `ptr` under `key` (a [`transfer_key`]), hashed on
    /// `hashers`' threads where it has them.
    ///
    /// # Safety
    /// The bytes stay valid for reads while the result lives, and each byte stays
    /// unchanged from the moment [`landed`](Self::landed) covers it until the result is
    /// dropped.
    pub(super) unsafe fn new(
        hashers: Option<&'h Arc<Hashers>>,
        key: [u8; 32],
        ptr: *const u8,
        len: usize,
    ) -> Self {
        // SAFETY: passed on from the caller.
        unsafe { Self::with_piece(hashers, key, ptr, len, PIECE) }
    }

    /// As [`new`](Self::new), with pieces of `piece` bytes (a power-of-two multiple of
    /// BLAKE3's chunk).
    ///
    /// # Safety
    /// As [`new`](Self::new).
    unsafe fn with_piece(
        hashers: Option<&'h Arc<Hashers>>,
        key: [u8; 32],
        ptr: *const u8,
        len: usize,
        piece: usize,
    ) -> Self {
        debug_assert!(piece.is_power_of_two() && piece >= blake3::CHUNK_LEN);
        let batch = Arc::new(Batch {
            span: Span { ptr, len },
            key,
            piece,
            state: Mutex::new(BatchState {
                cvs: vec![None; len.div_ceil(piece)],
                pending: 0,
            }),
            done: Condvar::new(),
        });
        PayloadMac {
            hashers,
            batch,
            handed: 0,
        }
    }

    /// The payload's bytes `..upto` have landed (and stay unchanged; an `upto` past the
    /// end means all of them): the pieces wholly among them are hashed, or queued to be.
    pub(super) fn landed(&mut self, upto: usize) {
        let batch = &self.batch;
        let pieces = batch.pieces();
        if pieces <= 1 {
            return; // one root, hashed by `finish`
        }
        let ready = if upto >= batch.span.len {
            pieces
        } else {
            upto / batch.piece
        };
        if ready <= self.handed {
            return;
        }
        let queued = self
            .hashers
            .is_some_and(|h| h.submit(batch, self.handed, ready));
        if !queued {
            for i in self.handed..ready {
                // SAFETY: piece `i` has landed (the caller says so) and `self` is alive.
                let cv = unsafe { batch.chaining_value(i) };
                batch.store(i, cv);
            }
        }
        self.handed = ready;
    }

    /// The MAC, once every byte has landed ([`landed`](Self::landed) with the length):
    /// waits for the pieces still being hashed.
    pub(super) fn finish(self) -> blake3::Hash {
        let batch = &self.batch;
        if batch.pieces() <= 1 {
            let bytes = if batch.span.len == 0 {
                &[][..]
            } else {
                // SAFETY: every byte has landed and `self` is alive; with one piece,
                // piece 0 is the whole payload.
                unsafe { batch.piece(0) }
            };
            return blake3::keyed_hash(&batch.key, bytes);
        }
        debug_assert_eq!(
            self.handed,
            batch.pieces(),
            "finish before every byte landed"
        );
        let mut state = lock(&batch.state);
        while state.pending > 0 {
            state = batch.done.wait(state).unwrap_or_else(|p| p.into_inner());
        }
        let done = std::mem::take(&mut state.cvs);
        drop(state);
        let mut cvs = Vec::with_capacity(done.len());
        for (i, cv) in done.into_iter().enumerate() {
            // Lost only to a panic in a hashing thread: hashed here instead.
            // SAFETY: every byte has landed and `self` is alive.
            cvs.push(cv.unwrap_or_else(|| unsafe { batch.chaining_value(i) }));
        }
        root(&cvs, &batch.key)
    }
}

impl Drop for PayloadMac<'_> {
    /// Takes back the pieces not started and waits out those being hashed (CPU work of at
    /// most a piece per hashing thread: no network wait).
    fn drop(&mut self) {
        if let Some(hashers) = self.hashers {
            hashers.withdraw(&self.batch);
        }
        let mut state = lock(&self.batch.state);
        while state.pending > 0 {
            state = self
                .batch
                .done
                .wait(state)
                .unwrap_or_else(|p| p.into_inner());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bytes(len: usize) -> Vec<u8> {
        (0..len).map(|i| (i * 131 + (i >> 11)) as u8).collect()
    }

    /// The MAC of `data` in pieces of `piece`, landing `step` bytes at a time.
    fn mac(hashers: Option<&Arc<Hashers>>, data: &[u8], piece: usize, step: usize) -> blake3::Hash {
        // SAFETY: `data` is borrowed, unchanged, for the whole call.
        let mut mac =
            unsafe { PayloadMac::with_piece(hashers, [9; 32], data.as_ptr(), data.len(), piece) };
        let mut at = 0;
        while at < data.len() {
            at = (at + step).min(data.len());
            mac.landed(at);
        }
        mac.landed(data.len());
        mac.finish()
    }

    #[test]
    fn the_pieced_mac_is_keyed_blake3_of_the_payload() {
        let chunk = blake3::CHUNK_LEN;
        let pool = Hashers::new(3);
        for piece in [chunk, 2 * chunk, 8 * chunk] {
            let mut lens = vec![0, 1, chunk - 1, chunk, chunk + 1];
            for pieces in [2, 3, 4, 5, 7, 8, 9, 16, 17, 33] {
                lens.extend([pieces * piece - 1, pieces * piece, pieces * piece + 1]);
            }
            for len in lens {
                let data = bytes(len);
                let want = blake3::keyed_hash(&[9; 32], &data);
                for step in [1000, piece, 3 * piece + 5, usize::MAX / 2] {
                    assert_eq!(mac(None, &data, piece, step), want, "{len} in {piece}");
                    assert_eq!(
                        mac(Some(&pool), &data, piece, step),
                        want,
                        "{len} in {piece}"
                    );
                }
            }
        }
        pool.close();
    }

    #[test]
    fn at_full_size_too_and_after_the_threads_closed() {
        let pool = Hashers::new(2);
        for len in [PIECE + 1, 5 * PIECE + 3] {
            let data = bytes(len);
            let want = blake3::keyed_hash(&[9; 32], &data);
            assert_eq!(mac(Some(&pool), &data, PIECE, 64 << 10), want);
        }
        pool.close();
        let data = bytes(3 * PIECE);
        let want = blake3::keyed_hash(&[9; 32], &data);
        assert_eq!(mac(Some(&pool), &data, PIECE, PIECE), want);
    }

    #[test]
    fn a_dropped_mac_takes_its_pieces_back() {
        let pool = Hashers::new(1);
        let data = bytes(64 * PIECE);
        {
            // SAFETY: `data` outlives the MAC, unchanged.
            let mut mac =
                unsafe { PayloadMac::new(Some(&pool), [1; 32], data.as_ptr(), data.len()) };
            mac.landed(data.len());
            // Dropped unfinished: returns once no thread reads `data`.
        }
        assert!(lock(&pool.jobs).queue.is_empty());
        pool.close();
    }

    #[test]
    fn the_transfer_key_binds_id_and_length() {
        let k = [5; 32];
        assert_ne!(transfer_key(&k, 1, 10), transfer_key(&k, 2, 10));
        assert_ne!(transfer_key(&k, 1, 10), transfer_key(&k, 1, 11));
        assert_ne!(transfer_key(&k, 1, 10), transfer_key(&[6; 32], 1, 10));
    }
}
