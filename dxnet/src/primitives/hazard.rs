//! A table of shared objects, one `Arc<T>` per slot, that readers look up
//! without a locked instruction: the connection table on the send path.
//!
//! Hazard pointers (Michael, 2004) with an asymmetric fence. A reader
//! publishes the pointer it is about to use in its thread's record, then
//! checks that the slot still holds it; a writer that takes an object out
//! of its slot frees it only once no record holds it. The reader's side
//! needs a full fence between its record store and its check, the writer's
//! between its slot store and its scan of the records. On Linux the
//! writer's is `membarrier(2)` (`MEMBARRIER_CMD_PRIVATE_EXPEDITED`), which
//! makes every running thread of the process execute a full fence, so the
//! reader's is only a compiler fence: a lookup costs a record store and two
//! loads, where a reference count or arc-swap's debt list costs locked
//! instructions, each of which waits for the sender's store buffer to drain
//! (the message bytes just written). Without `membarrier` both sides use a
//! full fence. (haphazard, the hazard-pointer crate, uses full fences on
//! both sides; the `membarrier` crate wraps one system call and brings
//! `lazy_static` and an old `windows-sys`: hence this module.)
//!
//! Protocol (the loom model below checks it with full fences on both
//! sides, which `membarrier` stands in for):
//! - Reader: load the slot (`p`); store `p` in its record; fence; load the
//!   slot again: equal, `p` is protected until the record is cleared;
//!   different, retry.
//! - Writer (one at a time, under the `retired` lock): swap the slot; put
//!   the old object on the retired list; fence; drop every retired object
//!   no record holds. Either a reader's record store precedes the writer's
//!   fence (the scan sees it and keeps the object) or the reader's second
//!   load follows it (it sees the new slot value and does not use `p`).
//! - Objects a record still held stay retired, with `pending` set before
//!   the writer's fence: a reader whose record leaves such an object (its
//!   guard dropped, or a lookup that retried) fences and, seeing
//!   `pending`, reclaims. Either the writer's scan saw the record empty,
//!   or the reader sees `pending`: a removed object is freed by whoever
//!   lets it go last. Readers of objects still in their slot never take
//!   the lock.
//! - Each thread has [`RECORDS`] records per table (a lookup inside a
//!   lookup, e.g. the engine's half of the connection a send holds, needs
//!   a second). A lookup while all of them are in use takes the writers'
//!   lock and clones the `Arc` instead.

use std::ptr;

#[cfg(not(loom))]
use crossbeam::utils::CachePadded;
// std's `Arc` also under loom: the model checks the slots and records
// (loom's atomics), not the reference count, and the table's users hold
// std `Arc`s.
use std::sync::Arc;

use super::sync::{fence, sleep_lock, AtomicBool, AtomicPtr, Ordering, SleepMutex as Mutex};

/// Records per thread and table: lookups a thread can hold at once
/// without the writers' lock.
pub const RECORDS: usize = 2;

/// A table of `Arc<T>` slots read without locked instructions (see the
/// module comment).
pub struct HazardTable<T> {
    /// `Arc::into_raw` of each slot's object, or null.
    slots: Box<[AtomicPtr<T>]>,
    records: Records,
    /// Objects out of their slot that a record may still hold. Its lock
    /// also serializes the writers, and nested readers clone under it.
    retired: Mutex<Vec<Arc<T>>>,
    /// `retired` is not empty: a reader that lets an object go reclaims.
    pending: AtomicBool,
}

// SAFETY: the table owns one strong reference per non-null slot (as an
// `Arc<T>` would) and hands out `&T` and `Arc<T>` only: it is `Send` and
// `Sync` exactly when `Arc<T>` is.
unsafe impl<T: Send + Sync> Send for HazardTable<T> {}
// SAFETY: see `Send`.
unsafe impl<T: Send + Sync> Sync for HazardTable<T> {}

impl<T> HazardTable<T> {
    /// `n` empty slots.
    pub fn new(n: usize) -> Self {
        asym::init();
        Self {
            slots: (0..n).map(|_| AtomicPtr::new(ptr::null_mut())).collect(),
            records: Records::default(),
            retired: Mutex::new(Vec::new()),
            pending: AtomicBool::new(false),
        }
    }

