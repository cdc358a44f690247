//! A node's configuration from its environment and from the launcher that
//! started it ([`Config::from_env`]), so that one command line starts a
//! cluster under Slurm, `mpirun`/`mpiexec` or a Kubernetes StatefulSet
//! without a file written per process.
//!
//! The layers, each over the one before:
//!
//! 1. `DXNET_CONFIG`: a TOML or JSON file (optional).
//! 2. `DXNET_<KEY>` and `DXNET_<SECTION>__<KEY>` set any key of the file:
//!    `DXNET_HANDLER_THREADS=4`, `DXNET_LIMITS__ORB_SIZE=1048576`,
//!    `DXNET_TRANSPORT=ib`. The value is read as a TOML value, and as a
//!    string when it is not one (`'"123"'` forces a string). A key that
//!    does not exist is an error naming it, as in a file.
//! 3. The node id, unless the file sets it: `DXNET_NODE_ID` (a number, or
//!    `ordinal`: the number ending the host name, as a StatefulSet's pod
//!    `dxkv-3` has), else the launcher's rank (`SLURM_PROCID`,
//!    `OMPI_COMM_WORLD_RANK`, `PMI_RANK` of MPICH's Hydra, `PMIX_RANK`).
//!    `DXNET_NODE_ID_OFFSET` is added to a rank or ordinal (two launches
//!    sharing one cluster).
//! 4. The node map, unless the file has one: from `DXNET_NODES` (a host
//!    list in Slurm's syntax, entries `host` or `host:port`), else
//!    `DXNET_HOSTFILE` (an MPI host file: `host slots=N` or `host:N`), else
//!    Slurm's `SLURM_JOB_NODELIST` with `SLURM_TASKS_PER_NODE`. Ranks fill
//!    the hosts in order (Slurm's block distribution, Open MPI's `--map-by
//!    slot`); the j-th rank on a host listens on its port + j, the port
//!    being the entry's own or `DXNET_PORT` (default 22222). Node id =
//!    offset + rank. A list of one host holds every rank (one machine).
//!    The number of ranks is the launcher's (`SLURM_NTASKS`,
//!    `OMPI_COMM_WORLD_SIZE`, `PMI_SIZE`), else the list's slots.
//! 5. `DXNET_SEEDS` (comma-separated `host[:port]`, e.g. a headless
//!    Service's name) turns discovery on with these seeds; without a host
//!    list the node map is then this node alone, at `DXNET_ADDRESS` (else
//!    `<host name>:<DXNET_PORT>`), and the others join as they answer.

mod hostlist;

use std::collections::BTreeMap;
use std::path::Path;

use crate::config::Config;
use crate::error::{Error, Result};

/// The launcher-side variables: everything else read starts with `DXNET_`.
const LAUNCHER_VARS: &[&str] = &[
    "SLURM_PROCID",
    "SLURM_NTASKS",
    "SLURM_JOB_NODELIST",
    "SLURM_NODELIST",
    "SLURM_TASKS_PER_NODE",
    "SLURM_JOB_ID",
    "OMPI_COMM_WORLD_RANK",
    "OMPI_COMM_WORLD_SIZE",
    "PMI_RANK",
    "PMI_SIZE",
    "PMIX_RANK",
    "HOSTNAME",
];

/// `DXNET_` names that steer the launch instead of setting a key.
const LAUNCH_KEYS: &[&str] = &[
    "CONFIG",
    "NODE_ID",
    "NODE_ID_OFFSET",
    "NODES",
    "HOSTFILE",
    "PORT",
    "SEEDS",
    "ADDRESS",
];

/// The port of an entry without one.
const DEFAULT_PORT: u16 = 22222;

impl Config {
    /// This process's configuration from its environment and launcher (see
    /// [`crate::launch`] for every variable and their order), validated.
    ///
    /// ```no_run
    /// // Under `srun -n 8 app`, `mpirun -np 8 -x DXNET_NODES=... app` or in
    /// // a StatefulSet with DXNET_NODE_ID=ordinal and DXNET_SEEDS=...:
    /// let node = dxnet::Node::start(dxnet::Config::from_env()?)?;
    /// # Ok::<(), dxnet::Error>(())
    /// ```
    pub fn from_env() -> Result<Self> {
        let mut vars: Vec<(String, String)> = std::env::vars().collect();
        if !vars.iter().any(|(k, _)| k == "HOSTNAME") {
            if let Ok(h) = std::fs::read_to_string("/proc/sys/kernel/hostname") {
                vars.push(("HOSTNAME".into(), h.trim().to_string()));
            }
        }
        Self::from_vars(vars)
    }

