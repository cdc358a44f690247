//! Error type of dxnet-verbs.

use std::fmt;

/// Everything that can go wrong in dxnet-verbs. The `Display` text is meant
/// to be shown to users as it is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Error {
    /// libibverbs could not be loaded (rdma-core is not installed).
    LibraryNotAvailable {
        /// The library name or path passed to `dlopen`.
        library: String,
        /// The loader's message.
        reason: String,
    },
    /// libibverbs was loaded but lacks a function this crate needs.
    MissingSymbol {
        /// The library name or path.
        library: String,
        /// The missing function.
        symbol: &'static str,
        /// The loader's message.
        reason: String,
    },
    /// libibverbs works but lists no RDMA device.
    NoDevice {
        /// Why the list is empty, when libibverbs said (e.g. the kernel has
        /// no RDMA support).
        detail: Option<String>,
    },
    /// A device was asked for by a name that does not exist.
    DeviceNotFound {
        /// The requested name.
        name: String,
        /// The devices that do exist.
        available: Vec<String>,
    },
    /// A verbs call failed with an errno.
    Verbs {
        /// The libibverbs function.
        call: &'static str,
        /// The errno value.
        errno: i32,
    },
    /// Posting a chain of work requests failed; the requests before
    /// `bad_index` were posted, it and those after it were not.
    Post {
        /// `ibv_post_send`, `ibv_post_recv` or `ibv_post_srq_recv`.
        call: &'static str,
        /// The errno value.
        errno: i32,
        /// Index in the chain of the first request that was not posted.
        bad_index: usize,
    },
    /// A work completion reported an error status.
    Completion {
        /// The work request id of the failed request.
        wr_id: u64,
        /// The `ibv_wc_status` value.
        status: u32,
        /// The provider's vendor error code.
        vendor_err: u32,
    },
    /// An argument was out of range or inconsistent.
    InvalidArgument(String),
}

/// Result with [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// The text of an errno value, e.g. "Cannot allocate memory (errno 12)".
pub fn errno_text(errno: i32) -> String {
    let io = std::io::Error::from_raw_os_error(errno);
    // std's text ends in " (os error N)": replace it by our own suffix.
    let text = io.to_string();
    let text = text.split(" (os error").next().unwrap_or(&text).to_string();
    format!("{text} (errno {errno})")
}

impl fmt::Display for Error {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Error::LibraryNotAvailable { library, reason } => write!(
                f,
                "libibverbs not available: cannot load {library} ({reason}); \
                 install rdma-core's libibverbs (Debian/Ubuntu: libibverbs1 ibverbs-providers)"
            ),
            Error::MissingSymbol { library, symbol, reason } => {
                write!(f, "libibverbs not available: {library} has no {symbol} ({reason})")
            }
            Error::NoDevice { detail: None } => write!(f, "no RDMA device found"),
            Error::NoDevice { detail: Some(d) } => write!(f, "no RDMA device found ({d})"),
            Error::DeviceNotFound { name, available } => {
                write!(f, "RDMA device '{name}' not found (available: {})", available.join(", "))
            }
            Error::Verbs { call, errno } => write!(f, "{call} failed: {}", errno_text(*errno)),
            Error::Post { call, errno, bad_index } => {
                write!(f, "{call} failed at work request {bad_index} of the chain: {}", errno_text(*errno))
            }
            Error::Completion { wr_id, status, vendor_err } => write!(
                f,
                "work request {wr_id} completed with error {} ({status}), vendor error {vendor_err:#x}",
                crate::wr::wc_status_name(*status)
            ),
            Error::InvalidArgument(msg) => write!(f, "invalid argument: {msg}"),
        }
    }
}

impl std::error::Error for Error {}

impl Error {
    /// The errno behind this error, if there is one.
    pub fn errno(&self) -> Option<i32> {
        match self {
            Error::Verbs { errno, .. } | Error::Post { errno, .. } => Some(*errno),
            _ => None,
        }
    }

    /// True when the problem is that this host has no usable RDMA at all
    /// (no libibverbs, or no device): callers may then fall back to another
    /// transport.
    pub fn is_unavailable(&self) -> bool {
        matches!(
            self,
            Error::LibraryNotAvailable { .. }
                | Error::MissingSymbol { .. }
                | Error::NoDevice { .. }
        )
    }

    pub(crate) fn verbs(call: &'static str, errno: i32) -> Error {
        Error::Verbs { call, errno }
    }

    /// `call` failed and left its reason in `errno`.
    pub(crate) fn last_os(call: &'static str) -> Error {
        let errno = std::io::Error::last_os_error()
            .raw_os_error()
            .filter(|e| *e != 0)
            .unwrap_or(libc::EIO);
        Error::Verbs { call, errno }
    }
}
