//! A small spin lock with an owner mark. The collector state needs a lock that:
//! can be taken in a pthread_atfork `prepare` handler and released in `parent`/`child`
//! (no guard object crosses those calls), never allocates, and lets the thread that
//! parked it for fork drain the ring itself if the ring fills meanwhile.
use std::cell::UnsafeCell;
use std::sync::atomic::{AtomicUsize, Ordering};

/// The lock word on lines of its own (128 bytes: a cache line and the neighbour the
/// prefetcher pairs with it). Producers with a full ring try the lock while the
/// collector holds it; beside the guarded value's first fields, each try would take
/// their line from the collector while it applies events, so where the fields sit would
/// decide how fast the collector runs under many threads.
#[repr(C, align(128))]
struct OwnLines(AtomicUsize);

#[repr(C)]
pub struct SpinLock<T> {
    owner: OwnLines,
    value: UnsafeCell<T>,
}

// SAFETY: access to `value` is serialised by `owner` (acquire on lock, release on unlock).
unsafe impl<T: Send> Sync for SpinLock<T> {}
unsafe impl<T: Send> Send for SpinLock<T> {}

pub struct Guard<'a, T> {
    lock: &'a SpinLock<T>,
}

impl<T> SpinLock<T> {
    pub const fn new(value: T) -> SpinLock<T> {
        SpinLock { owner: OwnLines(AtomicUsize::new(0)), value: UnsafeCell::new(value) }
    }

    pub fn try_lock(&self) -> Option<Guard<'_, T>> {
        let me = super::threads::identity();
        // Read first: a failed compare-exchange still takes the line for writing.
        if self.owner.0.load(Ordering::Relaxed) != 0 {
            return None;
        }
        self.owner.0.compare_exchange(0, me, Ordering::Acquire, Ordering::Relaxed).ok()?;
        Some(Guard { lock: self })
    }

    /// Spins, then yields, then naps: the lock is held for microseconds while events are
    /// drained, but for as long as a fork takes while it is parked (tens of milliseconds
    /// in a large process), and a waiter yielding all that time keeps a core busy that
    /// the new child or the program's other threads could use.
    pub fn lock(&self) -> Guard<'_, T> {
        // First a plain compare-exchange: the lock is free nearly always, and a read
        // first would fault a lock in `.data` or `.bss` in twice at its first use (a
        // page mapped for reading, then copied for the write; a short process's exit
        // report takes such a lock once).
        let me = super::threads::identity();
        if self.owner.0.compare_exchange(0, me, Ordering::Acquire, Ordering::Relaxed).is_ok() {
            return Guard { lock: self };
        }
        let mut spins = 0u32;
        loop {
            if let Some(g) = self.try_lock() {
                return g;
            }
            spins = spins.saturating_add(1);
            if spins < 100 {
                std::hint::spin_loop();
            } else if spins < 200 {
                std::thread::yield_now();
            } else {
                std::thread::sleep(std::time::Duration::from_micros(50));
            }
        }
    }

    /// Takes the lock without a guard (fork `prepare`); pair with `unlock_raw`.
    pub fn lock_raw(&self) {
        std::mem::forget(self.lock());
    }

    /// Releases a lock taken with `lock_raw` by this same thread (fork `parent`/`child`).
    pub fn unlock_raw(&self) {
        self.owner.0.store(0, Ordering::Release);
    }

    /// In a child of fork or clone, where the calling thread is the only one: the lock,
    /// taken whoever held it (a thread of the parent that is not here, which never lets
    /// it go), and whether it was free (else what it guards may be half-updated).
    pub fn take_over(&self) -> (Guard<'_, T>, bool) {
        let was_free = self.owner.0.load(Ordering::Acquire) == 0;
        self.owner.0.store(0, Ordering::Release);
        (self.lock(), was_free)
    }

    /// Whether this very thread holds the lock now.
    pub fn held_by_me(&self) -> bool {
        self.owner.0.load(Ordering::Acquire) == super::threads::identity()
    }

    /// The lock was parked by this very thread with `lock_raw` (inside fork): the state
    /// is consistent and may be used without taking the lock again.
    pub fn parked_by_me(&self) -> Option<Guard<'_, T>> {
        if self.owner.0.load(Ordering::Acquire) == super::threads::identity() {
            Some(Guard { lock: self })
        } else {
            None
        }
    }
}

impl<T> std::ops::Deref for Guard<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        // SAFETY: the guard proves exclusive ownership of the lock.
        unsafe { &*self.lock.value.get() }
    }
}

impl<T> std::ops::DerefMut for Guard<'_, T> {
    fn deref_mut(&mut self) -> &mut T {
        // SAFETY: the guard proves exclusive ownership of the lock.
        unsafe { &mut *self.lock.value.get() }
    }
}

impl<T> Guard<'_, T> {
    /// Ends a guard obtained from `parked_by_me` without releasing the parked lock.
    pub fn keep_parked(self) {
        std::mem::forget(self);
    }
}

impl<T> Drop for Guard<'_, T> {
    fn drop(&mut self) {
        self.lock.owner.0.store(0, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_are_exact_under_contention() {
        static L: SpinLock<u64> = SpinLock::new(0);
        std::thread::scope(|s| {
            for _ in 0..8 {
                s.spawn(|| {
                    for _ in 0..10_000 {
                        *L.lock() += 1;
                    }
                });
            }
        });
        assert_eq!(*L.lock(), 80_000);
    }

    #[test]
    fn raw_lock_is_visible_to_its_owner_only() {
        static L: SpinLock<u32> = SpinLock::new(1);
        L.lock_raw();
        assert!(L.try_lock().is_none());
        let g = L.parked_by_me().unwrap();
        assert_eq!(*g, 1);
        g.keep_parked();
        std::thread::scope(|s| {
            s.spawn(|| assert!(L.parked_by_me().is_none() && L.try_lock().is_none()));
        });
        L.unlock_raw();
        assert!(L.try_lock().is_some());
    }

    /// A lock held by a thread that will never let it go is taken over, and says it was
    /// held; a free one says it was free.
    #[test]
    fn a_lock_is_taken_over_from_a_thread_that_holds_it() {
        static L: SpinLock<u32> = SpinLock::new(7);
        std::thread::scope(|s| {
            s.spawn(|| L.lock_raw());
        });
        let (g, was_free) = L.take_over();
        assert_eq!((*g, was_free), (7, false));
        drop(g);
        let (g, was_free) = L.take_over();
        assert_eq!((*g, was_free), (7, true));
        drop(g);
        assert!(L.try_lock().is_some(), "released with its guard");
    }
}