    /// [`Config::from_env`] with the variables given (reads no process
    /// state but the `DXNET_CONFIG` and `DXNET_HOSTFILE` files).
    pub fn from_vars(vars: impl IntoIterator<Item = (String, String)>) -> Result<Self> {
        let env: BTreeMap<String, String> = vars
            .into_iter()
            .filter(|(k, _)| k.starts_with("DXNET_") || LAUNCHER_VARS.contains(&k.as_str()))
            .collect();
        let launch = Launch { env: &env };
        let table = launch.table()?;
        let text = toml::to_string(&table).map_err(|e| Error::Config(e.to_string()))?;
        Config::from_toml(&text).map_err(|e| match e {
            Error::Config(m) => Error::Config(format!("{m} (configuration {})", launch.sources())),
            e => e,
        })
    }
}

/// The variables of one launch.
struct Launch<'a> {
    env: &'a BTreeMap<String, String>,
}

fn bad(m: String) -> Error {
    Error::Config(m)
}

impl Launch<'_> {
    fn get(&self, k: &str) -> Option<&str> {
        self.env.get(k).map(|v| v.trim()).filter(|v| !v.is_empty())
    }

    fn number<T: std::str::FromStr>(&self, k: &str) -> Result<Option<T>> {
        self.get(k)
            .map(|v| {
                v.parse()
                    .map_err(|_| bad(format!("{k}={v:?} is not a valid number here")))
            })
            .transpose()
    }

    /// Where the configuration came from, for errors.
    fn sources(&self) -> String {
        let mut s: Vec<String> = Vec::new();
        if let Some(f) = self.get("DXNET_CONFIG") {
            s.push(format!("file {f}"));
        }
        let vars: Vec<&str> = self
            .env
            .keys()
            .filter(|k| k.starts_with("DXNET_") && *k != "DXNET_CONFIG")
            .map(String::as_str)
            .collect();
        if !vars.is_empty() {
            s.push(format!("variables {}", vars.join(", ")));
        }
        if s.is_empty() {
            "from defaults".into()
        } else {
            format!("from {}", s.join(" and "))
        }
    }

    fn table(&self) -> Result<toml::Table> {
        let mut t = match self.get("DXNET_CONFIG") {
            Some(path) => file_table(Path::new(path))?,
            None => toml::Table::new(),
        };
        for (k, v) in self.env {
            let Some(key) = k.strip_prefix("DXNET_") else {
                continue;
            };
            if !LAUNCH_KEYS.contains(&key) {
                set_key(&mut t, k, key, v)?;
            }
        }
        if let Some(id) = self.node_id(t.get("node_id").is_some())? {
            t.insert("node_id".into(), i64::from(id).into());
        }
        let id = match t.get("node_id") {
            Some(v) => v
                .as_integer()
                .and_then(|i| u16::try_from(i).ok())
                .ok_or_else(|| bad(format!("node_id: {v} is not a node id")))?,
            None => 0,
        };
        let seeds = self.seeds()?;
        if !t.contains_key("nodes") {
            let nodes = match self.host_slots()? {
                Some(slots) => self.node_map(slots)?,
                None if !seeds.is_empty() => vec![(id, self.own_address()?)],
                None if self.rank()?.is_some() => {
                    return Err(bad(format!(
                        "launched as rank {} but no node map: set DXNET_NODES, \
                         DXNET_HOSTFILE or DXNET_SEEDS, or give one in DXNET_CONFIG",
                        self.rank()?.unwrap_or(0)
                    )))
                }
                None => Vec::new(),
            };
            let nodes: Vec<toml::Value> = nodes
                .into_iter()
                .map(|(id, address)| {
                    let mut e = toml::Table::new();
                    e.insert("id".into(), i64::from(id).into());
                    e.insert("address".into(), address.into());
                    e.into()
                })
                .collect();
            if !nodes.is_empty() {
                t.insert("nodes".into(), nodes.into());
            }
        }
        if !seeds.is_empty() {
            let d = t
                .entry("discovery")
                .or_insert_with(|| toml::Table::new().into());
            let d = d
                .as_table_mut()
                .ok_or_else(|| bad("discovery: not a section".into()))?;
            let list: Vec<toml::Value> = seeds.into_iter().map(Into::into).collect();
            d.insert("seeds".into(), list.into());
        }
        Ok(t)
    }

    /// The launcher's rank of this process.
    fn rank(&self) -> Result<Option<u32>> {
        for k in [
            "SLURM_PROCID",
            "OMPI_COMM_WORLD_RANK",
            "PMI_RANK",
            "PMIX_RANK",
        ] {
            if let Some(r) = self.number(k)? {
                return Ok(Some(r));
            }
        }
        Ok(None)
    }

    /// The launcher's number of ranks.
    fn size(&self) -> Result<Option<usize>> {
        for k in ["SLURM_NTASKS", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE"] {
            if let Some(n) = self.number(k)? {
                return Ok(Some(n));
            }
        }
        Ok(None)
    }

    fn offset(&self) -> Result<u32> {
        Ok(self.number("DXNET_NODE_ID_OFFSET")?.unwrap_or(0))
    }

    fn port(&self) -> Result<u16> {
        Ok(self.number("DXNET_PORT")?.unwrap_or(DEFAULT_PORT))
    }

    fn id(&self, base: u32) -> Result<u16> {
        let id = u64::from(base) + u64::from(self.offset()?);
        u16::try_from(id).map_err(|_| bad(format!("node id {id} is beyond 65535")))
    }

    /// The node id the environment gives, if any (`from_file`: the file
    /// sets one, which only `DXNET_NODE_ID` overrides).
    fn node_id(&self, from_file: bool) -> Result<Option<u16>> {
        match self.get("DXNET_NODE_ID") {
            Some("ordinal") => {
                let host = self.get("HOSTNAME").unwrap_or_default();
                let ordinal = host
                    .rsplit_once('-')
                    .and_then(|(_, n)| n.parse::<u32>().ok())
                    .ok_or_else(|| {
                        bad(format!(
                            "DXNET_NODE_ID=ordinal: the host name {host:?} does not end in -<number>"
                        ))
                    })?;
                return self.id(ordinal).map(Some);
            }
            Some(v) => {
                return v
                    .parse()
                    .map(Some)
                    .map_err(|_| bad(format!("DXNET_NODE_ID={v:?}: a node id or `ordinal`")))
            }
            None if from_file => return Ok(None),
            None => {}
        }
        match self.rank()? {
            Some(r) => self.id(r).map(Some),
            None => Ok(None),
        }
    }

    /// The hosts of the first host list given, with their slots.
    fn host_slots(&self) -> Result<Option<Vec<hostlist::Slots>>> {
        if let Some(list) = self.get("DXNET_NODES") {
            let hosts = hostlist::expand(list).map_err(|e| bad(format!("DXNET_NODES: {e}")))?;
            return Ok(Some(
                hosts
                    .into_iter()
                    .map(|host| hostlist::Slots { host, slots: 1 })
                    .collect(),
            ));
        }
        if let Some(path) = self.get("DXNET_HOSTFILE") {
            let text = std::fs::read_to_string(path)
                .map_err(|e| bad(format!("DXNET_HOSTFILE {path}: {e}")))?;
            return hostlist::host_file(&text)
                .map(Some)
                .map_err(|e| bad(format!("DXNET_HOSTFILE {path}: {e}")));
        }
        let Some(list) = self
            .get("SLURM_JOB_NODELIST")
            .or_else(|| self.get("SLURM_NODELIST"))
        else {
            return Ok(None);
        };
        let hosts = hostlist::expand(list).map_err(|e| bad(format!("SLURM_JOB_NODELIST: {e}")))?;
        let tasks = match self.get("SLURM_TASKS_PER_NODE") {
            Some(t) => hostlist::tasks_per_node(t)
                .map_err(|e| bad(format!("SLURM_TASKS_PER_NODE: {e}")))?,
            None => vec![1; hosts.len()],
        };
        if tasks.len() != hosts.len() {
            return Err(bad(format!(
                "SLURM_TASKS_PER_NODE names {} nodes, SLURM_JOB_NODELIST {}",
                tasks.len(),
                hosts.len()
            )));
        }
        Ok(Some(
            hosts
                .into_iter()
                .zip(tasks)
                .map(|(host, slots)| hostlist::Slots { host, slots })
                .collect(),
        ))
    }

    /// Ranks placed in order over the hosts' slots: (node id, address).
    fn node_map(&self, mut slots: Vec<hostlist::Slots>) -> Result<Vec<(u16, String)>> {
        let total: usize = slots.iter().map(|s| s.slots).sum();
        let size = self.size()?.unwrap_or(total);
        if slots.len() == 1 && size > total {
            slots[0].slots = size;
        } else if size > total {
            return Err(bad(format!(
                "{size} ranks but the host list has room for {total}"
            )));
        }
        if size > 1 << 16 {
            return Err(bad(format!("{size} ranks: node ids are 16-bit")));
        }
        let port = self.port()?;
        let mut nodes = Vec::with_capacity(size);
        'hosts: for s in &slots {
            let (host, first) = split_port(&s.host, port)?;
            for j in 0..s.slots {
                if nodes.len() == size {
                    break 'hosts;
                }
                let p = u16::try_from(usize::from(first) + j)
                    .map_err(|_| bad(format!("{}: port {first} + {j} is beyond 65535", s.host)))?;
                let id = self.id(nodes.len() as u32)?;
                nodes.push((id, format!("{host}:{p}")));
            }
        }
        Ok(nodes)
    }

    fn seeds(&self) -> Result<Vec<String>> {
        let Some(list) = self.get("DXNET_SEEDS") else {
            return Ok(Vec::new());
        };
        let port = self.port()?;
        list.split(',')
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(|s| split_port(s, port).map(|(h, p)| format!("{h}:{p}")))
            .collect()
    }

    fn own_address(&self) -> Result<String> {
        if let Some(a) = self.get("DXNET_ADDRESS") {
            return Ok(a.to_string());
        }
        let host = self.get("HOSTNAME").ok_or_else(|| {
            bad("DXNET_SEEDS without a node map needs DXNET_ADDRESS (or a host name)".into())
        })?;
        Ok(format!("{host}:{}", self.port()?))
    }
}

