//! The producer's writer: [`OrbWriter`] fills a reserved span of the ring
//! (and, for a chunked message, one chunk after another).

use super::*;

/// How much of a chunked message's `remaining` bytes to take when `free`
/// bytes are free: as much as possible, but never leaving a tail shorter
/// than [`MIN_MESSAGE_LEN`] (every span must fill its own commit slot).
pub(super) fn chunk_len(free: u64, remaining: u64) -> u64 {
    let take = free.min(remaining);
    let min = MIN_MESSAGE_LEN as u64;
    if take < remaining && remaining - take < min {
        remaining - min
    } else {
        take
    }
}

/// Writes one message into its reserved span of the ring ([`io::Write`]).
///
/// For a chunked message, a write that finds the current chunk full commits
/// it, calls `on_commit` and blocks until the consumer frees the next chunk.
pub struct OrbWriter<'a> {
    orb: &'a Orb,
    /// Next position to write.
    pos: u64,
    /// The reserved, not yet committed span `[chunk_start, chunk_end)`.
    chunk_start: u64,
    chunk_end: u64,
    /// End of the whole message (its bytes are contiguous in position space,
    /// since an exclusive writer's chunks follow each other).
    msg_end: u64,
    /// Whether this writer holds the exclusive flag.
    exclusive: bool,
    /// A write tried to go past `msg_end`.
    overflow: bool,
    /// Reserving a later chunk failed (Corrupted or Closed).
    failure: Option<OrbError>,
    deadline: &'a Deadline,
    on_commit: &'a dyn Fn(),
}

impl<'a> OrbWriter<'a> {
    pub(super) fn new(
        orb: &'a Orb,
        start: u64,
        chunk_end: u64,
        msg_end: u64,
        exclusive: bool,
        deadline: &'a Deadline,
        on_commit: &'a dyn Fn(),
    ) -> Self {
        OrbWriter {
            orb,
            pos: start,
            chunk_start: start,
            chunk_end,
            msg_end,
            exclusive,
            overflow: false,
            failure: None,
            deadline,
            on_commit,
        }
    }

    /// The position after the message.
    pub(crate) fn msg_end(&self) -> u64 {
        self.msg_end
    }

    /// Bytes of the message still to be written.
    #[cfg(all(test, not(loom)))]
    pub fn remaining(&self) -> usize {
        (self.msg_end - self.pos) as usize
    }

    /// Reserves the next chunk of an exclusive writer (nothing pending).
    /// Waits for `min(remaining, capacity / 4)` free bytes, so chunks are not
    /// uselessly small, and takes as much as is free.
    pub(super) fn reserve_chunk(&mut self) -> Result<(), OrbError> {
        debug_assert!(self.exclusive && self.chunk_start == self.chunk_end);
        let orb = self.orb;
        let cap = orb.capacity() as u64;
        let from = self.chunk_end;
        let remaining = self.msg_end - from;
        let need = remaining.min(cap / 4);
        let take = orb.wait_for(self.deadline, true, || {
            // Nobody else reserves while we hold the flag, and
            // `front <= from`. Acquire: see `try_reserve`.
            let free = cap.saturating_sub(from - orb.front.load(Ordering::Acquire));
            (free >= need).then(|| chunk_len(free, remaining))
        })?;
        self.chunk_end = from + take;
        if self.chunk_end == self.msg_end {
            // Last chunk: let other producers reserve behind us already.
            orb.reserved.pos.store(self.chunk_end, Ordering::Release);
            self.exclusive = false;
            orb.wake_waiters();
        } else {
            orb.reserved
                .pos
                .store(self.chunk_end | EXCLUSIVE, Ordering::Release);
        }
        Ok(())
    }

    /// Commits the pending span, if any.
    fn commit_pending(&mut self) -> bool {
        if self.chunk_start == self.chunk_end {
            return false;
        }
        self.orb.commit(self.chunk_start, self.chunk_end);
        self.chunk_start = self.chunk_end;
        true
    }

    /// The current chunk is full: commit it and reserve the next one.
    fn next_chunk(&mut self) -> io::Result<()> {
        self.commit_pending();
        (self.on_commit)();
        match self.reserve_chunk() {
            Ok(()) => Ok(()),
            Err(e) => {
                // Part of the message is committed already.
                let e = if e == OrbError::Timeout {
                    self.orb.close();
                    OrbError::Corrupted
                } else {
                    e
                };
                self.failure = Some(e);
                Err(io::Error::other(e))
            }
        }
    }

    /// Commits the rest after `fill` returned and decides the outcome.
    /// (By reference: moving the writer into the call copied it through
    /// the stack on every message.)
    #[inline]
    pub(super) fn finish(&mut self, fill_result: io::Result<()>) -> Result<(), OrbError> {
        if let Some(e) = self.failure {
            // Nothing pending; Drop clears the exclusive flag.
            return Err(e);
        }
        let complete = fill_result.is_ok() && !self.overflow && self.pos == self.msg_end;
        if self.commit_pending() {
            (self.on_commit)();
        }
        if complete {
            Ok(())
        } else {
            self.orb.close();
            Err(OrbError::Corrupted)
        }
    }
}

impl io::Write for OrbWriter<'_> {
    fn write(&mut self, data: &[u8]) -> io::Result<usize> {
        if data.is_empty() {
            return Ok(0);
        }
        if let Some(e) = self.failure {
            return Err(io::Error::other(e));
        }
        if self.pos == self.chunk_end {
            if self.pos == self.msg_end {
                self.overflow = true;
                return Err(io::Error::new(
                    io::ErrorKind::WriteZero,
                    "write past the announced message length",
                ));
            }
            self.next_chunk()?;
        }
        let n = data.len().min((self.chunk_end - self.pos) as usize);
        // SAFETY: `[pos, pos + n)` lies inside `[chunk_start, chunk_end)`,
        // which this writer reserved (CAS on `reserved`, or under the
        // exclusive flag) and has not committed; reservations never exceed
        // `front + capacity`, so the consumer no longer reads these bytes.
        unsafe { self.orb.copy_in(self.pos, &data[..n]) };
        self.pos += n as u64;
        Ok(n)
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl Drop for OrbWriter<'_> {
    fn drop(&mut self) {
        if self.chunk_start != self.chunk_end {
            // Only when `fill` panicked: publish the garbage anyway (the
            // consumer cannot pass an unpublished span) and close the
            // broken stream.
            self.orb.close();
            self.commit_pending();
        }
        if self.exclusive {
            self.orb
                .reserved
                .pos
                .fetch_and(!EXCLUSIVE, Ordering::AcqRel);
            self.orb.wake_waiters();
        }
    }
}

impl fmt::Debug for OrbWriter<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OrbWriter")
            .field("pos", &self.pos)
            .field("chunk", &(self.chunk_start..self.chunk_end))
            .field("msg_end", &self.msg_end)
            .finish()
    }
}
