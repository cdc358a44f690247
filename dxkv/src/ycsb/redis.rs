//! The YCSB binding of Redis (feature `redis`): RESP through the `redis`
//! crate, one connection per client thread, a hash per key and a sorted set
//! of keys for scans (see `ycsb::baselines`).

use super::driver::{Binding, Session};
use crate::record::Record;

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

struct RedisSession(::redis::Connection);

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
        let c = ::redis::Client::open(format!("redis://{}/", self.address))
            .and_then(|c| c.get_connection())
            .map_err(|e| format!("redis at {}: {e}", self.address))?;
        Ok(Box::new(RedisSession(c)))
    }
}

impl RedisSession {
    fn hset(&mut self, key: &str, record: &Record) -> ::redis::RedisResult<()> {
        let mut cmd = ::redis::cmd("HSET");
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
        ::redis::cmd("ZADD")
            .arg(INDEX)
            .arg(score(key))
            .arg(key)
            .query::<()>(&mut self.0)
            .map_err(|e| e.to_string())
    }
    fn read(&mut self, key: &str, fields: Option<&[String]>) -> Result<Option<Record>, String> {
        match fields {
            None => {
                let pairs: Vec<(String, Vec<u8>)> = ::redis::cmd("HGETALL")
                    .arg(key)
                    .query(&mut self.0)
                    .map_err(|e| e.to_string())?;
                if pairs.is_empty() {
                    return Ok(None);
                }
                to_record(pairs).map(Some)
            }
            Some(f) => {
                let vals: Vec<Option<Vec<u8>>> = ::redis::cmd("HMGET")
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
        let keys: Vec<String> = ::redis::cmd("ZRANGEBYSCORE")
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
