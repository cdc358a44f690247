//! `raw-tcp`: the TCP baseline, the analogue of `ib_send_bw` / `ib_send_lat`.
//!
//! Blocking sockets with `TCP_NODELAY`; one connection per (sender thread,
//! peer) so that sender threads never share a socket (like OSU's
//! multi-pair tests). Every message is a single `writev` of a 4-byte prefix
//! (length in bits 0..30, kind in bits 30..32) plus the payload: no batching,
//! no library. One reader thread per incoming connection reads into a large
//! buffer and parses frames. A request is answered on the same connection by
//! the reader thread; the requesting thread reads the response itself, so a
//! ping-pong is exactly one message each way.

use std::collections::HashMap;
use std::io::{self, IoSlice, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};

use super::{Binding, BindingSetup, Sink};

/// Frame prefix: payload length in bits 0..30, kind in bits 30..32.
pub(super) const LEN_MASK: u32 = (1 << 30) - 1;
/// A one-way message.
pub(super) const KIND_MSG: u32 = 0;
/// A request, answered by a [`KIND_RESP`] frame of the same payload.
pub(super) const KIND_REQ: u32 = 1;
/// A response.
pub(super) const KIND_RESP: u32 = 2;

/// One outgoing connection; `rbuf` holds responses read by the requester.
struct OutConn {
    stream: TcpStream,
    rbuf: Vec<u8>,
}

/// The raw TCP baseline binding of one node.
pub struct RawTcp {
    sockets: Arc<Sockets>,
    setup: BindingSetup,
    out: OnceLock<HashMap<u16, Vec<Mutex<OutConn>>>>,
}

pub(super) fn resolve(addr: &str) -> Result<SocketAddr> {
    addr.to_socket_addrs()
        .with_context(|| format!("cannot resolve {addr}"))?
        .next()
        .ok_or_else(|| anyhow!("no address for {addr}"))
}

/// What the TCP baselines share: a node's listener, every socket it opened
/// or accepted (so that shutdown can close them) and its reader threads.
pub(super) struct Sockets {
    me: u16,
    /// The binding's name, for thread names and error messages.
    name: &'static str,
    stop: AtomicBool,
    accepted: AtomicUsize,
    streams: Mutex<Vec<TcpStream>>,
    readers: Mutex<Vec<JoinHandle<()>>>,
    acceptor: Mutex<Option<JoinHandle<()>>>,
}

impl Sockets {
    /// Binds node `me`'s listener and accepts connections until shutdown.
    /// Every connection is handed to `on_accept` with the source node id and
    /// tag of its 4-byte hello (see [`Sockets::dial`]).
    pub(super) fn listen(
        setup: &BindingSetup,
        me: u16,
        name: &'static str,
        on_accept: impl Fn(&Arc<Sockets>, TcpStream, u16, u16) -> Result<()> + Send + 'static,
    ) -> Result<Arc<Self>> {
        let addr = setup
            .address(me)
            .ok_or_else(|| anyhow!("node {me} has no address"))?;
        let listener = TcpListener::bind(resolve(addr)?)
            .with_context(|| format!("cannot listen on {addr}"))?;
        // Non-blocking accept so that shutdown never hangs on a missing peer.
        listener.set_nonblocking(true)?;
        let sockets = Arc::new(Sockets {
            me,
            name,
            stop: AtomicBool::new(false),
            accepted: AtomicUsize::new(0),
            streams: Mutex::new(Vec::new()),
            readers: Mutex::new(Vec::new()),
            acceptor: Mutex::new(None),
        });
        let sh = sockets.clone();
        let acceptor = std::thread::Builder::new()
            .name(format!("{name}-accept-{me}"))
            .spawn(move || sh.accept_loop(listener, on_accept))?;
        *sockets.acceptor.lock().unwrap() = Some(acceptor);
        Ok(sockets)
    }

