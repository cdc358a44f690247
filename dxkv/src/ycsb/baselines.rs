//! YCSB bindings for the stores users would pick instead: memcached (its
//! text protocol) and Redis (RESP through the
//! `redis` crate). Each client thread gets its own connection, as YCSB's
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

/// Redis at `address` (`host:port`).
pub struct RedisBinding {
    address: String,
}

impl RedisBinding {
    /// The server at `address`.
    pub fn new(address: &str) -> Self {
        Self {
            address: address.to_string(),
        }
    }
}

struct RedisSession(redis::Connection);

const INDEX: &str = "_indices";

/// The score of `key` in the scan index (YCSB's Redis binding uses Java's
/// `String.hashCode`; any fixed hash serves the same purpose).
fn score(key: &str) -> f64 {
    (xxhash_rust::xxh3::xxh3_64(key.as_bytes()) >> 12) as f64
}

impl Binding for RedisBinding {
    fn name(&self) -> String {
        "redis".into()
    }
    fn session(&self) -> Result<Box<dyn Session>, String> {
        let c = redis::Client::open(format!("redis://{}/", self.address))
            .and_then(|c| c.get_connection())
            .map_err(|e| format!("redis at {}: {e}", self.address))?;
        Ok(Box::new(RedisSession(c)))
    }
}

impl RedisSession {
    fn hset(&mut self, key: &str, record: &Record) -> redis::RedisResult<()> {
        let mut cmd = redis::cmd("HSET");
        cmd.arg(key);
        for (n, v) in record.fields() {
            cmd.arg(n).arg(v);
        }
        cmd.query(&mut self.0)
    }
}

fn to_record(pairs: Vec<(String, Vec<u8>)>) -> Result<Record, String> {
    Record::try_from_fields(pairs).map_err(|e| e.to_string())
}

impl Session for RedisSession {
    fn insert(&mut self, key: &str, record: &Record) -> Result<(), String> {
        self.hset(key, record).map_err(|e| e.to_string())?;
        redis::cmd("ZADD")
            .arg(INDEX)
            .arg(score(key))
            .arg(key)
            .query::<()>(&mut self.0)
            .map_err(|e| e.to_string())
    }
    fn read(&mut self, key: &str, fields: Option<&[String]>) -> Result<Option<Record>, String> {
        match fields {
            None => {
                let pairs: Vec<(String, Vec<u8>)> = redis::cmd("HGETALL")
                    .arg(key)
                    .query(&mut self.0)
                    .map_err(|e| e.to_string())?;
                if pairs.is_empty() {
                    return Ok(None);
                }
                to_record(pairs).map(Some)
            }
            Some(f) => {
                let vals: Vec<Option<Vec<u8>>> = redis::cmd("HMGET")
                    .arg(key)
                    .arg(f)
                    .query(&mut self.0)
                    .map_err(|e| e.to_string())?;
                if vals.iter().all(|v| v.is_none()) {
                    return Ok(None);
                }
                let pairs = f
                    .iter()
                    .zip(vals)
                    .filter_map(|(n, v)| Some((n.clone(), v?)))
                    .collect();
                to_record(pairs).map(Some)
            }
        }
    }
    fn update(&mut self, key: &str, fields: &Record) -> Result<(), String> {
        self.hset(key, fields).map_err(|e| e.to_string())
    }
    fn scan(
        &mut self,
        start: &str,
        count: u32,
        fields: Option<&[String]>,
    ) -> Result<usize, String> {
        let keys: Vec<String> = redis::cmd("ZRANGEBYSCORE")
            .arg(INDEX)
            .arg(score(start))
            .arg("+inf")
            .arg("LIMIT")
            .arg(0)
            .arg(count)
            .query(&mut self.0)
            .map_err(|e| e.to_string())?;
        let mut n = 0;
        for k in &keys {
            if self.read(k, fields)?.is_some() {
                n += 1;
            }
        }
        Ok(n)
    }
}
