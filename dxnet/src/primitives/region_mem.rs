//! Address-stable, page-aligned memory that other nodes may write and read
//! (an exposed region's bytes).
//!
//! The bytes are never reachable through a Rust reference that outlives a
//! lock: every CPU access (the owner's local reads and writes, and
//! one-sided operations an engine emulates) copies under the block's
//! read-write lock, so CPU accesses never race. An RDMA device writes and
//! reads the memory by DMA, outside the lock and outside the Rust memory
//! model; a CPU read overlapping such a write may see any mix of old and
//! new bytes (every bit pattern is a valid `u8`), which is the documented
//! behaviour of one-sided writes everywhere.

use std::alloc::{alloc_zeroed, dealloc, Layout};
use std::ptr::NonNull;

use parking_lot::{Condvar, Mutex};

use super::orb;

/// Alignment of a block: a page, as RDMA registration prefers.
const ALIGN: usize = 4096;

/// A zeroed, page-aligned block of `len` bytes at a fixed address.
pub struct MemBlock {
    ptr: NonNull<u8>,
    len: usize,
    layout: Layout,
    /// Serializes CPU accesses (see the module docs) and knows whether the
    /// block is closed.
    lock: AccessLock,
}

/// Why an access to a [`MemBlock`] did nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MemError {
    /// The range is not inside the block.
    OutOfRange,
    /// The block was closed.
    Closed,
}

// SAFETY: the block owns its allocation; every access to the bytes goes
// through `&self` methods that hold `lock` (shared for reads, exclusive for
// writes), so sharing and sending the block between threads is sound.
unsafe impl Send for MemBlock {}
// SAFETY: as for `Send`.
unsafe impl Sync for MemBlock {}

impl std::fmt::Debug for MemBlock {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemBlock")
            .field("ptr", &self.ptr)
            .field("len", &self.len)
            .finish()
    }
}

