//! The control channel between the coordinator and its node processes:
//! one JSON object per line over a Unix socket (local processes, also across
//! network namespaces, and invisible to the interface counters) or TCP
//! (one node per host).
//!
//! Every command is a barrier: the coordinator sends it to all processes and
//! waits for every reply before the next phase starts.

use std::io::{self, BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::os::unix::net::{UnixListener, UnixStream};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use serde::{de::DeserializeOwned, Deserialize, Serialize};

use crate::binding::BindingSetup;
use crate::config::RunSpec;
use crate::metrics::ProcResult;

/// Coordinator → node process.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "cmd", rename_all = "snake_case")]
pub enum Command {
    /// Initialize phase: create the binding instances of the process's nodes.
    Init {
        /// Binding and node map (boxed: by far the largest command).
        setup: Box<BindingSetup>,
    },
    /// Connect phase.
    Connect,
    /// Prepare phase: allocate payloads for a run.
    Prepare {
        /// The run.
        run: RunSpec,
    },
    /// Warm-up: the operation with the warm-up count, not measured.
    Warmup,
    /// One measured repetition (answered with `Ok`).
    Measure {
        /// Repetition index.
        repetition: u32,
    },
    /// After every process finished `Measure`: read CPU time and wire
    /// counters and report the repetition (answered with `Measured`).
    Collect,
    /// Cleanup phase: shut the bindings down.
    Cleanup,
    /// Leave the process.
    Exit,
}

/// Node process → coordinator.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "reply", rename_all = "snake_case")]
pub enum Reply {
    /// First message after connecting.
    Hello {
        /// The logical node ids the process hosts.
        ids: Vec<u16>,
        /// Process id.
        pid: u32,
        /// The CPUs the process may run on (`--bind-nodes`: its share).
        #[serde(default)]
        cpus: Vec<usize>,
    },
    /// The phase is done.
    Ok,
    /// A measured repetition's results.
    Measured {
        /// What the process measured.
        result: ProcResult,
    },
    /// The phase failed.
    Failed {
        /// Why.
        error: String,
    },
}

enum Stream {
    Tcp(TcpStream),
    Unix(UnixStream),
}

impl Stream {
    fn try_clone(&self) -> io::Result<Stream> {
        Ok(match self {
            Stream::Tcp(s) => Stream::Tcp(s.try_clone()?),
            Stream::Unix(s) => Stream::Unix(s.try_clone()?),
        })
    }

    fn set_read_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        match self {
            Stream::Tcp(s) => s.set_read_timeout(t),
            Stream::Unix(s) => s.set_read_timeout(t),
        }
    }
}

impl Read for Stream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Stream::Tcp(s) => s.read(buf),
            Stream::Unix(s) => s.read(buf),
        }
    }
}

impl Write for Stream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        match self {
            Stream::Tcp(s) => s.write(buf),
            Stream::Unix(s) => s.write(buf),
        }
    }
    fn flush(&mut self) -> io::Result<()> {
        match self {
            Stream::Tcp(s) => s.flush(),
            Stream::Unix(s) => s.flush(),
        }
    }
}

/// A line-delimited JSON connection.
pub struct Channel {
    reader: BufReader<Stream>,
    writer: Stream,
    line: String,
}

impl Channel {
    fn new(s: Stream) -> io::Result<Self> {
        Ok(Channel {
            writer: s.try_clone()?,
            reader: BufReader::new(s),
            line: String::new(),
        })
    }

    /// Connects to `addr` (`unix:PATH` or `tcp:HOST:PORT`), retrying until
    /// `timeout` (the coordinator of a multi-host run may start later).
    pub fn connect(addr: &str, timeout: Duration) -> Result<Self> {
        let deadline = Instant::now() + timeout;
        loop {
            let r = if let Some(p) = addr.strip_prefix("unix:") {
                UnixStream::connect(p).map(Stream::Unix)
            } else {
                let a = addr.strip_prefix("tcp:").unwrap_or(addr);
                TcpStream::connect(a).map(|s| {
                    let _ = s.set_nodelay(true);
                    Stream::Tcp(s)
                })
            };
            match r {
                Ok(s) => return Ok(Channel::new(s)?),
                Err(e) if Instant::now() >= deadline => {
                    return Err(e).with_context(|| format!("cannot reach coordinator {addr}"))
                }
                Err(_) => std::thread::sleep(Duration::from_millis(50)),
            }
        }
    }

    /// Sends one message.
    pub fn send<T: Serialize>(&mut self, msg: &T) -> Result<()> {
        let mut v = serde_json::to_vec(msg)?;
        v.push(b'\n');
        self.writer.write_all(&v)?;
        self.writer.flush()?;
        Ok(())
    }

