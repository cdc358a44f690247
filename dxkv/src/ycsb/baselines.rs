//! YCSB bindings for the stores users would pick instead: memcached (its
//! text protocol) and, with the `redis` feature, Redis (RESP through the
//! `redis` crate, in `ycsb::redis`). Each client thread gets its own connection, as YCSB's
//! bindings do, and records are stored as those bindings store them:
//!
//! - memcached: the whole record as one value per key (dxkv's record
//!   encoding instead of YCSB's JSON: same size class, no parsing cost on
//!   either side); an update replaces the value with the updated fields
//!   (YCSB's memcached binding does the same); scans are not supported.
//! - Redis: a hash per key (`HSET key field value ...`; reads `HGETALL` or
//!   `HMGET`), and, for scans, each key in a sorted set `_indices` scored
//!   by a hash of the key (`ZRANGEBYSCORE` from the start key's score,
//!   then the hashes), as YCSB's Redis binding does.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;

use super::driver::{Binding, Session};
use crate::record::Record;

/// memcached at `address` (`host:port`).
pub struct MemcachedBinding {
    address: String,
}

impl MemcachedBinding {
    /// The server at `address`.
    pub fn new(address: &str) -> Self {
        Self {
            address: address.to_string(),
        }
    }
}

/// One connection speaking memcached's text protocol. Hand-written rather
/// than the `memcache` crate: that client (a connection pool behind every
/// call) reached half the gets per second of libmemcached's `memcslap`
/// against the same server with 100 threads, which would understate
/// memcached; this one sends a command in one write and parses the reply
/// from a buffered reader.
struct MemcachedSession {
    reader: BufReader<TcpStream>,
    out: Vec<u8>,
    line: Vec<u8>,
}

impl Binding for MemcachedBinding {
    fn name(&self) -> String {
        "memcached".into()
    }
    fn session(&self) -> Result<Box<dyn Session>, String> {
        let s = TcpStream::connect(&self.address)
            .map_err(|e| format!("memcached at {}: {e}", self.address))?;
        let _ = s.set_nodelay(true);
        Ok(Box::new(MemcachedSession {
            reader: BufReader::with_capacity(64 << 10, s),
            out: Vec::with_capacity(4096),
            line: Vec::with_capacity(128),
        }))
    }
}

impl MemcachedSession {
    fn send(&mut self) -> Result<(), String> {
        self.reader
            .get_mut()
            .write_all(&self.out)
            .map_err(|e| e.to_string())
    }

    fn read_line(&mut self) -> Result<&[u8], String> {
        self.line.clear();
        let n = self
            .reader
            .read_until(b'\n', &mut self.line)
            .map_err(|e| e.to_string())?;
        if n == 0 {
            return Err("memcached closed the connection".into());
        }
        Ok(self.line.strip_suffix(b"\r\n").unwrap_or(&self.line))
    }

    fn store(&mut self, verb: &str, key: &str, value: &[u8]) -> Result<bool, String> {
        self.out.clear();
        write!(self.out, "{verb} {key} 0 0 {}\r\n", value.len()).expect("to a Vec");
        self.out.extend_from_slice(value);
        self.out.extend_from_slice(b"\r\n");
        self.send()?;
        match self.read_line()? {
            b"STORED" => Ok(true),
            b"NOT_STORED" => Ok(false),
            other => Err(format!("{verb}: {}", String::from_utf8_lossy(other))),
        }
    }
}

impl Session for MemcachedSession {
    fn insert(&mut self, key: &str, record: &Record) -> Result<(), String> {
        self.store("set", key, record.as_bytes()).map(|_| ())
    }
    fn read(&mut self, key: &str, fields: Option<&[String]>) -> Result<Option<Record>, String> {
        self.out.clear();
        write!(self.out, "get {key}\r\n").expect("to a Vec");
        self.send()?;
        let line = self.read_line()?;
        if line == b"END" {
            return Ok(None);
        }
        let len: usize = line
            .strip_prefix(b"VALUE ")
            .and_then(|l| std::str::from_utf8(l).ok())
            .and_then(|l| l.split(' ').nth(2))
            .and_then(|n| n.parse().ok())
            .ok_or_else(|| format!("get: {}", String::from_utf8_lossy(line)))?;
        let mut value = vec![0; len + 2];
        self.reader
            .read_exact(&mut value)
            .map_err(|e| e.to_string())?;
        value.truncate(len);
        if self.read_line()? != b"END" {
            return Err("get: no END after the value".into());
        }
        let r = Record::from_bytes(value).map_err(|e| e.to_string())?;
        Ok(Some(match fields {
            Some(f) => r.select(f),
            None => r,
        }))
    }
    fn update(&mut self, key: &str, fields: &Record) -> Result<(), String> {
        match self.store("replace", key, fields.as_bytes())? {
            true => Ok(()),
            false => Err(format!("replace of {key}: NOT_STORED")),
        }
    }
    fn scan(&mut self, _: &str, _: u32, _: Option<&[String]>) -> Result<usize, String> {
        Err("memcached has no scan".into())
    }
}

#[cfg(feature = "redis")]
pub use super::redis::RedisBinding;
