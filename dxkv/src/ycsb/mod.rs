//! YCSB (the Yahoo! Cloud Serving Benchmark) in Rust: its core workload's
//! generators and properties ([`generator`], [`workload`]), a driver that
//! runs the load and run phases on N client threads ([`driver`]), and the
//! bindings it drives ([`DxkvBinding`] natively over dxnet).

pub mod baselines;
pub mod driver;
pub mod generator;
#[cfg(feature = "redis")]
pub mod redis;
pub mod workload;

pub use driver::{run, Binding, Phase, Report, Session};
pub use workload::{Chooser, Distribution, FieldLength, Op, Workload};

use crate::client::Client;
use crate::record::Record;
use crate::store::{WriteMode, Written};

/// dxkv itself: every client thread shares one [`Client`] (one dxnet node,
/// one connection per storage node, the threads' requests aggregated).
pub struct DxkvBinding {
    client: Client,
}

impl DxkvBinding {
    /// Drives `client`.
    pub fn new(client: Client) -> Self {
        Self { client }
    }
}

struct DxkvSession(Client);

impl Binding for DxkvBinding {
    fn name(&self) -> String {
        "dxkv".into()
    }
    fn session(&self) -> Result<Box<dyn Session>, String> {
        Ok(Box::new(DxkvSession(self.client.clone())))
    }
}

impl Session for DxkvSession {
    fn insert(&mut self, key: &str, record: &Record) -> Result<(), String> {
        self.0
            .put(key.as_bytes(), record)
            .map(|_| ())
            .map_err(|e| e.to_string())
    }
    fn read(&mut self, key: &str, fields: Option<&[String]>) -> Result<Option<Record>, String> {
        let r = match fields {
            None => self.0.get(key.as_bytes()),
            Some(f) => {
                let names: Vec<&str> = f.iter().map(|s| s.as_str()).collect();
                self.0.get_fields(key.as_bytes(), &names)
            }
        };
        r.map(|v| v.map(|v| v.record)).map_err(|e| e.to_string())
    }
    fn update(&mut self, key: &str, fields: &Record) -> Result<(), String> {
        match self.0.write(key.as_bytes(), fields, WriteMode::Update) {
            Ok(Written::Stored(_)) => Ok(()),
            Ok(other) => Err(format!("update of {key}: {other:?}")),
            Err(e) => Err(e.to_string()),
        }
    }
    fn scan(
        &mut self,
        start: &str,
        count: u32,
        fields: Option<&[String]>,
    ) -> Result<usize, String> {
        let names: Option<Vec<&str>> = fields.map(|f| f.iter().map(|s| s.as_str()).collect());
        self.0
            .scan(start.as_bytes(), count, names.as_deref())
            .map(|v| v.len())
            .map_err(|e| e.to_string())
    }
}