    /// The object in slot `i`, usable until the guard is dropped.
    #[inline]
    pub fn protect(&self, i: usize) -> Option<Guard<'_, T>> {
        let slot = &self.slots[i];
        let mut p = slot.load(Ordering::Acquire);
        if p.is_null() {
            return None;
        }
        // Only this thread stores into its records: a relaxed load sees
        // its own last store.
        let Some(rec) = self
            .records
            .mine()
            .iter()
            .find(|r| r.load(Ordering::Relaxed).is_null())
        else {
            return self.clone_locked(i).map(|a| Guard(Held::Owned(a)));
        };
        let mut moved = false;
        loop {
            // Release: a writer that finds this record also finds the
            // reader's earlier uses of the object it protected before.
            rec.store(p.cast(), Ordering::Release);
            asym::light();
            let now = slot.load(Ordering::Acquire);
            if now == p {
                if moved {
                    self.reclaim_if_pending();
                }
                // SAFETY: `p` came from `Arc::into_raw` and stays alive
                // while the record holds it (see the protocol above).
                return Some(Guard(Held::Protected {
                    obj: unsafe { &*p },
                    rec,
                    table: self,
                    slot: i,
                }));
            }
            // The slot changed: a writer may have retired the object this
            // record held and kept it for this record; once the record
            // moved off it, this reader reclaims (as a guard's drop does).
            moved = true;
            if now.is_null() {
                rec.store(ptr::null_mut(), Ordering::Release);
                asym::light();
                self.reclaim_if_pending();
                return None;
            }
            p = now;
        }
    }

    /// Reclaims if objects wait for their readers (a plain load first).
    fn reclaim_if_pending(&self) {
        if self.pending.load(Ordering::Relaxed) {
            self.reclaim();
        }
    }

    /// A strong reference to the object in slot `i`.
    pub fn get(&self, i: usize) -> Option<Arc<T>> {
        let g = self.protect(i)?;
        match &g.0 {
            Held::Protected { obj, .. } => {
                let p: *const T = *obj;
                // SAFETY: `p` came from `Arc::into_raw` and is protected
                // (alive) while the guard exists: adding a strong count
                // and taking it as an `Arc` is sound.
                unsafe {
                    Arc::increment_strong_count(p);
                    Some(Arc::from_raw(p))
                }
            }
            Held::Owned(a) => Some(a.clone()),
        }
    }

    /// Clones slot `i`'s object under the writers' lock (no writer can
    /// take it out meanwhile).
    fn clone_locked(&self, i: usize) -> Option<Arc<T>> {
        let _writers = sleep_lock(&self.retired);
        let p = self.slots[i].load(Ordering::Acquire);
        if p.is_null() {
            return None;
        }
        // SAFETY: the slot owns a strong reference to `p` and no writer
        // runs while the lock is held.
        unsafe {
            Arc::increment_strong_count(p);
            Some(Arc::from_raw(p))
        }
    }

    /// Puts `new` into slot `i`; true if the slot held an object (which
    /// is freed once no reader uses it).
    pub fn replace(&self, i: usize, new: Option<Arc<T>>) -> bool {
        let new = new.map_or(ptr::null_mut(), |a| Arc::into_raw(a).cast_mut());
        let mut retired = sleep_lock(&self.retired);
        let old = self.slots[i].swap(new, Ordering::AcqRel);
        if old.is_null() {
            return false;
        }
        // SAFETY: `old` came from `Arc::into_raw` and the slot's strong
        // reference moves to the retired list.
        retired.push(unsafe { Arc::from_raw(old) });
        // Before the fence: a reader that lets the object go after it
        // sees this and reclaims (see `Guard`'s drop).
        self.pending.store(true, Ordering::Relaxed);
        let freed = self.reclaim_locked(&mut retired);
        drop(retired);
        // Dropped outside the lock: an object's own drop may look up.
        drop(freed);
        true
    }

    /// Frees the retired objects no reader uses any more.
    pub fn reclaim(&self) {
        let mut retired = sleep_lock(&self.retired);
        let freed = self.reclaim_locked(&mut retired);
        drop(retired);
        drop(freed);
    }

    /// Objects out of their slot but still held by a reader.
    #[cfg(test)]
    pub fn retired_len(&self) -> usize {
        sleep_lock(&self.retired).len()
    }

    /// Takes the retired objects no record holds out of `retired`.
    fn reclaim_locked(&self, retired: &mut Vec<Arc<T>>) -> Vec<Arc<T>> {
        if retired.is_empty() {
            return Vec::new();
        }
        if !asym::heavy() {
            // Nothing freed; `pending` stays set, so readers retry.
            return Vec::new();
        }
        let mut held: Vec<*mut ()> = Vec::new();
        self.records.for_each(|p| {
            if !p.is_null() {
                held.push(p);
            }
        });
        let (keep, freed): (Vec<_>, Vec<_>) = retired
            .drain(..)
            .partition(|a| held.contains(&Arc::as_ptr(a).cast_mut().cast()));
        *retired = keep;
        self.pending.store(!retired.is_empty(), Ordering::Relaxed);
        freed
    }

    /// Every object in the table (a snapshot), cloned under the writers'
    /// lock.
    pub fn all(&self) -> Vec<Arc<T>> {
        let _writers = sleep_lock(&self.retired);
        self.slots
            .iter()
            .filter_map(|s| {
                let p = s.load(Ordering::Acquire);
                (!p.is_null()).then(|| {
                    // SAFETY: as in `clone_locked`.
                    unsafe {
                        Arc::increment_strong_count(p);
                        Arc::from_raw(p)
                    }
                })
            })
            .collect()
    }
}

