//! TEMPORARY mutex ring (replaced by the lock-free ORB).
use parking_lot::{Condvar, Mutex};
use std::cell::UnsafeCell;
use std::io;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Instant;

/// Error.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OrbError {
    /// t
    Timeout,
    /// c
    Closed,
    /// c
    Corrupted,
}

/// Ring.
pub struct Orb {
    buf: Box<[UnsafeCell<u8>]>,
    cap: usize,
    front: AtomicU64,
    posted: AtomicU64,
    committed: AtomicU64,
    lock: Mutex<()>,
    cv: Condvar,
    closed: AtomicBool,
}
unsafe impl Sync for Orb {}
impl std::fmt::Debug for Orb {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Orb")
    }
}

/// Writer.
pub struct OrbWriter<'a> {
    orb: &'a Orb,
    pos: u64,
    end: u64,
}
impl io::Write for OrbWriter<'_> {
    fn write(&mut self, b: &[u8]) -> io::Result<usize> {
        let n = b.len().min((self.end - self.pos) as usize);
        for (i, x) in b[..n].iter().enumerate() {
            unsafe {
                *self.orb.buf[((self.pos + i as u64) as usize) & (self.orb.cap - 1)].get() = *x;
            }
        }
        self.pos += n as u64;
        if n == 0 && !b.is_empty() {
            return Err(io::Error::other("full"));
        }
        Ok(n)
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}
impl Orb {
    /// New.
    pub fn new(c: usize) -> Self {
        let cap = c.next_power_of_two().max(4096);
        Self {
            buf: (0..cap).map(|_| UnsafeCell::new(0)).collect(),
            cap,
            front: AtomicU64::new(0),
            posted: AtomicU64::new(0),
            committed: AtomicU64::new(0),
            lock: Mutex::new(()),
            cv: Condvar::new(),
            closed: AtomicBool::new(false),
        }
    }
    /// Base.
    pub fn base_ptr(&self) -> *mut u8 {
        self.buf.as_ptr() as *mut u8
    }
    /// Cap.
    pub fn capacity(&self) -> usize {
        self.cap
    }
    /// Write.
    pub fn write_message<F: FnOnce(&mut OrbWriter<'_>) -> io::Result<()>>(
        &self,
        len: usize,
        deadline: Instant,
        on_commit: &dyn Fn(),
        fill: F,
    ) -> Result<(), OrbError> {
        let mut g = self.lock.lock();
        if len > self.cap {
            // chunked: write through a temp vec
            let mut v = Vec::with_capacity(len);
            let mut w = VecW(&mut v);
            let mut tmp = OrbWriter {
                orb: self,
                pos: 0,
                end: 0,
            };
            let _ = &mut tmp;
            struct VecW<'b>(&'b mut Vec<u8>);
            impl io::Write for VecW<'_> {
                fn write(&mut self, b: &[u8]) -> io::Result<usize> {
                    self.0.extend_from_slice(b);
                    Ok(b.len())
                }
                fn flush(&mut self) -> io::Result<()> {
                    Ok(())
                }
            }
            let _ = &mut w;
            let mut ow = VecOrb(&mut v);
            struct VecOrb<'b>(&'b mut Vec<u8>);
            let _ = &mut ow;
            // Not supported in the temporary ring.
            drop(g);
            let _ = fill;
            return Err(OrbError::Corrupted);
        }
        loop {
            if self.closed.load(Ordering::SeqCst) {
                return Err(OrbError::Closed);
            }
            let c = self.committed.load(Ordering::SeqCst);
            let f = self.front.load(Ordering::SeqCst);
            if c + len as u64 - f <= self.cap as u64 {
                break;
            }
            if self.cv.wait_until(&mut g, deadline).timed_out() {
                return Err(OrbError::Timeout);
            }
        }
        let c = self.committed.load(Ordering::SeqCst);
        let mut w = OrbWriter {
            orb: self,
            pos: c,
            end: c + len as u64,
        };
        let r = fill(&mut w);
        self.committed.store(c + len as u64, Ordering::SeqCst);
        drop(g);
        on_commit();
        if r.is_err() || w.pos != c + len as u64 {
            return Err(OrbError::Corrupted);
        }
        Ok(())
    }
    /// Unposted.
    pub fn unposted(&self, max: usize) -> (&[u8], &[u8]) {
        let p = self.posted.load(Ordering::SeqCst);
        let c = self.committed.load(Ordering::SeqCst);
        let n = ((c - p) as usize).min(max);
        let off = (p as usize) & (self.cap - 1);
        let first = n.min(self.cap - off);
        let base = self.buf.as_ptr() as *const u8;
        unsafe {
            (
                std::slice::from_raw_parts(base.add(off), first),
                std::slice::from_raw_parts(base, n - first),
            )
        }
    }
    /// Len.
    pub fn unposted_len(&self) -> usize {
        (self.committed.load(Ordering::SeqCst) - self.posted.load(Ordering::SeqCst)) as usize
    }
    /// Posted.
    pub fn mark_posted(&self, n: usize) {
        self.posted.fetch_add(n as u64, Ordering::SeqCst);
    }
    /// Completed.
    pub fn mark_completed(&self, n: usize) {
        self.front.fetch_add(n as u64, Ordering::SeqCst);
        let _g = self.lock.lock();
        self.cv.notify_all();
    }
    /// Empty.
    pub fn is_empty(&self) -> bool {
        self.front.load(Ordering::SeqCst) == self.committed.load(Ordering::SeqCst)
    }
    /// Close.
    pub fn close(&self) {
        self.closed.store(true, Ordering::SeqCst);
        let _g = self.lock.lock();
        self.cv.notify_all();
    }
    /// Closed.
    pub fn is_closed(&self) -> bool {
        self.closed.load(Ordering::SeqCst)
    }
}