    /// Receives one message, waiting at most `timeout` (forever if `None`).
    pub fn recv<T: DeserializeOwned>(&mut self, timeout: Option<Duration>) -> Result<T> {
        self.reader.get_ref().set_read_timeout(timeout)?;
        self.line.clear();
        let n = self.reader.read_line(&mut self.line).map_err(|e| {
            if matches!(
                e.kind(),
                io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
            ) {
                anyhow!("no answer within {:?}", timeout.unwrap_or_default())
            } else {
                anyhow!(e)
            }
        })?;
        if n == 0 {
            bail!("connection closed");
        }
        serde_json::from_str(&self.line)
            .with_context(|| format!("bad control message {:?}", self.line.trim()))
    }
}

/// The coordinator's listening socket.
pub enum Listener {
    /// TCP (multi-host).
    Tcp(TcpListener),
    /// Unix socket (local processes); the file is removed on drop.
    Unix(UnixListener, PathBuf),
}

impl Listener {
    /// Listens on a fresh Unix socket in the temp directory.
    pub fn unix(tag: &str) -> Result<Self> {
        let path =
            std::env::temp_dir().join(format!("dxnet-bench-{}-{tag}.sock", std::process::id()));
        let _ = std::fs::remove_file(&path);
        let l =
            UnixListener::bind(&path).with_context(|| format!("cannot bind {}", path.display()))?;
        l.set_nonblocking(true)?;
        Ok(Listener::Unix(l, path))
    }

    /// Listens on TCP `addr`.
    pub fn tcp(addr: &str) -> Result<Self> {
        let l = TcpListener::bind(addr).with_context(|| format!("cannot listen on {addr}"))?;
        l.set_nonblocking(true)?;
        Ok(Listener::Tcp(l))
    }

    /// The address node processes connect to.
    pub fn address(&self) -> Result<String> {
        Ok(match self {
            Listener::Tcp(l) => format!("tcp:{}", l.local_addr()?),
            Listener::Unix(_, p) => format!("unix:{}", p.display()),
        })
    }

    /// Accepts one connection within `timeout`. `alive` is polled meanwhile
    /// so that a node process that dies early fails fast.
    pub fn accept(
        &self,
        timeout: Duration,
        mut alive: impl FnMut() -> Result<()>,
    ) -> Result<Channel> {
        let deadline = Instant::now() + timeout;
        loop {
            let r = match self {
                Listener::Tcp(l) => l.accept().map(|(s, _)| {
                    let _ = s.set_nodelay(true);
                    s.set_nonblocking(false).map(|_| Stream::Tcp(s))
                }),
                Listener::Unix(l, _) => l
                    .accept()
                    .map(|(s, _)| s.set_nonblocking(false).map(|_| Stream::Unix(s))),
            };
            match r {
                Ok(s) => return Ok(Channel::new(s?)?),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    alive()?;
                    if Instant::now() >= deadline {
                        bail!("node processes did not connect within {timeout:?}");
                    }
                    std::thread::sleep(Duration::from_millis(5));
                }
                Err(e) => return Err(e.into()),
            }
        }
    }
}

impl Drop for Listener {
    fn drop(&mut self) {
        if let Listener::Unix(_, p) = self {
            let _ = std::fs::remove_file(p);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn roundtrip_over_unix_socket() {
        let l = Listener::unix("prototest").unwrap();
        let addr = l.address().unwrap();
        let h = std::thread::spawn(move || {
            let mut c = Channel::connect(&addr, Duration::from_secs(5)).unwrap();
            c.send(&Reply::Hello {
                ids: vec![3],
                pid: 1,
                cpus: vec![0, 1],
            })
            .unwrap();
            let cmd: Command = c.recv(None).unwrap();
            assert_eq!(cmd, Command::Measure { repetition: 2 });
            c.send(&Reply::Ok).unwrap();
        });
        let mut c = l.accept(Duration::from_secs(5), || Ok(())).unwrap();
        let hello: Reply = c.recv(Some(Duration::from_secs(5))).unwrap();
        assert_eq!(
            hello,
            Reply::Hello {
                ids: vec![3],
                pid: 1,
                cpus: vec![0, 1],
            }
        );
        c.send(&Command::Measure { repetition: 2 }).unwrap();
        assert_eq!(
            c.recv::<Reply>(Some(Duration::from_secs(5))).unwrap(),
            Reply::Ok
        );
        h.join().unwrap();
        assert!(c.recv::<Reply>(Some(Duration::from_secs(5))).is_err());
    }
}