impl<T> Drop for HazardTable<T> {
    fn drop(&mut self) {
        for s in self.slots.iter() {
            let p = s.swap(ptr::null_mut(), Ordering::AcqRel);
            if !p.is_null() {
                // SAFETY: the slot's strong reference (`&mut self`: no
                // reader is left).
                drop(unsafe { Arc::from_raw(p) });
            }
        }
    }
}

impl<T> std::fmt::Debug for HazardTable<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HazardTable")
            .field("slots", &self.slots.len())
            .finish_non_exhaustive()
    }
}

/// A looked-up object, usable while the guard lives: protected by this
/// thread's record (cleared on drop), or a strong reference where the
/// thread's records were all in use.
pub struct Guard<'a, T>(Held<'a, T>);

enum Held<'a, T> {
    Protected {
        obj: &'a T,
        /// The thread's record, cleared on drop.
        rec: &'a AtomicPtr<()>,
        /// Reclaims on drop if its object left the table meanwhile.
        table: &'a HazardTable<T>,
        /// The object's slot.
        slot: usize,
    },
    Owned(Arc<T>),
}

impl<T> Guard<'_, T> {
    /// Whether a record protects the object (not a clone).
    #[cfg(test)]
    fn is_protected(&self) -> bool {
        matches!(self.0, Held::Protected { .. })
    }
}

impl<T> std::ops::Deref for Guard<'_, T> {
    type Target = T;
    fn deref(&self) -> &T {
        match &self.0 {
            Held::Protected { obj, .. } => obj,
            Held::Owned(a) => a,
        }
    }
}

impl<T> Drop for Guard<'_, T> {
    fn drop(&mut self) {
        if let Held::Protected {
            obj,
            rec,
            table,
            slot,
        } = &self.0
        {
            // Release: the reader's uses of the object come before a
            // writer's scan that finds the record empty.
            rec.store(ptr::null_mut(), Ordering::Release);
            // Pairs with the writer's fence: either its scan sees the
            // record empty, or these loads see its `pending` and slot.
            asym::light();
            // Plain loads of lines written only when objects are retired:
            // a reader whose object left the table meanwhile may be its
            // last one and frees it (readers of objects still in the
            // table never take the lock).
            if table.pending.load(Ordering::Relaxed)
                && !ptr::eq(table.slots[*slot].load(Ordering::Relaxed), *obj)
            {
                table.reclaim();
            }
        }
    }
}