    fn accept_loop(
        self: &Arc<Self>,
        listener: TcpListener,
        on_accept: impl Fn(&Arc<Sockets>, TcpStream, u16, u16) -> Result<()>,
    ) {
        while !self.stopped() {
            match listener.accept() {
                Ok((stream, _)) => {
                    let r = self.hello(stream).and_then(|(stream, src, tag)| {
                        self.streams.lock().unwrap().push(stream.try_clone()?);
                        on_accept(self, stream, src, tag)
                    });
                    match r {
                        Ok(()) => {
                            self.accepted.fetch_add(1, Ordering::AcqRel);
                        }
                        Err(e) => eprintln!(
                            "{} node {}: bad incoming connection: {e:#}",
                            self.name, self.me
                        ),
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    std::thread::sleep(Duration::from_millis(2));
                }
                Err(e) => {
                    eprintln!("{} node {}: accept failed: {e}", self.name, self.me);
                    std::thread::sleep(Duration::from_millis(10));
                }
            }
        }
    }

    /// Reads an accepted connection's hello: (stream, source node, tag).
    fn hello(&self, mut stream: TcpStream) -> Result<(TcpStream, u16, u16)> {
        stream.set_nonblocking(false)?;
        stream.set_nodelay(true)?;
        stream.set_read_timeout(Some(Duration::from_secs(5)))?;
        let mut hello = [0u8; 4];
        stream.read_exact(&mut hello)?;
        stream.set_read_timeout(None)?;
        let src = u16::from_le_bytes([hello[0], hello[1]]);
        let tag = u16::from_le_bytes([hello[2], hello[3]]);
        Ok((stream, src, tag))
    }

    /// Connects to node `peer` (retrying until `deadline` while it is not
    /// listening yet) with `TCP_NODELAY` and sends the hello: this node's id
    /// and `tag`. Writes time out after `params.timeout_s`, so a lost peer
    /// fails the phase instead of hanging it.
    pub(super) fn dial(
        &self,
        setup: &BindingSetup,
        peer: u16,
        tag: u16,
        deadline: Instant,
    ) -> Result<TcpStream> {
        let addr = resolve(
            setup
                .address(peer)
                .ok_or_else(|| anyhow!("node {peer} has no address"))?,
        )?;
        let mut stream = loop {
            match TcpStream::connect_timeout(&addr, Duration::from_secs(2)) {
                Ok(s) => break s,
                Err(_) if Instant::now() < deadline => {
                    std::thread::sleep(Duration::from_millis(20));
                }
                Err(e) => bail!("cannot connect to node {peer} at {addr}: {e}"),
            }
        };
        stream.set_nodelay(true)?;
        stream.set_write_timeout(Some(Self::io_timeout(setup)))?;
        let mut hello = [0u8; 4];
        hello[..2].copy_from_slice(&self.me.to_le_bytes());
        hello[2..].copy_from_slice(&tag.to_le_bytes());
        stream.write_all(&hello)?;
        self.streams.lock().unwrap().push(stream.try_clone()?);
        Ok(stream)
    }

    /// How long a blocked write (or raw-tcp's response read) may take.
    pub(super) fn io_timeout(setup: &BindingSetup) -> Duration {
        Duration::from_secs(setup.params.timeout_s.max(1))
    }

    /// Runs `body` on the connection from `src` in a reader thread of its
    /// own; errors are reported unless the node is shutting down.
    pub(super) fn spawn_reader(
        self: &Arc<Self>,
        src: u16,
        stream: TcpStream,
        body: impl FnOnce(TcpStream) -> io::Result<()> + Send + 'static,
    ) -> Result<()> {
        let sh = self.clone();
        let h = std::thread::Builder::new()
            .name(format!("{}-rx-{}-{src}", self.name, self.me))
            .spawn(move || {
                if let Err(e) = body(stream) {
                    if !sh.stopped() {
                        eprintln!(
                            "{} node {}: connection with {src} failed: {e}",
                            sh.name, sh.me
                        );
                    }
                }
            })?;
        self.readers.lock().unwrap().push(h);
        Ok(())
    }

    /// Waits until `expected` incoming connections were accepted.
    pub(super) fn wait_accepted(&self, expected: usize, deadline: Instant) -> Result<()> {
        while self.accepted.load(Ordering::Acquire) < expected {
            if Instant::now() >= deadline {
                bail!(
                    "only {} of {expected} peer connections arrived",
                    self.accepted.load(Ordering::Acquire)
                );
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        Ok(())
    }

    pub(super) fn stopped(&self) -> bool {
        self.stop.load(Ordering::Acquire)
    }

    /// Stops accepting, closes every socket and joins the threads.
    pub(super) fn shutdown(&self) {
        self.stop.store(true, Ordering::Release);
        // The acceptor first, so that no connection arrives after the
        // sockets were closed.
        if let Some(h) = self.acceptor.lock().unwrap().take() {
            let _ = h.join();
        }
        for s in self.streams.lock().unwrap().drain(..) {
            let _ = s.shutdown(Shutdown::Both);
        }
        let readers: Vec<_> = self.readers.lock().unwrap().drain(..).collect();
        for h in readers {
            let _ = h.join();
        }
    }
}

impl RawTcp {
    /// Initialize phase: binds the listener and starts accepting.
    pub fn start(setup: &BindingSetup, me: u16, sink: Arc<Sink>) -> Result<Self> {
        let recv_buffer = setup.params.raw_tcp_recv_buffer.max(64 << 10);
        let sockets = Sockets::listen(setup, me, "raw-tcp", move |sockets, stream, src, _| {
            let sink = sink.clone();
            let mut wstream = stream.try_clone()?;
            // A request is answered on the connection it came on.
            sockets.spawn_reader(src, stream, move |mut stream| {
                read_frames(
                    &mut stream,
                    recv_buffer,
                    |kind, payload| match kind {
                        KIND_MSG => {
                            sink.deliver(src, payload);
                            Ok(())
                        }
                        KIND_REQ => {
                            write_frame(&mut wstream, KIND_RESP, payload)?;
                            sink.note_request(payload.len());
                            Ok(())
                        }
                        _ => Err(bad_kind()),
                    },
                    || Ok(()),
                )
            })
        })?;
        Ok(RawTcp {
            sockets,
            setup: setup.clone(),
            out: OnceLock::new(),
        })
    }

    fn conn(&self, thread: usize, dest: u16) -> Result<&Mutex<OutConn>> {
        self.out
            .get()
            .ok_or_else(|| anyhow!("not connected"))?
            .get(&dest)
            .and_then(|v| v.get(thread % v.len()))
            .ok_or_else(|| anyhow!("no connection to node {dest}"))
    }
}

pub(super) fn bad_kind() -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, "unexpected frame kind")
}

/// Reads frames until the peer closes: reads into one buffer of at least
/// `cap` bytes (grown for larger frames) and parses as many frames as it
/// holds, so a burst of small messages costs one `read`. Calls
/// `on_frame(kind, payload)` for every frame and `after_read()` once the
/// complete frames of a read are handled, before the next (blocking) read.
pub(super) fn read_frames(
    stream: &mut impl Read,
    cap: usize,
    mut on_frame: impl FnMut(u32, &[u8]) -> io::Result<()>,
    mut after_read: impl FnMut() -> io::Result<()>,
) -> io::Result<()> {
    let mut buf = vec![0u8; cap];
    let (mut start, mut end) = (0usize, 0usize);
    loop {
        let n = stream.read(&mut buf[end..])?;
        if n == 0 {
            return Ok(());
        }
        end += n;
        let mut need = 4;
        while end - start >= 4 {
            let h = u32::from_le_bytes(buf[start..start + 4].try_into().unwrap());
            let len = (h & LEN_MASK) as usize;
            if end - start - 4 < len {
                need = 4 + len;
                break;
            }
            on_frame(h >> 30, &buf[start + 4..start + 4 + len])?;
            start += 4 + len;
            need = 4;
        }
        after_read()?;
        if start == end {
            start = 0;
            end = 0;
        } else if start + need > buf.len() {
            buf.copy_within(start..end, 0);
            end -= start;
            start = 0;
            if need > buf.len() {
                buf.resize(need.next_power_of_two(), 0);
            }
        }
    }
}

/// Writes prefix + payload with one `write_vectored` (looping only on a
/// partial write): on a socket one `writev` per message; into a
/// `BufWriter` a copy into its buffer (a message as large as the buffer is
/// written straight through, again as one `writev`).
pub(super) fn write_frame(s: &mut impl Write, kind: u32, payload: &[u8]) -> io::Result<()> {
    if payload.len() > LEN_MASK as usize {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "message too large",
        ));
    }
    let hdr = (payload.len() as u32 | (kind << 30)).to_le_bytes();
    let total = 4 + payload.len();
    let mut done = 0;
    while done < total {
        let n = if done < 4 {
            s.write_vectored(&[IoSlice::new(&hdr[done..]), IoSlice::new(payload)])?
        } else {
            s.write(&payload[done - 4..])?
        };
        if n == 0 {
            return Err(io::ErrorKind::WriteZero.into());
        }
        done += n;
    }
    Ok(())
}

