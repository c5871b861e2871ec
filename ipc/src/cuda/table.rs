//! [`OnceTable`]: what a backend opened of other processes (imported pools, opened events,
//! opened counter slabs), each opened once per key, with no lock held across the driver
//! call that opens it.
//!
//! A thread that finds no entry marks the key as being opened, lets go of the lock, opens,
//! and publishes the result; a thread that finds the mark waits (with a deadline) for that
//! result instead of opening a second time. Opening some driver objects twice in one
//! process is not harmless (a legacy IPC mapping opened twice is one mapping, which the
//! first close would unmap for both), so "open outside the lock, then insert" must not
//! race two opens of one key.

use crate::{Error, Result};
use std::collections::HashMap;
use std::hash::Hash;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// How long a thread waits for another thread's open of the same key.
const OPEN_DEADLINE: Duration = Duration::from_secs(60);

enum Slot<V> {
    Opening,
    Ready(Arc<V>),
}

/// Values opened once per key.
pub(crate) struct OnceTable<K, V> {
    slots: Mutex<HashMap<K, Slot<V>>>,
    changed: Condvar,
}

impl<K, V> Default for OnceTable<K, V> {
    fn default() -> Self {
        Self {
            slots: Mutex::new(HashMap::new()),
            changed: Condvar::new(),
        }
    }
}

/// Removes the key's `Opening` mark if the open unwinds, so waiters do not wait for a
/// result that never comes.
struct Unmark<'a, K: Eq + Hash + Clone, V> {
    table: &'a OnceTable<K, V>,
    key: Option<K>,
}

impl<K: Eq + Hash + Clone, V> Drop for Unmark<'_, K, V> {
    fn drop(&mut self) {
        if let Some(key) = self.key.take() {
            let mut slots = self.table.lock();
            if matches!(slots.get(&key), Some(Slot::Opening)) {
                slots.remove(&key);
            }
            drop(slots);
            self.table.changed.notify_all();
        }
    }
}

impl<K: Eq + Hash + Clone, V> OnceTable<K, V> {
    fn lock(&self) -> MutexGuard<'_, HashMap<K, Slot<V>>> {
        // Every critical section is a single map operation: a poisoned lock is consistent.
        self.slots.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The value opened for `key`, if it is ready.
    pub(crate) fn get(&self, key: &K) -> Option<Arc<V>> {
        match self.lock().get(key) {
            Some(Slot::Ready(v)) => Some(Arc::clone(v)),
            _ => None,
        }
    }

    /// The value for `key`: the one opened before, or the one `open` makes now (called
    /// with no lock held, at most once per key at a time). A failed open leaves no entry.
    ///
    /// # Errors
    /// `open`'s error; [`Error::Timeout`] if another thread's open of the same key took
    /// longer than a minute.
    pub(crate) fn get_or_open(
        &self,
        key: &K,
        open: impl FnOnce() -> Result<Arc<V>>,
    ) -> Result<Arc<V>> {
        let start = Instant::now();
        let mut slots = self.lock();
        loop {
            match slots.get(key) {
                Some(Slot::Ready(v)) => return Ok(Arc::clone(v)),
                Some(Slot::Opening) => {
                    let left =
                        OPEN_DEADLINE
                            .checked_sub(start.elapsed())
                            .ok_or(Error::Timeout {
                                op: "another thread's open of the same CUDA object",
                                after: OPEN_DEADLINE,
                            })?;
                    slots = self
                        .changed
                        .wait_timeout(slots, left)
                        .unwrap_or_else(|p| p.into_inner())
                        .0;
                }
                None => break,
            }
        }
        slots.insert(key.clone(), Slot::Opening);
        drop(slots);
        let mut unmark = Unmark {
            table: self,
            key: Some(key.clone()),
        };
        let value = open()?; // on error, `unmark` removes the mark
        unmark.key = None;
        self.lock()
            .insert(key.clone(), Slot::Ready(Arc::clone(&value)));
        self.changed.notify_all();
        Ok(value)
    }

    /// Removes the ready values whose key matches and returns them, for the caller to drop
    /// with no lock held (dropping may call the driver).
    pub(crate) fn take_where(&self, mut pred: impl FnMut(&K) -> bool) -> Vec<Arc<V>> {
        self.take_where_value(|k, _| pred(k))
    }

    /// As [`take_where`](Self::take_where), the predicate seeing the value too.
    pub(crate) fn take_where_value(
        &self,
        mut pred: impl FnMut(&K, &Arc<V>) -> bool,
    ) -> Vec<Arc<V>> {
        let mut taken = Vec::new();
        self.lock().retain(|k, slot| match slot {
            Slot::Ready(v) if pred(k, v) => {
                taken.push(Arc::clone(v));
                false
            }
            _ => true,
        });
        taken
    }

    /// Entries, ready or being opened.
    pub(crate) fn len(&self) -> usize {
        self.lock().len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[test]
    fn each_key_is_opened_once_even_by_racing_threads() {
        let table = Arc::new(OnceTable::<u32, usize>::default());
        let opens = Arc::new(AtomicUsize::new(0));
        let threads: Vec<_> = (0..8)
            .map(|_| {
                let (table, opens) = (Arc::clone(&table), Arc::clone(&opens));
                std::thread::spawn(move || {
                    *table
                        .get_or_open(&7, || {
                            std::thread::sleep(Duration::from_millis(20));
                            Ok(Arc::new(opens.fetch_add(1, Ordering::SeqCst)))
                        })
                        .unwrap()
                })
            })
            .collect();
        let got: Vec<usize> = threads.into_iter().map(|t| t.join().unwrap()).collect();
        assert_eq!(opens.load(Ordering::SeqCst), 1, "one open for one key");
        assert!(got.iter().all(|&v| v == 0), "everyone got that one value");
        assert_eq!(table.len(), 1);
    }

    #[test]
    fn a_failed_or_panicking_open_leaves_no_entry() {
        let table = OnceTable::<u32, u32>::default();
        assert!(table.get_or_open(&1, || Err(Error::ZeroSize)).is_err());
        assert_eq!(table.len(), 0);
        let unwound = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let _ = table.get_or_open(&2, || panic!("open panicked"));
        }));
        assert!(unwound.is_err());
        assert_eq!(table.len(), 0, "the mark went with the panic");
        assert_eq!(*table.get_or_open(&2, || Ok(Arc::new(5))).unwrap(), 5);
        assert_eq!(table.get(&2).as_deref(), Some(&5));
    }

    #[test]
    fn take_where_removes_only_matching_ready_values() {
        let table = OnceTable::<(u8, u8), u8>::default();
        for k in [(1, 1), (1, 2), (2, 1)] {
            table.get_or_open(&k, || Ok(Arc::new(k.1))).unwrap();
        }
        let taken = table.take_where(|k| k.0 == 1);
        assert_eq!(taken.len(), 2);
        assert_eq!(table.len(), 1);
        assert!(table.get(&(2, 1)).is_some());
    }
}