/// The records of the threads that read a table: one per thread, made on
/// its first lookup and kept (the `thread_local` crate hands an ended
/// thread's record to the next thread it gives the same id). Each
/// thread's records fill their own cache lines: unpadded, the crate packs
/// the entries of several threads into one line, and every lookup's
/// record store took that line from the threads on other cores, whose
/// next lookups then missed on it.
#[cfg(not(loom))]
#[derive(Default)]
struct Records(thread_local::ThreadLocal<CachePadded<[AtomicPtr<()>; RECORDS]>>);

#[cfg(not(loom))]
impl Records {
    #[inline]
    fn mine(&self) -> &[AtomicPtr<()>; RECORDS] {
        self.0
            .get_or(|| CachePadded::new(std::array::from_fn(|_| AtomicPtr::new(ptr::null_mut()))))
    }

    fn for_each(&self, mut f: impl FnMut(*mut ())) {
        for r in self.0.iter().flat_map(|r| r.iter()) {
            f(r.load(Ordering::Acquire));
        }
    }
}

/// Under loom: a fixed set of records indexed by the model thread (loom
/// threads share one OS thread, which `thread_local` would see as one).
#[cfg(loom)]
struct Records(Box<[[AtomicPtr<()>; RECORDS]]>);

#[cfg(loom)]
impl Default for Records {
    fn default() -> Self {
        Records(
            (0..4)
                .map(|_| std::array::from_fn(|_| AtomicPtr::new(ptr::null_mut())))
                .collect(),
        )
    }
}

#[cfg(loom)]
impl Records {
    fn mine(&self) -> &[AtomicPtr<()>; RECORDS] {
        &self.0[loom_thread_index()]
    }

    fn for_each(&self, mut f: impl FnMut(*mut ())) {
        for r in self.0.iter().flatten() {
            f(r.load(Ordering::Acquire));
        }
    }
}

#[cfg(loom)]
fn loom_thread_index() -> usize {
    // The model thread's index in the execution ("ThreadId(n)").
    let id = format!("{:?}", loom::thread::current().id());
    let n: usize = id
        .trim_start_matches("ThreadId(")
        .trim_end_matches(')')
        .parse()
        .expect("loom thread id");
    n % 4
}

/// The asymmetric fence: `light` on the readers' path, `heavy` on the
/// writers'.
mod asym {
    #[cfg(all(target_os = "linux", not(loom)))]
    use std::sync::atomic::{compiler_fence, AtomicBool};

    use super::{fence, Ordering};

    /// `membarrier` is registered and works: readers need only a
    /// compiler fence.
    #[cfg(all(target_os = "linux", not(loom)))]
    static EXPEDITED: AtomicBool = AtomicBool::new(false);

    #[cfg(all(target_os = "linux", not(loom)))]
    const CMD_QUERY: libc::c_int = 0;
    #[cfg(all(target_os = "linux", not(loom)))]
    const CMD_PRIVATE_EXPEDITED: libc::c_int = 1 << 3;
    #[cfg(all(target_os = "linux", not(loom)))]
    const CMD_REGISTER_PRIVATE_EXPEDITED: libc::c_int = 1 << 4;

    #[cfg(all(target_os = "linux", not(loom)))]
    fn membarrier(cmd: libc::c_int) -> libc::c_long {
        // SAFETY: `membarrier(cmd, flags = 0, cpu_id = 0)` has no memory
        // arguments.
        unsafe { libc::syscall(libc::SYS_membarrier, cmd, 0, 0) }
    }

    /// Registers the process for expedited `membarrier` once, before any
    /// table exists: a reader relies on the choice made here, so it must
    /// not change once a table is in use.
    pub(super) fn init() {
        #[cfg(all(target_os = "linux", not(loom)))]
        {
            static ONCE: std::sync::Once = std::sync::Once::new();
            ONCE.call_once(|| {
                let supported = membarrier(CMD_QUERY);
                let wanted =
                    (CMD_PRIVATE_EXPEDITED | CMD_REGISTER_PRIVATE_EXPEDITED) as libc::c_long;
                if supported >= 0
                    && supported & wanted == wanted
                    && membarrier(CMD_REGISTER_PRIVATE_EXPEDITED) == 0
                {
                    EXPEDITED.store(true, Ordering::Release);
                }
            });
        }
    }