/// `host[:port]` (IPv6 in brackets) as host and port, `default` if none.
fn split_port(entry: &str, default: u16) -> Result<(&str, u16)> {
    match entry.rsplit_once(':') {
        Some((h, p)) if !h.is_empty() && (!h.contains(':') || h.ends_with(']')) => {
            let p = p.parse().map_err(|_| bad(format!("{entry:?}: bad port")))?;
            Ok((h, p))
        }
        _ => Ok((entry, default)),
    }
}

/// The keys a TOML or JSON file sets (only those: a key it leaves out can
/// still come from the launcher).
fn file_table(path: &Path) -> Result<toml::Table> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| bad(format!("DXNET_CONFIG: cannot read {}: {e}", path.display())))?;
    let at = |e: String| bad(format!("DXNET_CONFIG {}: {e}", path.display()));
    if path.extension().is_some_and(|e| e == "json") {
        let mut v: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| at(e.to_string()))?;
        drop_nulls(&mut v);
        toml::Table::try_from(v).map_err(|e| at(e.to_string()))
    } else {
        text.parse::<toml::Table>().map_err(|e| at(e.to_string()))
    }
}

/// JSON's `null` (an absent optional section) has no TOML form.
fn drop_nulls(v: &mut serde_json::Value) {
    match v {
        serde_json::Value::Object(m) => {
            m.retain(|_, x| !x.is_null());
            m.values_mut().for_each(drop_nulls);
        }
        serde_json::Value::Array(a) => a.iter_mut().for_each(drop_nulls),
        _ => {}
    }
}

/// Sets the key that `DXNET_<SECTION>__<KEY>` (`name`, without the prefix)
/// names to `value`.
fn set_key(t: &mut toml::Table, var: &str, name: &str, value: &str) -> Result<()> {
    let path: Vec<String> = name.split("__").map(str::to_lowercase).collect();
    if path.iter().any(String::is_empty) {
        return Err(bad(format!("{var}: empty key")));
    }
    let (last, sections) = path.split_last().expect("split gives one part at least");
    let mut at = t;
    for s in sections {
        at = at
            .entry(s.clone())
            .or_insert_with(|| toml::Table::new().into())
            .as_table_mut()
            .ok_or_else(|| bad(format!("{var}: `{s}` is not a section")))?;
    }
    at.insert(last.clone(), toml_value(value));
    Ok(())
}

/// `v` as a TOML value (`4`, `true`, `[1, 2]`, `"x"`), else as a string.
fn toml_value(v: &str) -> toml::Value {
    format!("v = {v}")
        .parse::<toml::Table>()
        .ok()
        .and_then(|mut t| t.remove("v"))
        .unwrap_or_else(|| v.to_string().into())
}

#[cfg(test)]
mod tests;