impl MemBlock {
    /// Allocates `len` zeroed bytes; `None` if `len` is 0 or the memory
    /// cannot be had.
    pub fn new(len: usize) -> Option<MemBlock> {
        if len == 0 {
            return None;
        }
        let layout = Layout::from_size_align(len, ALIGN).ok()?;
        // SAFETY: `layout` has a non-zero size.
        let ptr = NonNull::new(unsafe { alloc_zeroed(layout) })?;
        Some(MemBlock {
            ptr,
            len,
            layout,
            lock: AccessLock::default(),
        })
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// The first byte's address (for RDMA registration).
    #[cfg_attr(not(feature = "ib"), allow(dead_code))]
    pub fn as_ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// Copies `buf.len()` bytes starting at `offset` into `buf`.
    pub fn read(&self, offset: usize, buf: &mut [u8]) -> Result<(), MemError> {
        self.with_bytes(offset, buf.len(), |src| buf.copy_from_slice(src))
    }

    /// Copies `data` into the block at `offset`.
    pub fn write(&self, offset: usize, data: &[u8]) -> Result<(), MemError> {
        self.write_vectored(offset, &[data])
    }

    /// Copies `parts` one after the other into the block from `offset`,
    /// under one lock.
    pub fn write_vectored(&self, offset: usize, parts: &[&[u8]]) -> Result<(), MemError> {
        let len = parts
            .iter()
            .try_fold(0usize, |n, p| n.checked_add(p.len()))
            .ok_or(MemError::OutOfRange)?;
        if !self.contains(offset, len) {
            return Err(MemError::OutOfRange);
        }
        let _writing = self.lock.write()?;
        let mut at = offset;
        for p in parts {
            // SAFETY: `[offset, offset + len)` is inside the allocation
            // (checked above) and the parts fill it in turn; the exclusive
            // lock keeps every other CPU access out; a part is a caller's
            // slice, which cannot overlap the block: the block's bytes are
            // never lent out past a lock (see `with_bytes`).
            unsafe {
                std::ptr::copy_nonoverlapping(p.as_ptr(), self.ptr.as_ptr().add(at), p.len())
            };
            at += p.len();
        }
        Ok(())
    }

    /// Runs `f` on the `len` bytes at `offset` under the shared lock (no CPU
    /// write meanwhile).
    ///
    /// A reader queues behind a writer that waits for other readers, so a
    /// stream of reads does not keep writers out; readers waiting when a
    /// write ends go before the next writer, so a stream of writes does not
    /// keep readers out. A reader that is filling a span it reserved in a
    /// ring buffer ([`orb::filling`]) goes before waiting writers too: its
    /// reservation holds back the ring's later spans, and the reader already
    /// holding the block may be one that waits for ring space behind it
    /// (copying this block into the same ring); were the fill held back by
    /// a writer that waits for that reader, none of them would go on. So a
    /// writer (and [`MemBlock::close`]) waits while such fills overlap
    /// without a gap.
    pub fn with_bytes<R>(
        &self,
        offset: usize,
        len: usize,
        f: impl FnOnce(&[u8]) -> R,
    ) -> Result<R, MemError> {
        if !self.contains(offset, len) {
            return Err(MemError::OutOfRange);
        }
        let _reading = self.lock.read(orb::filling())?;
        // SAFETY: the range is inside the allocation; CPU writers need the
        // exclusive lock, so nothing the Rust model knows of writes these
        // bytes while `f` borrows them, and the borrow ends with the lock.
        // (An RDMA device may write them meanwhile: see the module docs.)
        let bytes = unsafe { std::slice::from_raw_parts(self.ptr.as_ptr().add(offset), len) };
        Ok(f(bytes))
    }

    /// Closes the block: later accesses fail with [`MemError::Closed`].
    /// Returns once no access runs any more.
    pub fn close(&self) {
        if let Ok(w) = self.lock.write() {
            w.close();
        }
    }

    fn contains(&self, offset: usize, len: usize) -> bool {
        offset.checked_add(len).is_some_and(|end| end <= self.len)
    }
}

/// The lock of a block's CPU accesses: shared for reads, exclusive for
/// writes, with a choice per read of whether it queues behind waiting
/// writers (see [`MemBlock::with_bytes`]; parking_lot's `RwLock` makes that
/// choice per lock type, not per call). Waiting readers and writers take
/// turns: plain readers waiting when a writer finishes go in before the
/// next writer, so neither side keeps the other out.
#[derive(Default)]
struct AccessLock {
    state: Mutex<AccessState>,
    changed: Condvar,
}

#[derive(Default)]
struct AccessState {
    readers: usize,
    writing: bool,
    writers_waiting: usize,
    /// Readers queued behind waiting writers.
    readers_waiting: usize,
    /// A writer finished while readers were queued: they go first.
    readers_turn: bool,
    closed: bool,
}

impl AccessLock {
    /// Shared access; `before_writers`: only a writer at work holds it
    /// back, not waiting ones.
    fn read(&self, before_writers: bool) -> Result<ReadGuard<'_>, MemError> {
        let mut s = self.state.lock();
        let held_back = |s: &AccessState| {
            s.writing || (!before_writers && s.writers_waiting > 0 && !s.readers_turn)
        };
        if held_back(&s) {
            // Counted, so that the write ending now gives this reader a
            // turn before the next writer (a filling one too: it holds
            // ring space that later sends wait for).
            s.readers_waiting += 1;
            while held_back(&s) {
                self.changed.wait(&mut s);
            }
            s.readers_waiting -= 1;
            if s.readers_waiting == 0 && s.readers_turn {
                s.readers_turn = false;
                // Writers held back by the turn: none is woken by this
                // reader's end if it does not take the block (closed).
                if s.closed {
                    drop(s);
                    self.changed.notify_all();
                    return Err(MemError::Closed);
                }
            }
        }
        if s.closed {
            return Err(MemError::Closed);
        }
        s.readers += 1;
        Ok(ReadGuard(self))
    }

