//! A memcached front end: serves memcached's text protocol on a TCP port
//! for the whole cluster, each key read from or written to its storage
//! node through a [`Client`] (so any memcached client can use dxkv).
//!
//! An item is a record of three fields: `""` the data, `"flags"` (4 bytes)
//! and `"exp"` (8 bytes, the Unix second it expires, 0 for never). An
//! item's cas unique is its record's version. Expired items read as
//! missing (and are deleted when met). Conditional commands (`add`,
//! `replace`, `append`, `prepend`, `cas`, `incr`, `decr`, `touch`) read
//! the record and write it back only if its version is unchanged, so two
//! front ends (or a front end and a dxkv client) never lose each other's
//! updates.
//!
//! Limits: [`FrontendConfig::max_connections`] connections (one thread
//! each; beyond, a new connection gets `SERVER_ERROR too many open
//! connections` and is closed, as memcached does), a command line of at
//! most 2048 bytes and a value of at most `max_value` bytes per connection
//! buffer, and a write timeout after which a client that does not read
//! its replies is disconnected.
//!
//! [`Frontend::shutdown`] (and dropping the front end) stops in order: no
//! new connections, every command already received is answered, then each
//! connection is closed; connections still busy after
//! [`FrontendConfig::shutdown_timeout`] are left to the caller.

pub mod parse;

use std::collections::HashMap;
use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use self::parse::{Command, Limits, Parsed, StoreVerb};
use crate::client::{Client, Error, Versioned};
use crate::record::Record;
use crate::store::{WriteMode, Written};

/// Settings of the front end.
#[derive(Debug, Clone, Copy)]
pub struct FrontendConfig {
    /// Most connections served at once.
    pub max_connections: usize,
    /// Largest value accepted (memcached's `-I`, default 1 MiB).
    pub max_value: usize,
    /// A client that does not take its replies for this long is
    /// disconnected.
    pub write_timeout: Duration,
    /// How long a shutdown waits for the commands already received to be
    /// answered.
    pub shutdown_timeout: Duration,
}

impl Default for FrontendConfig {
    fn default() -> Self {
        Self {
            max_connections: 1024,
            max_value: 1 << 20,
            write_timeout: Duration::from_secs(30),
            shutdown_timeout: Duration::from_secs(5),
        }
    }
}

#[derive(Default)]
struct Counters {
    curr: AtomicUsize,
    total: AtomicU64,
    cmd_get: AtomicU64,
    cmd_set: AtomicU64,
    get_hits: AtomicU64,
    get_misses: AtomicU64,
}

struct Shared {
    client: Client,
    config: FrontendConfig,
    stop: AtomicBool,
    started: Instant,
    counters: Counters,
    /// A handle of every connection being served, to end its reads at
    /// shutdown.
    open: Mutex<Open>,
    /// Signalled when a connection ends.
    ended: Condvar,
}

#[derive(Default)]
struct Open {
    next: u64,
    streams: HashMap<u64, TcpStream>,
}

impl Shared {
    /// Registers a connection being served; `None` if its handle cannot
    /// be cloned (it is then refused).
    fn open(&self, conn: &TcpStream) -> Option<u64> {
        let handle = conn.try_clone().ok()?;
        let mut open = self.open.lock().unwrap_or_else(|e| e.into_inner());
        let id = open.next;
        open.next += 1;
        open.streams.insert(id, handle);
        Some(id)
    }

    fn close(&self, id: u64) {
        let mut open = self.open.lock().unwrap_or_else(|e| e.into_inner());
        open.streams.remove(&id);
        self.counters.curr.fetch_sub(1, Ordering::SeqCst);
        self.ended.notify_all();
    }
}

/// A running front end; shuts down in order when dropped (see
/// [`Frontend::shutdown`]).
pub struct Frontend {
    shared: Arc<Shared>,
    addr: SocketAddr,
    acceptor: Option<std::thread::JoinHandle<()>>,
}

