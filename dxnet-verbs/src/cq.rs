//! Completion queues and completion channels.

use std::ffi::{c_int, c_void};
use std::fmt;
use std::os::fd::RawFd;
use std::ptr::{self, NonNull};
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::device::Context;
use crate::error::{Error, Result};
use crate::ffi;
use crate::wr::WorkCompletion;

pub(crate) struct ChannelInner {
    ctx: Context,
    raw: NonNull<ffi::ibv_comp_channel>,
}

// SAFETY: thread-safe libibverbs object; freed only in Drop.
unsafe impl Send for ChannelInner {}
// SAFETY: see Send.
unsafe impl Sync for ChannelInner {}

impl Drop for ChannelInner {
    fn drop(&mut self) {
        // SAFETY: every CQ using the channel holds an Arc to it.
        unsafe { (self.ctx.fns().destroy_comp_channel)(self.raw.as_ptr()) };
    }
}

/// A completion channel (`struct ibv_comp_channel`): a file descriptor that
/// becomes readable when an armed CQ gets a completion.
#[derive(Clone)]
pub struct CompletionChannel {
    inner: Arc<ChannelInner>,
}

impl fmt::Debug for CompletionChannel {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CompletionChannel")
            .field("fd", &self.fd())
            .finish()
    }
}

impl CompletionChannel {
    /// The file descriptor (for poll/epoll; blocking by default).
    pub fn fd(&self) -> RawFd {
        // SAFETY: the channel stays valid while `self` exists.
        unsafe { (*self.inner.raw.as_ptr()).fd }
    }

    /// Waits for the next completion event (blocking unless the fd was made
    /// non-blocking, then `EAGAIN`) and returns the [`CompletionQueue::id`]
    /// of the CQ that fired. The event is acknowledged at once. Re-arm the CQ
    /// with [`CompletionQueue::req_notify`] and poll it afterwards.
    pub fn wait(&self) -> Result<usize> {
        let mut cq: *mut ffi::ibv_cq = ptr::null_mut();
        let mut cq_ctx: *mut c_void = ptr::null_mut();
        // SAFETY: live channel; valid out pointers.
        let ret = unsafe {
            (self.inner.ctx.fns().get_cq_event)(self.inner.raw.as_ptr(), &mut cq, &mut cq_ctx)
        };
        if ret != 0 {
            return Err(Error::last_os("ibv_get_cq_event"));
        }
        // SAFETY: `cq` was just returned by ibv_get_cq_event and cannot be
        // destroyed before this event is acknowledged.
        unsafe { (self.inner.ctx.fns().ack_cq_events)(cq, 1) };
        Ok(cq as usize)
    }

    /// Like [`wait`](Self::wait), but gives up after `timeout` (`None`:
    /// wait forever) and then returns `Ok(None)`.
    pub fn wait_timeout(&self, timeout: Option<Duration>) -> Result<Option<usize>> {
        let deadline = timeout.map(|t| Instant::now() + t);
        loop {
            let ms: c_int = match deadline {
                None => -1,
                Some(d) => {
                    let left = d.saturating_duration_since(Instant::now());
                    // round up, so that a short wait does not spin
                    left.as_micros().div_ceil(1000).min(c_int::MAX as u128) as c_int
                }
            };
            let mut pfd = libc::pollfd {
                fd: self.fd(),
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: one valid pollfd for the duration of the call.
            let r = unsafe { libc::poll(&mut pfd, 1, ms) };
            if r > 0 {
                return self.wait().map(Some);
            }
            if r == 0 {
                return Ok(None);
            }
            let errno = std::io::Error::last_os_error()
                .raw_os_error()
                .unwrap_or(libc::EIO);
            if errno != libc::EINTR {
                return Err(Error::verbs("poll", errno));
            }
        }
    }
}

pub(crate) struct CqInner {
    pub(crate) ctx: Context,
    pub(crate) raw: NonNull<ffi::ibv_cq>,
    _channel: Option<Arc<ChannelInner>>,
}

// SAFETY: thread-safe libibverbs object (providers lock their CQs); freed
// only in Drop.
unsafe impl Send for CqInner {}
// SAFETY: see Send.
unsafe impl Sync for CqInner {}

impl Drop for CqInner {
    fn drop(&mut self) {
        // SAFETY: QPs using the CQ hold an Arc to it; events are acknowledged
        // as soon as they are read, so destroy does not wait.
        unsafe { (self.ctx.fns().destroy_cq)(self.raw.as_ptr()) };
    }
}

/// A completion queue (`struct ibv_cq`). Cheap to clone.
#[derive(Clone)]
pub struct CompletionQueue {
    pub(crate) inner: Arc<CqInner>,
}

impl fmt::Debug for CompletionQueue {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CompletionQueue")
            .field("capacity", &self.capacity())
            .finish()
    }
}