    /// Exclusive access, after the readers whose turn it is.
    fn write(&self) -> Result<WriteGuard<'_>, MemError> {
        let mut s = self.state.lock();
        s.writers_waiting += 1;
        while s.writing || s.readers > 0 || (s.readers_turn && s.readers_waiting > 0) {
            self.changed.wait(&mut s);
        }
        s.writers_waiting -= 1;
        if s.closed {
            // Others queued behind this writer may go on.
            drop(s);
            self.changed.notify_all();
            return Err(MemError::Closed);
        }
        s.writing = true;
        Ok(WriteGuard(self))
    }
}

/// Shared access to a block's bytes while it lives.
struct ReadGuard<'a>(&'a AccessLock);

impl Drop for ReadGuard<'_> {
    fn drop(&mut self) {
        let mut s = self.0.state.lock();
        s.readers -= 1;
        let last = s.readers == 0;
        drop(s);
        if last {
            self.0.changed.notify_all();
        }
    }
}

/// Exclusive access to a block's bytes while it lives.
struct WriteGuard<'a>(&'a AccessLock);

impl WriteGuard<'_> {
    /// Later accesses fail with [`MemError::Closed`].
    fn close(self) {
        self.0.state.lock().closed = true;
    }
}

impl Drop for WriteGuard<'_> {
    fn drop(&mut self) {
        let mut s = self.0.state.lock();
        s.writing = false;
        if s.readers_waiting > 0 {
            s.readers_turn = true;
        }
        drop(s);
        self.0.changed.notify_all();
    }
}

