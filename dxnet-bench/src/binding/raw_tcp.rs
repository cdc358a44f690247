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

const LEN_MASK: u32 = (1 << 30) - 1;
const KIND_MSG: u32 = 0;
const KIND_REQ: u32 = 1;
const KIND_RESP: u32 = 2;

/// One outgoing connection; `rbuf` holds responses read by the requester.
struct OutConn {
    stream: TcpStream,
    rbuf: Vec<u8>,
}

struct Shared {
    me: u16,
    sink: Arc<Sink>,
    stop: AtomicBool,
    accepted: AtomicUsize,
    incoming: Mutex<Vec<TcpStream>>,
    readers: Mutex<Vec<JoinHandle<()>>>,
    recv_buffer: usize,
}

/// The raw TCP baseline binding of one node.
pub struct RawTcp {
    shared: Arc<Shared>,
    setup: BindingSetup,
    out: OnceLock<HashMap<u16, Vec<Mutex<OutConn>>>>,
    acceptor: Mutex<Option<JoinHandle<()>>>,
}

fn resolve(addr: &str) -> Result<SocketAddr> {
    addr.to_socket_addrs()
        .with_context(|| format!("cannot resolve {addr}"))?
        .next()
        .ok_or_else(|| anyhow!("no address for {addr}"))
}

impl RawTcp {
    /// Initialize phase: binds the listener and starts accepting.
    pub fn start(setup: &BindingSetup, me: u16, sink: Arc<Sink>) -> Result<Self> {
        let addr = setup
            .address(me)
            .ok_or_else(|| anyhow!("node {me} has no address"))?;
        let listener = TcpListener::bind(resolve(addr)?)
            .with_context(|| format!("cannot listen on {addr}"))?;
        // Non-blocking accept so that shutdown never hangs on a missing peer.
        listener.set_nonblocking(true)?;
        let shared = Arc::new(Shared {
            me,
            sink,
            stop: AtomicBool::new(false),
            accepted: AtomicUsize::new(0),
            incoming: Mutex::new(Vec::new()),
            readers: Mutex::new(Vec::new()),
            recv_buffer: setup.params.raw_tcp_recv_buffer.max(64 << 10),
        });
        let sh = shared.clone();
        let acceptor = std::thread::Builder::new()
            .name(format!("raw-tcp-accept-{me}"))
            .spawn(move || accept_loop(listener, sh))?;
        Ok(RawTcp {
            shared,
            setup: setup.clone(),
            out: OnceLock::new(),
            acceptor: Mutex::new(Some(acceptor)),
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

fn accept_loop(listener: TcpListener, sh: Arc<Shared>) {
    while !sh.stop.load(Ordering::Acquire) {
        match listener.accept() {
            Ok((stream, _)) => {
                if let Err(e) = accept_one(stream, &sh) {
                    eprintln!("raw-tcp node {}: bad incoming connection: {e}", sh.me);
                }
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                std::thread::sleep(Duration::from_millis(2));
            }
            Err(e) => {
                eprintln!("raw-tcp node {}: accept failed: {e}", sh.me);
                std::thread::sleep(Duration::from_millis(10));
            }
        }
    }
}

fn accept_one(mut stream: TcpStream, sh: &Arc<Shared>) -> Result<()> {
    stream.set_nonblocking(false)?;
    stream.set_nodelay(true)?;
    stream.set_read_timeout(Some(Duration::from_secs(5)))?;
    let mut hello = [0u8; 4];
    stream.read_exact(&mut hello)?;
    stream.set_read_timeout(None)?;
    let src = u16::from_le_bytes([hello[0], hello[1]]);
    sh.incoming.lock().unwrap().push(stream.try_clone()?);
    let sh2 = sh.clone();
    let h = std::thread::Builder::new()
        .name(format!("raw-tcp-rx-{}-{src}", sh.me))
        .spawn(move || {
            if let Err(e) = reader_loop(stream, src, &sh2) {
                if !sh2.stop.load(Ordering::Acquire) {
                    eprintln!("raw-tcp node {}: connection from {src} failed: {e}", sh2.me);
                }
            }
        })?;
    sh.readers.lock().unwrap().push(h);
    sh.accepted.fetch_add(1, Ordering::AcqRel);
    Ok(())
}

/// Reads into one large buffer and parses as many frames as it holds, so a
/// burst of small messages costs one `read`.
fn reader_loop(mut stream: TcpStream, src: u16, sh: &Shared) -> io::Result<()> {
    let mut wstream = stream.try_clone()?;
    let mut buf = vec![0u8; sh.recv_buffer];
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
            let payload = &buf[start + 4..start + 4 + len];
            match h >> 30 {
                KIND_MSG => sh.sink.deliver(src, payload),
                KIND_REQ => {
                    write_frame(&mut wstream, KIND_RESP, payload)?;
                    sh.sink.note_request(len);
                }
                _ => {
                    return Err(io::Error::new(
                        io::ErrorKind::InvalidData,
                        "unexpected frame kind",
                    ))
                }
            }
            start += 4 + len;
            need = 4;
        }
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

/// One `writev` of prefix + payload (looping only on a partial write).
fn write_frame(s: &mut TcpStream, kind: u32, payload: &[u8]) -> io::Result<()> {
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
        let me = self.shared.me;
        let threads = self.setup.threads.max(1);
        let mut out = HashMap::new();
        for &p in peers.iter().filter(|&&p| p != me) {
            let addr = resolve(
                self.setup
                    .address(p)
                    .ok_or_else(|| anyhow!("node {p} has no address"))?,
            )?;
            let mut conns = Vec::with_capacity(threads);
            for t in 0..threads {
                let mut stream = loop {
                    match TcpStream::connect_timeout(&addr, Duration::from_secs(2)) {
                        Ok(s) => break s,
                        Err(e) if Instant::now() < deadline => {
                            let _ = e;
                            std::thread::sleep(Duration::from_millis(20));
                        }
                        Err(e) => bail!("cannot connect to node {p} at {addr}: {e}"),
                    }
                };
                stream.set_nodelay(true)?;
                // A lost peer fails the phase instead of hanging it.
                let io_timeout = Duration::from_secs(self.setup.params.timeout_s.max(1));
                stream.set_read_timeout(Some(io_timeout))?;
                stream.set_write_timeout(Some(io_timeout))?;
                let mut hello = [0u8; 4];
                hello[..2].copy_from_slice(&me.to_le_bytes());
                hello[2..].copy_from_slice(&(t as u16).to_le_bytes());
                stream.write_all(&hello)?;
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
        while self.shared.accepted.load(Ordering::Acquire) < expected {
            if Instant::now() >= deadline {
                bail!(
                    "only {} of {expected} peer connections arrived",
                    self.shared.accepted.load(Ordering::Acquire)
                );
            }
            std::thread::sleep(Duration::from_millis(2));
        }
        Ok(())
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
        self.shared.stop.store(true, Ordering::Release);
        if let Some(out) = self.out.get() {
            for c in out.values().flatten() {
                let _ = c.lock().unwrap().stream.shutdown(Shutdown::Both);
            }
        }
        for s in self.shared.incoming.lock().unwrap().drain(..) {
            let _ = s.shutdown(Shutdown::Both);
        }
        if let Some(h) = self.acceptor.lock().unwrap().take() {
            let _ = h.join();
        }
        let readers: Vec<_> = self.shared.readers.lock().unwrap().drain(..).collect();
        for h in readers {
            let _ = h.join();
        }
    }
}

impl Drop for RawTcp {
    fn drop(&mut self) {
        if !self.shared.stop.load(Ordering::Acquire) {
            self.shutdown();
        }
    }
}