impl Context {
    /// Creates a completion channel.
    pub fn create_comp_channel(&self) -> Result<CompletionChannel> {
        // SAFETY: live context.
        let raw = unsafe { (self.fns().create_comp_channel)(self.as_raw()) };
        let raw = NonNull::new(raw).ok_or_else(|| Error::last_os("ibv_create_comp_channel"))?;
        Ok(CompletionChannel {
            inner: Arc::new(ChannelInner {
                ctx: self.clone(),
                raw,
            }),
        })
    }

    /// Creates a CQ with room for at least `min_entries` completions,
    /// optionally reporting events to `channel`.
    pub fn create_cq(
        &self,
        min_entries: u32,
        channel: Option<&CompletionChannel>,
    ) -> Result<CompletionQueue> {
        let cqe = c_int::try_from(min_entries)
            .ok()
            .filter(|n| *n > 0)
            .ok_or_else(|| Error::InvalidArgument(format!("CQ size {min_entries}")))?;
        let ch = channel.map_or(ptr::null_mut(), |c| c.inner.raw.as_ptr());
        // SAFETY: live context; the channel (if any) belongs to it and is
        // kept alive by the CQ.
        let raw = unsafe { (self.fns().create_cq)(self.as_raw(), cqe, ptr::null_mut(), ch, 0) };
        let raw = NonNull::new(raw).ok_or_else(|| Error::last_os("ibv_create_cq"))?;
        Ok(CompletionQueue {
            inner: Arc::new(CqInner {
                ctx: self.clone(),
                raw,
                _channel: channel.map(|c| c.inner.clone()),
            }),
        })
    }
}

impl CompletionQueue {
    /// Polls up to `out.len()` completions into `out`; returns how many.
    #[inline]
    pub fn poll(&self, out: &mut [WorkCompletion]) -> Result<usize> {
        let n = c_int::try_from(out.len()).unwrap_or(c_int::MAX);
        // SAFETY: live CQ; WorkCompletion is repr(transparent) over ibv_wc
        // and `out` has room for `n` of them.
        let ret = unsafe {
            ffi::poll_cq(
                self.inner.raw.as_ptr(),
                n,
                out.as_mut_ptr().cast::<ffi::ibv_wc>(),
            )
        };
        if ret < 0 {
            return Err(Error::verbs("ibv_poll_cq", ffi::ret_to_errno(ret)));
        }
        Ok(ret as usize)
    }

    /// Arms the CQ: the next completion (or next solicited one) triggers an
    /// event on its channel.
    pub fn req_notify(&self, solicited_only: bool) -> Result<()> {
        // SAFETY: live CQ.
        let ret = unsafe { ffi::req_notify_cq(self.inner.raw.as_ptr(), solicited_only) };
        if ret != 0 {
            return Err(Error::verbs("ibv_req_notify_cq", ffi::ret_to_errno(ret)));
        }
        Ok(())
    }

    /// Number of entries the CQ actually has (≥ the requested size).
    pub fn capacity(&self) -> u32 {
        // SAFETY: the ibv_cq stays valid while `self` exists.
        unsafe { (*self.inner.raw.as_ptr()).cqe.max(0) as u32 }
    }

    /// Identity of this CQ, as returned by [`CompletionChannel::wait`].
    pub fn id(&self) -> usize {
        self.inner.raw.as_ptr() as usize
    }

    /// The raw CQ pointer.
    pub fn as_raw(&self) -> *mut ffi::ibv_cq {
        self.inner.raw.as_ptr()
    }
}