impl Frontend {
    /// Listens on `addr` and serves memcached clients through `client`.
    pub fn start(client: Client, addr: &str, config: FrontendConfig) -> std::io::Result<Self> {
        let listener = TcpListener::bind(addr)?;
        let addr = listener.local_addr()?;
        let shared = Arc::new(Shared {
            client,
            config,
            stop: AtomicBool::new(false),
            started: Instant::now(),
            counters: Counters::default(),
            open: Mutex::new(Open::default()),
            ended: Condvar::new(),
        });
        let s = shared.clone();
        let acceptor = std::thread::Builder::new()
            .name("dxkv-memcached".into())
            .spawn(move || accept_loop(listener, s))?;
        Ok(Self {
            shared,
            addr,
            acceptor: Some(acceptor),
        })
    }

    /// The address it listens on.
    pub fn local_addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Frontend {
    /// Stops in order: accepts no more connections, answers every command
    /// already received, then closes each connection (its client reads the
    /// end of the stream). Returns how many connections were still being
    /// served when [`FrontendConfig::shutdown_timeout`] ran out (0: all
    /// ended).
    pub fn shutdown(mut self) -> usize {
        self.stop()
    }

    fn stop(&mut self) -> usize {
        let Some(acceptor) = self.acceptor.take() else {
            return 0;
        };
        self.shared.stop.store(true, Ordering::SeqCst);
        // Wake the acceptor out of `accept`; once it has returned no
        // connection is registered any more.
        let _ = TcpStream::connect(self.addr);
        let _ = acceptor.join();
        let deadline = Instant::now() + self.shared.config.shutdown_timeout;
        let mut open = self.shared.open.lock().unwrap_or_else(|e| e.into_inner());
        // Reads end (commands already read are still answered: writes stay
        // open), so each serving thread returns after its last reply.
        for conn in open.streams.values() {
            let _ = conn.shutdown(Shutdown::Read);
        }
        while !open.streams.is_empty() {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break;
            }
            open = match self.shared.ended.wait_timeout(open, left) {
                Ok((g, _)) => g,
                Err(e) => e.into_inner().0,
            };
        }
        open.streams.len()
    }
}

impl Drop for Frontend {
    fn drop(&mut self) {
        self.stop();
    }
}

fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
    for conn in listener.incoming() {
        if shared.stop.load(Ordering::SeqCst) {
            return;
        }
        let Ok(mut conn) = conn else { continue };
        let c = &shared.counters;
        if c.curr.fetch_add(1, Ordering::SeqCst) >= shared.config.max_connections {
            c.curr.fetch_sub(1, Ordering::SeqCst);
            let _ = conn.set_write_timeout(Some(Duration::from_secs(1)));
            let _ = conn.write_all(b"SERVER_ERROR too many open connections\r\n");
            continue;
        }
        let Some(id) = shared.open(&conn) else {
            c.curr.fetch_sub(1, Ordering::SeqCst);
            continue;
        };
        c.total.fetch_add(1, Ordering::Relaxed);
        let s = shared.clone();
        let spawned = std::thread::Builder::new()
            .name("dxkv-memcached-conn".into())
            .spawn(move || {
                let _ = serve(conn, &s);
                s.close(id);
            });
        if spawned.is_err() {
            shared.close(id);
        }
    }
}

/// Serves one connection until it closes, quits or misbehaves.
fn serve(mut conn: TcpStream, s: &Shared) -> std::io::Result<()> {
    let _ = conn.set_nodelay(true);
    conn.set_write_timeout(Some(s.config.write_timeout))?;
    let limits = Limits {
        max_line: 2048,
        max_value: s.config.max_value,
    };
    let mut buf: Vec<u8> = Vec::with_capacity(16 << 10);
    let mut out: Vec<u8> = Vec::with_capacity(16 << 10);
    let mut skip = 0usize; // bytes of a refused value still to drop
    let mut chunk = vec![0u8; 64 << 10];
    loop {
        let n = conn.read(&mut chunk)?;
        if n == 0 {
            return Ok(());
        }
        let mut data = &chunk[..n];
        if skip > 0 {
            let d = skip.min(data.len());
            skip -= d;
            data = &data[d..];
        }
        buf.extend_from_slice(data);
        let mut at = 0;
        while at < buf.len() {
            match parse::parse(&buf[at..], &limits) {
                Parsed::Incomplete => break,
                Parsed::Refused {
                    reply,
                    skip: k,
                    close,
                } => {
                    out.extend_from_slice(reply.as_bytes());
                    if close {
                        conn.write_all(&out)?;
                        return Ok(());
                    }
                    let here = k.min(buf.len() - at);
                    skip = k - here;
                    at += here;
                }
                Parsed::Command { cmd, used } => {
                    let quit = matches!(cmd, Command::Quit);
                    if !quit {
                        execute(cmd, s, &mut out, &mut conn)?;
                    }
                    at += used;
                    if quit {
                        conn.write_all(&out)?;
                        return Ok(());
                    }
                }
            }
        }
        buf.drain(..at);
        // Bounded: a partial command is at most a line and a value.
        debug_assert!(buf.len() <= limits.max_line + limits.max_value + 4);
        if !out.is_empty() {
            conn.write_all(&out)?;
            out.clear();
        }
    }
}

