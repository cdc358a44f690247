//! A node process (`dxnet-bench node`): hosts one or more logical nodes,
//! follows the coordinator's phases over the control channel and reports
//! what it measured.

use std::sync::Arc;
use std::time::Duration;

use anyhow::{anyhow, bail, Result};

use crate::binding::{self, BindingKind, BindingSetup, Sink, WireSource};
use crate::config::RunSpec;
use crate::metrics::{self, NodeResult, ProcResult, WireDelta};
use crate::ops::{self, LocalNode, PhaseCtx};
use crate::proto::{Channel, Command, Reply};

/// A measured phase waiting for [`Command::Collect`].
struct Measured {
    nodes: Vec<NodeResult>,
    cpu0: f64,
    wire0: Vec<Option<u64>>,
    /// Each logical node's latency breakdown before the phase.
    breakdown0: Vec<Option<dxnet::breakdown::LatencyBreakdown>>,
    /// Each logical node's count of answered requests before the phase.
    requests0: Vec<u64>,
}

struct Prepared {
    run: RunSpec,
    payloads: Vec<Vec<u8>>,
}

/// The state of a node process between commands.
pub struct Worker {
    ids: Vec<u16>,
    setup: Option<BindingSetup>,
    nodes: Vec<LocalNode>,
    wire: Vec<WireSource>,
    prepared: Option<Prepared>,
    measured: Option<Measured>,
}

impl Worker {
    /// A worker hosting the logical nodes `ids`.
    pub fn new(ids: Vec<u16>) -> Self {
        Worker {
            ids,
            setup: None,
            nodes: Vec::new(),
            wire: Vec::new(),
            prepared: None,
            measured: None,
        }
    }

    fn setup(&self) -> Result<&BindingSetup> {
        self.setup
            .as_ref()
            .ok_or_else(|| anyhow!("not initialized"))
    }

    fn ctx<'a>(&'a self, p: &'a Prepared) -> Result<PhaseCtx<'a>> {
        let s = self.setup()?;
        Ok(PhaseCtx {
            run: &p.run,
            n: s.nodes.len(),
            threads: s.threads,
            payloads: &p.payloads,
            timeout: Duration::from_secs(s.params.timeout_s),
            spin: Duration::from_micros(s.params.spin_us),
            window: s.params.rdma_window,
        })
    }