    /// The readers' side: a compiler fence where `heavy` is `membarrier`.
    #[inline]
    pub(super) fn light() {
        #[cfg(all(target_os = "linux", not(loom)))]
        if EXPEDITED.load(Ordering::Relaxed) {
            compiler_fence(Ordering::SeqCst);
            return;
        }
        fence(Ordering::SeqCst);
    }

    /// The writers' side: every running thread of the process executes a
    /// full fence before this returns (threads not running pass one when
    /// they are switched in). False if that could not be done: readers
    /// that use only a compiler fence are then not ordered with the
    /// caller, who must not free anything.
    #[must_use]
    pub(super) fn heavy() -> bool {
        #[cfg(all(target_os = "linux", not(loom)))]
        if EXPEDITED.load(Ordering::Relaxed) {
            // Registered: the command does not fail for a registered
            // process; if it ever did, nothing is freed (a leak, not a
            // use after free).
            let r = membarrier(CMD_PRIVATE_EXPEDITED);
            debug_assert_eq!(r, 0, "membarrier failed");
            return r == 0;
        }
        fence(Ordering::SeqCst);
        true
    }

    /// Whether readers get by with a compiler fence (tests report it).
    #[cfg(all(test, not(loom)))]
    pub(super) fn expedited() -> bool {
        #[cfg(target_os = "linux")]
        return EXPEDITED.load(Ordering::Relaxed);
        #[cfg(not(target_os = "linux"))]
        false
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicBool, AtomicUsize};

    /// Counts live objects: a use after free or a leak shows in the count.
    struct Obj {
        id: usize,
        live: Arc<AtomicUsize>,
    }

    impl Drop for Obj {
        fn drop(&mut self) {
            self.live.fetch_sub(1, Ordering::SeqCst);
        }
    }

    fn obj(id: usize, live: &Arc<AtomicUsize>) -> Arc<Obj> {
        live.fetch_add(1, Ordering::SeqCst);
        Arc::new(Obj {
            id,
            live: live.clone(),
        })
    }

    #[test]
    fn replace_get_and_free() {
        let live = Arc::new(AtomicUsize::new(0));
        let t = HazardTable::new(4);
        assert!(t.protect(1).is_none());
        assert!(!t.replace(1, Some(obj(7, &live))));
        assert_eq!(t.protect(1).unwrap().id, 7);
        let held = t.get(1).unwrap();
        assert!(t.replace(1, Some(obj(8, &live))));
        assert_eq!(t.protect(1).unwrap().id, 8);
        // The old one lives on in `held` only.
        assert_eq!(live.load(Ordering::SeqCst), 2);
        assert_eq!(t.retired_len(), 0);
        drop(held);
        assert_eq!(live.load(Ordering::SeqCst), 1);
        assert_eq!(t.all().len(), 1);
        drop(t);
        assert_eq!(live.load(Ordering::SeqCst), 0);
    }

    #[test]
    fn a_protected_object_outlives_its_removal() {
        let live = Arc::new(AtomicUsize::new(0));
        let t = HazardTable::new(2);
        t.replace(0, Some(obj(1, &live)));
        let g = t.protect(0).unwrap();
        // Nested lookups on the same thread: the second record, then a
        // clone under the writers' lock.
        let nested = t.protect(0).unwrap();
        assert!(nested.is_protected());
        let third = t.protect(0).unwrap();
        assert!(!third.is_protected());
        drop((nested, third));
        assert!(t.replace(0, None));
        assert_eq!(t.retired_len(), 1, "still protected");
        assert_eq!(g.id, 1);
        assert_eq!(live.load(Ordering::SeqCst), 1);
        // Letting it go frees it (the last reader reclaims).
        drop(g);
        assert_eq!(t.retired_len(), 0);
        assert_eq!(live.load(Ordering::SeqCst), 0);
        println!("membarrier expedited: {}", asym::expedited());
    }