fn now_secs() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64)
}

/// memcached's exptime: 0 never, up to 30 days relative, else an absolute
/// Unix time; negative means already expired.
fn expiry(exptime: i64) -> i64 {
    const MONTH: i64 = 60 * 60 * 24 * 30;
    match exptime {
        0 => 0,
        e if e < 0 => -1,
        e if e <= MONTH => now_secs() + e,
        e => e,
    }
}

struct Item {
    version: u64,
    data: Vec<u8>,
    flags: u32,
    exp: i64,
}

fn item_record(data: &[u8], flags: u32, exp: i64) -> Record {
    Record::builder()
        .field("", data)
        .field("flags", &flags.to_le_bytes())
        .field("exp", &exp.to_le_bytes())
        .build()
}

fn item_of(v: Versioned) -> Option<Item> {
    let r = &v.record;
    let data = r.field("")?.to_vec();
    let flags = u32::from_le_bytes(r.field("flags").unwrap_or(&[0; 4]).try_into().ok()?);
    let exp = i64::from_le_bytes(r.field("exp").unwrap_or(&[0; 8]).try_into().ok()?);
    let item = Item {
        version: v.version,
        data,
        flags,
        exp,
    };
    Some(item)
}

fn live(item: &Item) -> bool {
    item.exp == 0 || item.exp > now_secs()
}

/// The live item under `key` (an expired one is deleted).
fn read_item(c: &Client, key: &[u8]) -> Result<Option<Item>, Error> {
    let Some(v) = c.get(key)? else {
        return Ok(None);
    };
    Ok(item_of(v).and_then(|it| {
        if live(&it) {
            Some(it)
        } else {
            let _ = c.delete(key);
            None
        }
    }))
}

fn server_error(out: &mut Vec<u8>, e: &Error) {
    let msg = e.to_string().replace(['\r', '\n'], " ");
    let _ = write!(out, "SERVER_ERROR {msg}\r\n");
}