impl Binding for RawTcp {
    fn connect(&self, peers: &[u16], timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        let me = self.sockets.me;
        let threads = self.setup.threads.max(1);
        let mut out = HashMap::new();
        for &p in peers.iter().filter(|&&p| p != me) {
            let mut conns = Vec::with_capacity(threads);
            for t in 0..threads {
                let stream = self.sockets.dial(&self.setup, p, t as u16, deadline)?;
                // The requester reads its response itself.
                stream.set_read_timeout(Some(Sockets::io_timeout(&self.setup)))?;
                conns.push(Mutex::new(OutConn {
                    stream,
                    rbuf: Vec::new(),
                }));
            }
            out.insert(p, conns);
        }
        let expected = peers.iter().filter(|&&p| p != me).count() * threads;
        self.out
            .set(out)
            .map_err(|_| anyhow!("connect called twice"))?;
        self.sockets.wait_accepted(expected, deadline)
    }

    fn send(&self, thread: usize, dest: u16, payload: &[u8]) -> Result<()> {
        let c = self.conn(thread, dest)?;
        let mut c = c.lock().unwrap();
        write_frame(&mut c.stream, KIND_MSG, payload)
            .with_context(|| format!("send to node {dest}"))
    }

    fn request(&self, thread: usize, dest: u16, payload: &[u8]) -> Result<()> {
        let c = self.conn(thread, dest)?;
        let mut c = c.lock().unwrap();
        let OutConn { stream, rbuf } = &mut *c;
        write_frame(stream, KIND_REQ, payload).with_context(|| format!("request to {dest}"))?;
        let mut hdr = [0u8; 4];
        stream.read_exact(&mut hdr)?;
        let h = u32::from_le_bytes(hdr);
        if h >> 30 != KIND_RESP {
            bail!("expected a response from node {dest}");
        }
        let len = (h & LEN_MASK) as usize;
        if rbuf.len() < len {
            rbuf.resize(len, 0);
        }
        stream.read_exact(&mut rbuf[..len])?;
        Ok(())
    }

    fn shutdown(&self) {
        self.sockets.shutdown();
    }
}

impl Drop for RawTcp {
    fn drop(&mut self) {
        if !self.sockets.stopped() {
            self.sockets.shutdown();
        }
    }
}