    /// Readers on many threads (more than cores) look up and use objects
    /// while a writer keeps replacing them: every object a reader sees is
    /// alive (its id matches its canary), and at the end everything is
    /// freed.
    #[test]
    fn readers_never_see_a_freed_object() {
        const SLOTS: usize = 4;
        let live = Arc::new(AtomicUsize::new(0));
        let t = Arc::new(HazardTable::new(SLOTS));
        for i in 0..SLOTS {
            t.replace(i, Some(obj(i, &live)));
        }
        let stop = Arc::new(AtomicBool::new(false));
        let readers: Vec<_> = (0..16)
            .map(|r| {
                let (t, stop) = (t.clone(), stop.clone());
                std::thread::spawn(move || {
                    let mut seen = 0u64;
                    let mut i = r;
                    while !stop.load(Ordering::Relaxed) {
                        i = (i + 1) % SLOTS;
                        if let Some(g) = t.protect(i) {
                            assert_eq!(g.id % SLOTS, i, "a freed or foreign object");
                            assert!(g.live.load(Ordering::Relaxed) > 0);
                            seen += 1;
                        }
                        if let Some(a) = t.get(i) {
                            assert_eq!(a.id % SLOTS, i);
                        }
                    }
                    seen
                })
            })
            .collect();
        for round in 1..2000 {
            let i = round % SLOTS;
            let new = (round % 7 != 0).then(|| obj(round * SLOTS + i, &live));
            t.replace(i, new);
        }
        stop.store(true, Ordering::Relaxed);
        let seen: u64 = readers.into_iter().map(|r| r.join().unwrap()).sum();
        assert!(seen > 0);
        t.reclaim();
        assert_eq!(t.retired_len(), 0, "no reader left, nothing retired");
        let installed = t.all().len();
        assert_eq!(live.load(Ordering::SeqCst), installed);
        drop(t);
        assert_eq!(live.load(Ordering::SeqCst), 0);
    }
}

/// Loom model of the protocol: `RUSTFLAGS="--cfg loom" cargo test --release`.
#[cfg(all(test, loom))]
mod loom_tests {
    use super::*;
    use loom::sync::atomic::AtomicBool;

    /// Sets its flag when freed.
    struct Obj(Arc<AtomicBool>);

    impl Drop for Obj {
        fn drop(&mut self) {
            self.0.store(true, Ordering::SeqCst);
        }
    }

    /// A reader looks up and uses the object while a writer replaces it:
    /// the object the reader holds is never freed under it (its flag,
    /// found by address, without touching the object, stays unset while
    /// the guard lives), and both are freed in the end.
    #[test]
    fn loom_no_use_after_free() {
        loom::model(|| {
            let (fa, fb) = (
                Arc::new(AtomicBool::new(false)),
                Arc::new(AtomicBool::new(false)),
            );
            let a = Arc::new(Obj(fa.clone()));
            let b = Arc::new(Obj(fb.clone()));
            let (pa, pb) = (Arc::as_ptr(&a) as usize, Arc::as_ptr(&b) as usize);
            let t = Arc::new(HazardTable::new(1));
            t.replace(0, Some(a));
            let reader = {
                let (t, fa, fb) = (t.clone(), fa.clone(), fb.clone());
                loom::thread::spawn(move || {
                    if let Some(g) = t.protect(0) {
                        let p = &*g as *const Obj as usize;
                        let flag = if p == pa {
                            &fa
                        } else {
                            assert_eq!(p, pb);
                            &fb
                        };
                        assert!(!flag.load(Ordering::SeqCst), "used after free");
                        drop(g);
                    }
                })
            };
            t.replace(0, Some(b));
            reader.join().unwrap();
            // Without a reclaim here: the writer or the reader's guard
            // freed `a` (a reader that let it go after the writer's scan
            // reclaims itself).
            assert_eq!(t.retired_len(), 0, "a removed object left behind");
            drop(t);
            assert!(fa.load(Ordering::SeqCst) && fb.load(Ordering::SeqCst));
        });
    }
}