fn execute(
    cmd: Command<'_>,
    s: &Shared,
    out: &mut Vec<u8>,
    conn: &mut TcpStream,
) -> std::io::Result<()> {
    let c = &s.client;
    let reply = |out: &mut Vec<u8>, noreply: bool, text: &str| {
        if !noreply {
            out.extend_from_slice(text.as_bytes());
        }
    };
    match cmd {
        Command::Get { keys, cas } => {
            s.counters
                .cmd_get
                .fetch_add(keys.len() as u64, Ordering::Relaxed);
            // In batches: one request per storage node each, values written
            // out as they come so a long key list needs no large buffer.
            for batch in keys.chunks(64) {
                let got = match c.multi_get(batch) {
                    Ok(g) => g,
                    Err(e) => {
                        server_error(out, &e);
                        return Ok(());
                    }
                };
                for (key, v) in batch.iter().zip(got) {
                    let item = v.and_then(item_of).filter(live);
                    let Some(item) = item else {
                        s.counters.get_misses.fetch_add(1, Ordering::Relaxed);
                        continue;
                    };
                    s.counters.get_hits.fetch_add(1, Ordering::Relaxed);
                    out.extend_from_slice(b"VALUE ");
                    out.extend_from_slice(key);
                    let _ = write!(out, " {} {}", item.flags, item.data.len());
                    if cas {
                        let _ = write!(out, " {}", item.version);
                    }
                    out.extend_from_slice(b"\r\n");
                    out.extend_from_slice(&item.data);
                    out.extend_from_slice(b"\r\n");
                }
                if out.len() > 256 << 10 {
                    conn.write_all(out)?;
                    out.clear();
                }
            }
            out.extend_from_slice(b"END\r\n");
        }
        Command::Store {
            verb,
            key,
            flags,
            exptime,
            data,
            unique,
            noreply,
        } => {
            s.counters.cmd_set.fetch_add(1, Ordering::Relaxed);
            match store(c, verb, key, flags, expiry(exptime), data, unique) {
                Ok(text) => reply(out, noreply, text),
                Err(e) => server_error(out, &e),
            }
        }
        Command::Delete { key, noreply } => {
            let r = read_item(c, key).and_then(|it| match it {
                Some(_) => c.delete(key).map(|v| v.is_some()),
                None => Ok(false),
            });
            match r {
                Ok(true) => reply(out, noreply, "DELETED\r\n"),
                Ok(false) => reply(out, noreply, "NOT_FOUND\r\n"),
                Err(e) => server_error(out, &e),
            }
        }
        Command::Arith {
            key,
            delta,
            incr,
            noreply,
        } => match arith(c, key, delta, incr) {
            Ok(Arith::Value(v)) => reply(out, noreply, &format!("{v}\r\n")),
            Ok(Arith::NotFound) => reply(out, noreply, "NOT_FOUND\r\n"),
            Ok(Arith::NotNumeric) => reply(
                out,
                noreply,
                "CLIENT_ERROR cannot increment or decrement non-numeric value\r\n",
            ),
            Err(e) => server_error(out, &e),
        },
        Command::Touch {
            key,
            exptime,
            noreply,
        } => {
            let exp = expiry(exptime);
            let r = modify(c, key, |it| Some((it.data.clone(), it.flags, exp)));
            match r {
                Ok(Some(_)) => reply(out, noreply, "TOUCHED\r\n"),
                Ok(None) => reply(out, noreply, "NOT_FOUND\r\n"),
                Err(e) => server_error(out, &e),
            }
        }
        Command::FlushAll { delay, noreply } => {
            let r = if delay <= 0 {
                c.clear()
            } else {
                let c = c.clone();
                let _ = std::thread::Builder::new()
                    .name("dxkv-memcached-flush".into())
                    .spawn(move || {
                        std::thread::sleep(Duration::from_secs(delay as u64));
                        let _ = c.clear();
                    });
                Ok(())
            };
            match r {
                Ok(()) => reply(out, noreply, "OK\r\n"),
                Err(e) => server_error(out, &e),
            }
        }
        Command::Version => {
            let _ = write!(out, "VERSION {}\r\n", env!("CARGO_PKG_VERSION"));
        }
        Command::Verbosity { noreply } => reply(out, noreply, "OK\r\n"),
        Command::Stats => stats(s, out),
        Command::Quit => {}
    }
    Ok(())
}

fn stats(s: &Shared, out: &mut Vec<u8>) {
    let c = &s.counters;
    let (mut items, mut bytes, mut limit) = (0, 0, 0);
    for &n in s.client.storage() {
        if let Ok(st) = s.client.stats(n) {
            items += st.keys;
            bytes += st.used;
            limit += st.limit;
        }
    }
    let mut stat = |name: &str, value: String| {
        let _ = write!(out, "STAT {name} {value}\r\n");
    };
    stat("pid", std::process::id().to_string());
    stat("uptime", s.started.elapsed().as_secs().to_string());
    stat("time", now_secs().to_string());
    stat("version", env!("CARGO_PKG_VERSION").to_string());
    stat("pointer_size", (usize::BITS).to_string());
    stat(
        "curr_connections",
        c.curr.load(Ordering::Relaxed).to_string(),
    );
    stat(
        "total_connections",
        c.total.load(Ordering::Relaxed).to_string(),
    );
    stat("cmd_get", c.cmd_get.load(Ordering::Relaxed).to_string());
    stat("cmd_set", c.cmd_set.load(Ordering::Relaxed).to_string());
    stat("get_hits", c.get_hits.load(Ordering::Relaxed).to_string());
    stat(
        "get_misses",
        c.get_misses.load(Ordering::Relaxed).to_string(),
    );
    stat("curr_items", items.to_string());
    stat("bytes", bytes.to_string());
    stat("limit_maxbytes", limit.to_string());
    stat("storage_nodes", s.client.storage().len().to_string());
    out.extend_from_slice(b"END\r\n");
}