impl Drop for MemBlock {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout, freed once.
        unsafe { dealloc(self.ptr.as_ptr(), self.layout) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::primitives::deadline::Deadline;
    use crate::primitives::orb::{Orb, MIN_CAPACITY};
    use std::io::Write;
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    use std::time::{Duration, Instant};

    fn waiting_writers(m: &MemBlock) -> usize {
        m.lock.state.lock().writers_waiting
    }

    fn waiting_readers(m: &MemBlock) -> usize {
        m.lock.state.lock().readers_waiting
    }

    /// Closing while a writer and then a reader queue behind the closer:
    /// both are let go (with `Closed`), in whatever order they wake, and
    /// later accesses fail at once. (The threads are not scoped: one that
    /// never wakes is left behind and the test fails instead of hanging.)
    #[test]
    fn accesses_queued_behind_a_close_are_let_go() {
        let m = std::sync::Arc::new(MemBlock::new(4096).unwrap());
        let spawn = |f: fn(&MemBlock) -> Result<(), MemError>| {
            let m = m.clone();
            std::thread::spawn(move || f(&m))
        };
        let (closer, writer, reader) = m
            .with_bytes(0, 8, |_| {
                let closer = spawn(|m| {
                    m.close();
                    Ok(())
                });
                while waiting_writers(&m) < 1 {
                    std::thread::yield_now();
                }
                let writer = spawn(|m| m.write(0, &[1; 8]));
                while waiting_writers(&m) < 2 {
                    std::thread::yield_now();
                }
                let reader = spawn(|m| m.read(0, &mut [0; 8]));
                while waiting_readers(&m) < 1 {
                    std::thread::yield_now();
                }
                (closer, writer, reader)
            })
            .unwrap();
        closer.join().unwrap().unwrap();
        let give_up = Instant::now() + Duration::from_secs(20);
        while !(writer.is_finished() && reader.is_finished()) && Instant::now() < give_up {
            std::thread::sleep(Duration::from_millis(1));
        }
        assert!(
            writer.is_finished() && reader.is_finished(),
            "an access queued behind the close never woke"
        );
        assert_eq!(writer.join().unwrap(), Err(MemError::Closed));
        assert_eq!(reader.join().unwrap(), Err(MemError::Closed));
        assert_eq!(m.write(0, &[1]), Err(MemError::Closed));
        assert_eq!(m.read(0, &mut [0]), Err(MemError::Closed));
    }

    /// A reader that holds the block while it waits for a second reader
    /// (as one waiting for ring space that the second one's reservation
    /// holds) is not stuck when a writer queued between them: the second
    /// reader, copying the block into a span it reserved in a ring, gets in
    /// past the waiting writer, and the writer writes once both are done.
    #[test]
    fn a_reader_filling_a_ring_span_is_not_held_behind_a_waiting_writer() {
        let m = MemBlock::new(4096).unwrap();
        let ring = Orb::new(MIN_CAPACITY);
        let (writing, second_done) = (AtomicBool::new(false), AtomicBool::new(false));
        std::thread::scope(|s| {
            let first = m
                .with_bytes(0, 8, |_| {
                    let writer = s.spawn(|| {
                        writing.store(true, Ordering::SeqCst);
                        m.write(0, &[9; 8]).unwrap()
                    });
                    // The second reader comes once the writer queued.
                    while !writing.load(Ordering::SeqCst) || waiting_writers(&m) == 0 {
                        std::thread::yield_now();
                    }
                    let second = s.spawn(|| {
                        let deadline = Deadline::at(Instant::now() + Duration::from_secs(30));
                        ring.write_message(8, &deadline, &|| {}, |w| {
                            m.with_bytes(0, 8, |b| {
                                assert_eq!(b, &[0; 8]);
                                w.write_all(b)
                            })
                            .unwrap()
                        })
                        .unwrap();
                        second_done.store(true, Ordering::SeqCst);
                    });
                    let give_up = Instant::now() + Duration::from_secs(20);
                    while !second_done.load(Ordering::SeqCst) && Instant::now() < give_up {
                        std::thread::sleep(Duration::from_millis(1));
                    }
                    (writer, second, second_done.load(Ordering::SeqCst))
                })
                .unwrap();
            let (writer, second, got_in) = first;
            assert!(got_in, "the filling reader waited behind the writer");
            second.join().unwrap();
            writer.join().unwrap();
        });
        let mut b = [0u8; 8];
        m.read(0, &mut b).unwrap();
        assert_eq!(b, [9; 8], "the writer wrote after the readers");
    }

    /// Readers that are not filling a ring span queue behind a waiting
    /// writer: two readers that take turns so that one always holds the
    /// block (each leaves once the other is back in, or after a second
    /// without it) do not keep a writer out.
    #[test]
    fn overlapping_plain_readers_do_not_keep_a_writer_out() {
        let m = MemBlock::new(4096).unwrap();
        let entries = AtomicUsize::new(0);
        let (chaining, written) = (AtomicBool::new(false), AtomicBool::new(false));
        let stop = Instant::now() + Duration::from_secs(20);
        let written_in_time = std::thread::scope(|s| {
            for _ in 0..2 {
                s.spawn(|| {
                    while !written.load(Ordering::SeqCst) && Instant::now() < stop {
                        m.with_bytes(0, 8, |_| {
                            let me = entries.fetch_add(1, Ordering::SeqCst);
                            chaining.store(me > 0, Ordering::SeqCst);
                            let leave = Instant::now() + Duration::from_secs(1);
                            while entries.load(Ordering::SeqCst) == me + 1
                                && !written.load(Ordering::SeqCst)
                                && Instant::now() < leave
                            {
                                std::hint::spin_loop();
                                std::thread::yield_now();
                            }
                        })
                        .unwrap();
                    }
                });
            }
            while !chaining.load(Ordering::SeqCst) {
                std::thread::yield_now();
            }
            let writer = s.spawn(|| {
                m.write(0, &[5; 8]).unwrap();
                let in_time = Instant::now() < stop;
                written.store(true, Ordering::SeqCst);
                in_time
            });
            writer.join().unwrap()
        });
        assert!(
            written_in_time,
            "the writer waited until the readers stopped"
        );
        let mut b = [0u8; 8];
        m.read(0, &mut b).unwrap();
        assert_eq!(b, [5; 8]);
    }

    /// Writers that keep one of them always waiting (two writing in turn)
    /// do not keep a reader out: the readers waiting when a write ends go
    /// before the next one.
    #[test]
    fn writers_in_turn_do_not_keep_a_reader_out() {
        let m = MemBlock::new(1 << 22).unwrap();
        let (writes, read) = (AtomicUsize::new(0), AtomicBool::new(false));
        let stop = Instant::now() + Duration::from_secs(20);
        let read_in_time = std::thread::scope(|s| {
            for w in 0..2u8 {
                let (m, writes, read) = (&m, &writes, &read);
                s.spawn(move || {
                    let data = vec![w; 1 << 22];
                    while !read.load(Ordering::SeqCst) && Instant::now() < stop {
                        m.write(0, &data).unwrap();
                        writes.fetch_add(1, Ordering::SeqCst);
                    }
                });
            }
            while writes.load(Ordering::SeqCst) < 4 {
                std::thread::yield_now();
            }
            let mut first = [0u8; 1];
            m.read(0, &mut first).unwrap();
            let in_time = Instant::now() < stop;
            read.store(true, Ordering::SeqCst);
            in_time
        });
        assert!(read_in_time, "the reader waited until the writers stopped");
    }

    #[test]
    fn zeroed_aligned_and_bounds_checked() {
        assert!(MemBlock::new(0).is_none());
        let m = MemBlock::new(10_000).unwrap();
        assert_eq!(m.ptr.as_ptr() as usize % ALIGN, 0);
        let mut all = vec![1u8; 10_000];
        m.read(0, &mut all).unwrap();
        assert!(all.iter().all(|&b| b == 0));
        m.write(9_990, &[7; 10]).unwrap();
        assert_eq!(m.write(9_991, &[7; 10]), Err(MemError::OutOfRange));
        m.write_vectored(0, &[&[1, 2], &[], &[3]]).unwrap();
        assert_eq!(
            m.write_vectored(9_998, &[&[1, 2], &[3]]),
            Err(MemError::OutOfRange)
        );
        let mut three = [0u8; 3];
        m.read(0, &mut three).unwrap();
        assert_eq!(three, [1, 2, 3]);
        m.write(0, &[0; 3]).unwrap();
        assert_eq!(m.write(usize::MAX, &[7; 2]), Err(MemError::OutOfRange));
        let mut b = [0u8; 11];
        assert_eq!(m.read(9_990, &mut b), Err(MemError::OutOfRange));
        m.read(9_989, &mut b).unwrap();
        assert_eq!(b, [0, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7]);
        assert_eq!(m.with_bytes(9_999, 1, |s| s[0]), Ok(7));
        assert_eq!(m.with_bytes(10_000, 0, |s| s.len()), Ok(0));
        assert_eq!(
            m.with_bytes(10_000, 1, |s| s.len()),
            Err(MemError::OutOfRange)
        );
        m.close();
        assert_eq!(m.write(0, &[1]), Err(MemError::Closed));
        assert_eq!(m.read(0, &mut b), Err(MemError::Closed));
    }

    #[test]
    fn concurrent_writers_and_readers_see_whole_writes() {
        let m = std::sync::Arc::new(MemBlock::new(4096).unwrap());
        let threads: Vec<_> = (0..4u8)
            .map(|t| {
                let m = m.clone();
                std::thread::spawn(move || {
                    for _ in 0..2000 {
                        m.write(0, &[t; 4096]).unwrap();
                        m.with_bytes(0, 4096, |s| assert!(s.iter().all(|&b| b == s[0])))
                            .unwrap();
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
    }
}