    /// Handles one command; `Ok(None)` means exit.
    pub fn handle(&mut self, cmd: Command) -> Result<Option<Reply>> {
        match cmd {
            Command::Init { setup } => {
                self.cleanup();
                let kind = BindingKind::parse(&setup.binding)?;
                for &id in &self.ids {
                    let sink = Arc::new(Sink::new());
                    sink.set_work_ns(setup.params.handler_work_ns);
                    sink.set_block_us(setup.params.handler_block_us);
                    let b = binding::create(&setup, id, sink.clone())?;
                    self.nodes.push(LocalNode {
                        id,
                        binding: b,
                        sink,
                    });
                    if let Some(w) = setup.address(id).and_then(|a| kind.wire(a, &setup.params)) {
                        if !self.wire.contains(&w) {
                            self.wire.push(w);
                        }
                    }
                }
                self.setup = Some(*setup);
            }
            Command::Connect => {
                let s = self.setup()?;
                let peers: Vec<u16> = s.nodes.iter().map(|(id, _)| *id).collect();
                let timeout = Duration::from_secs(s.params.timeout_s);
                std::thread::scope(|sc| -> Result<()> {
                    let hs: Vec<_> = self
                        .nodes
                        .iter()
                        .map(|ln| sc.spawn(|| ln.binding.connect(&peers, timeout)))
                        .collect();
                    for h in hs {
                        h.join().map_err(|_| anyhow!("connect panicked"))??;
                    }
                    Ok(())
                })?;
            }
            Command::Prepare { run } => {
                let threads = self.setup()?.threads;
                let p = Prepared {
                    payloads: ops::make_payloads(run.size, threads),
                    run,
                };
                let first = if p.run.warmup > 0 {
                    p.run.warmup
                } else {
                    p.run.count
                };
                ops::arm(&self.nodes, &self.ctx(&p)?, first);
                self.prepared = Some(p);
            }
            Command::Warmup => {
                let p = self
                    .prepared
                    .as_ref()
                    .ok_or_else(|| anyhow!("not prepared"))?;
                let ctx = self.ctx(p)?;
                if p.run.warmup > 0 {
                    ops::run_phase(&self.nodes, &ctx, p.run.warmup)?;
                    ops::arm(&self.nodes, &ctx, p.run.count);
                }
            }
            Command::Measure { .. } => {
                let p = self
                    .prepared
                    .as_ref()
                    .ok_or_else(|| anyhow!("not prepared"))?;
                let ctx = self.ctx(p)?;
                let wire0: Vec<Option<u64>> = self.wire.iter().map(metrics::read_wire).collect();
                let breakdown0 = self
                    .nodes
                    .iter()
                    .map(|ln| ln.binding.latency_breakdown())
                    .collect();
                let requests0 = self.nodes.iter().map(|ln| ln.sink.requests()).collect();
                let cpu0 = metrics::process_cpu_s();
                let nodes = ops::run_phase(&self.nodes, &ctx, p.run.count)?;
                ops::arm(&self.nodes, &ctx, p.run.count);
                self.measured = Some(Measured {
                    nodes,
                    cpu0,
                    wire0,
                    breakdown0,
                    requests0,
                });
            }
            Command::Collect => {
                // Read the counters only now that every node is done: the
                // last bytes a sender wrote may still have been in its socket
                // buffer when its own phase ended.
                let m = self
                    .measured
                    .take()
                    .ok_or_else(|| anyhow!("nothing measured"))?;
                let cpu_s = metrics::process_cpu_s() - m.cpu0;
                let wire = self
                    .wire
                    .iter()
                    .zip(m.wire0)
                    .filter_map(|(w, a)| {
                        let b = metrics::read_wire(w)?;
                        Some(WireDelta {
                            key: metrics::wire_key(w),
                            bytes: b.saturating_sub(a?),
                        })
                    })
                    .collect();
                // Connection statistics now too: a received buffer is
                // counted once all its messages ran, which may be just
                // after the sink saw the last one.
                let mut nodes = m.nodes;
                for n in &mut nodes {
                    if let Some(k) = self.nodes.iter().position(|ln| ln.id == n.id) {
                        let b = &self.nodes[k].binding;
                        n.connections = b.connection_stats();
                        // The requester's stages are stamped when it holds
                        // its response: every round trip of the phase is
                        // in by now. A responder records its stages once
                        // its response left, which may be just after the
                        // requester got it: wait (briefly) for every
                        // request it answered.
                        let answered = self.nodes[k].sink.requests() - m.requests0[k];
                        let until = std::time::Instant::now() + std::time::Duration::from_secs(2);
                        n.breakdown = loop {
                            let d = b
                                .latency_breakdown()
                                .zip(m.breakdown0[k].as_ref())
                                .map(|(after, before)| after.since(before));
                            let settled = d.as_ref().is_none_or(|d| d.served() >= answered);
                            if settled || std::time::Instant::now() >= until {
                                break d;
                            }
                            std::thread::sleep(std::time::Duration::from_millis(1));
                        };
                    }
                }
                return Ok(Some(Reply::Measured {
                    result: ProcResult { nodes, cpu_s, wire },
                }));
            }
            Command::Cleanup => self.cleanup(),
            Command::Exit => {
                self.cleanup();
                return Ok(None);
            }
        }
        Ok(Some(Reply::Ok))
    }

    fn cleanup(&mut self) {
        self.prepared = None;
        self.measured = None;
        std::thread::scope(|sc| {
            for ln in &self.nodes {
                sc.spawn(|| ln.binding.shutdown());
            }
        });
        self.nodes.clear();
        self.wire.clear();
        self.setup = None;
    }
}

/// Entry point of `dxnet-bench node`.
pub fn run(coord: &str, ids: Vec<u16>) -> Result<()> {
    if ids.is_empty() {
        bail!("a node process needs at least one id");
    }
    let mut ch = Channel::connect(coord, Duration::from_secs(120))?;
    ch.send(&Reply::Hello {
        ids: ids.clone(),
        pid: std::process::id(),
        cpus: crate::affinity::allowed_cpus().unwrap_or_default(),
    })?;
    let mut w = Worker::new(ids);
    loop {
        let cmd: Command = ch.recv(None)?;
        match w.handle(cmd) {
            Ok(Some(r)) => ch.send(&r)?,
            Ok(None) => {
                ch.send(&Reply::Ok)?;
                return Ok(());
            }
            Err(e) => ch.send(&Reply::Failed {
                error: format!("{e:#}"),
            })?,
        }
    }
}