/// Reads the live item under `key`, lets `f` make the new (data, flags,
/// exp), writes it if the item is unchanged (else tries again). `None` if
/// there is no live item (or `f` declined).
fn modify(
    c: &Client,
    key: &[u8],
    mut f: impl FnMut(&Item) -> Option<(Vec<u8>, u32, i64)>,
) -> Result<Option<u64>, Error> {
    loop {
        let Some(item) = read_item(c, key)? else {
            return Ok(None);
        };
        let Some((data, flags, exp)) = f(&item) else {
            return Ok(None);
        };
        match c.write(
            key,
            &item_record(&data, flags, exp),
            WriteMode::IfVersion(item.version),
        )? {
            Written::Stored(v) => return Ok(Some(v)),
            Written::Missing | Written::Changed(_) | Written::Exists => continue,
        }
    }
}

fn store(
    c: &Client,
    verb: StoreVerb,
    key: &[u8],
    flags: u32,
    exp: i64,
    data: &[u8],
    unique: u64,
) -> Result<&'static str, Error> {
    let rec = || item_record(data, flags, exp);
    match verb {
        StoreVerb::Set => {
            if exp < 0 {
                // Stored and expired at once: nothing to read back.
                c.delete(key)?;
            } else {
                c.put(key, &rec())?;
            }
            Ok("STORED\r\n")
        }
        StoreVerb::Add => loop {
            match read_item(c, key)? {
                Some(_) => return Ok("NOT_STORED\r\n"),
                None => {
                    if c.insert(key, &rec())?.is_some() {
                        return Ok("STORED\r\n");
                    }
                    // An expired record was still there (now deleted) or a
                    // concurrent add won: look again.
                }
            }
        },
        StoreVerb::Replace => Ok(
            match modify(c, key, |_| Some((data.to_vec(), flags, exp)))? {
                Some(_) => "STORED\r\n",
                None => "NOT_STORED\r\n",
            },
        ),
        StoreVerb::Append | StoreVerb::Prepend => {
            // memcached keeps the item's flags and expiry on append/prepend.
            let r = modify(c, key, |it| {
                let mut d = Vec::with_capacity(it.data.len() + data.len());
                if verb == StoreVerb::Append {
                    d.extend_from_slice(&it.data);
                    d.extend_from_slice(data);
                } else {
                    d.extend_from_slice(data);
                    d.extend_from_slice(&it.data);
                }
                Some((d, it.flags, it.exp))
            })?;
            Ok(if r.is_some() {
                "STORED\r\n"
            } else {
                "NOT_STORED\r\n"
            })
        }
        StoreVerb::Cas => {
            let Some(item) = read_item(c, key)? else {
                return Ok("NOT_FOUND\r\n");
            };
            if item.version != unique {
                return Ok("EXISTS\r\n");
            }
            Ok(match c.write(key, &rec(), WriteMode::IfVersion(unique))? {
                Written::Stored(_) => "STORED\r\n",
                Written::Missing => "NOT_FOUND\r\n",
                _ => "EXISTS\r\n",
            })
        }
    }
}

enum Arith {
    Value(u64),
    NotFound,
    NotNumeric,
}

fn arith(c: &Client, key: &[u8], delta: u64, incr: bool) -> Result<Arith, Error> {
    let mut result = Arith::NotFound;
    let written = modify(c, key, |it| {
        let n = std::str::from_utf8(&it.data)
            .ok()
            .map(|s| s.trim_end_matches(' '))
            .filter(|s| !s.is_empty() && s.len() <= 20)
            .and_then(|s| s.parse::<u64>().ok());
        let Some(n) = n else {
            result = Arith::NotNumeric;
            return None;
        };
        // As memcached: incr wraps at 2^64, decr stops at 0.
        let v = if incr {
            n.wrapping_add(delta)
        } else {
            n.saturating_sub(delta)
        };
        result = Arith::Value(v);
        Some((v.to_string().into_bytes(), it.flags, it.exp))
    })?;
    Ok(match (written, result) {
        (Some(_), r @ Arith::Value(_)) => r,
        (_, Arith::NotNumeric) => Arith::NotNumeric,
        _ => Arith::NotFound,
    })
}
